"""The logic of notebooks/02_kda.ipynb (the KDA sweep, its targets, plots and the drift study), so the
notebook stays a parameters cell and a few calls.

    bd = sweep_bundle(bundle="", sweep=True, heads="6,12", batches="1,64", Ts="1,4", tiles="16,128", ...)
    df = frame(bd)                       # one row per bundle row: case axes, impl, time, floor, errors
    targets(df)                          # the issue targets per implementation (12 heads)
    decode_figures(df), verify_figures(df), winners(bd), numerics_figure(df)
    drift(bd, steps, every=10, ...)      # fp32 vs bf16 state against fp64; notes added to the bundle

Comma-separated parameters ("1,2,4") are what papermill passes; plots are plotly express figures for
`k3lab.report.show`.
"""
from __future__ import annotations

from typing import Any

import pandas as pd
import torch

from k3lab.report import param_values

COLUMNS = ["heads", "batch", "T", "tile_v", "case", "impl", "kind", "mode", "median_us", "floor_us", "floor_bw",
           "tbps", "pct_bw", "launches", "out_err", "state_err", "ok"]
# (label, batch, T, goal) at 12 heads: the KDA issue's targets
TARGETS = [("T=1 B=1 us", 1, 1, "<= 4.0 us"), ("T=1 B=64 TB/s", 64, 1, ">= 3.6 TB/s"),
           ("T=4 B=1 us", 1, 4, "<= 6.0 us")]


def sweep_bundle(*, bundle: str = "", sweep: bool = True, heads: Any = "6,12", batches: Any = "1,64",
                 Ts: Any = "1,4", tiles: Any = "16,128", backends: str = "triton,cute", D: int = 128,
                 peers: bool = True, reps: int = 50, deadline_s: float = 0, log=print):
    """The bundle the notebook shows: a saved sweep (`bundle`, never changed), an empty bundle with this
    device's probes (`sweep=False`: the drift study alone), or a fresh `k3lab bench kda` sweep over the grid."""
    from k3lab.bench import runner
    from k3lab.harness import timing
    from k3lab.harness.bundle import Bundle, load

    if bundle:
        bd = load(bundle)
        log(f"loaded {bundle} measured on {bd.env.get('gpu') or bd.env.get('gpu_name')} {bd.created}")
    elif not sweep:
        dev = "cuda" if torch.cuda.is_available() else "cpu"
        pr = timing.probes(dev)
        bd = Bundle.new("kda_drift" if dev == "cuda" else "kda_drift-cpu", copy_tbps=pr["copy_tbps"],
                        read_tbps=pr["read_tbps"], launch_floor_us=pr["launch_us"])
        bd.config = {"bench": "kda", "sweep": False, "rows_expected": False}  # the drift study: notes, no rows
    else:
        device = "cuda" if torch.cuda.is_available() else "cpu"
        grid = dict(heads=param_values(heads, "heads", ints=True), batch=param_values(batches, "batches", ints=True),
                    T=param_values(Ts, "Ts", ints=True), tile_v=param_values(tiles, "tiles", ints=True), D=(int(D),))
        bd = runner.run("kda", grid=grid, backends=param_values(backends, "backends"), peers=peers,
                        reps=reps, device=device, deadline_s=deadline_s or None, log=lambda s: None,
                        variants={"cute_pdl": ("cute", {"pdl": True})},
                        name="kda_sweep" if device == "cuda" else "kda_sweep-cpu")
    log("copy %.3f TB/s, read %.3f TB/s, launch floor %.2f us" % (bd.copy_tbps, bd.read_tbps or 0,
                                                                   bd.launch_floor_us))
    log(f"skipped backends: {bd.backends_skipped}")
    return bd


def state_err(e: dict) -> float | None:
    """The saved state's error (decode: state; verify: its history); older bundles: state_rel_norm."""
    outs = e.get("outputs") or {}
    s = outs.get("state") or outs.get("state_hist") or {}
    return s.get("rel_norm", e.get("state_rel_norm"))


def out_err(e: dict) -> float | None:
    return ((e.get("outputs") or {}).get("out") or {}).get("rel_norm", e.get("rel_norm"))


def frame(bd) -> pd.DataFrame:
    """One row per bundle row: case axes, implementation, timing kind and mode, median, floor, bandwidth,
    launches, output and state errors against fp64, whether the check passed."""
    if not bd.rows:
        return pd.DataFrame(columns=COLUMNS)
    return pd.DataFrame([
        dict({k: v for k, v in r.extra.items() if k in ("heads", "batch", "T", "tile_v", "case")}, impl=r.backend,
             kind=r.kind, mode=r.mode, median_us=r.median_us, floor_us=r.floor_us, floor_bw=r.floor_bw,
             tbps=r.achieved_tbps, pct_bw=r.pct_of_bw, launches=r.launches, out_err=out_err(r.error or {}),
             state_err=state_err(r.error or {}), ok=(r.error or {}).get("ok")) for r in bd.rows])


def targets(df: pd.DataFrame, heads: int = 12) -> pd.DataFrame:
    """Per target and implementation, its fastest row at `heads` heads (the best tile)."""
    rows = []
    for what, B, T, goal in TARGETS:
        for impl in sorted(df.impl.unique()):
            q = df[(df.impl == impl) & (df.heads == heads) & (df.batch == B) & (df["T"] == T)]
            if not len(q):
                continue
            r = q.sort_values("median_us").iloc[0]
            rows.append(dict(target=what, goal=goal, impl=impl, tile_v=r.tile_v, median_us=round(r.median_us, 2),
                             TBps=round(r.tbps, 3), pct_bw=round(r.pct_bw, 1), floor_bw=r.floor_bw, mode=r.mode,
                             ok=r.ok))
    return pd.DataFrame(rows)


def best(df: pd.DataFrame) -> pd.DataFrame:
    """Each implementation at its fastest tile per (heads, batch, T)."""
    return df.sort_values("median_us").groupby(["impl", "heads", "batch", "T"], as_index=False).first()


def decode_figures(df: pd.DataFrame) -> list:
    """Decode (T = 1): median and % of the copy bandwidth against batch, every implementation at its best tile."""
    import plotly.express as px

    d1 = best(df)
    d1 = d1[d1["T"] == 1]
    return [px.line(d1, x="batch", y="median_us", color="impl", facet_col="heads", markers=True, log_x=True,
                    log_y=True, title="KDA decode: graph-replay median per call (us)"),
            px.line(d1, x="batch", y="pct_bw", color="impl", facet_col="heads", markers=True, log_x=True,
                    title="KDA decode: bytes moved / time, % of the floor's bandwidth (copy)")]


def verify_figures(df: pd.DataFrame) -> list:
    """Per own implementation and head count, median us against batch, one line a tile width, one panel a T (line
    and bar traces only: the reports' shared plotly.js is the basic bundle); then the verify (T > 1) lines at
    each implementation's best tile."""
    import plotly.express as px

    figs = []
    ours = df[df.impl.isin(["triton", "cute"])]
    for impl in ("triton", "cute"):
        for H in sorted(ours.heads.unique()):
            sub = ours[(ours.heads == H) & (ours.impl == impl)]
            if len(sub):
                sub = sub.assign(tile=sub.tile_v.astype(str)).sort_values(["T", "tile_v", "batch"])
                figs.append(px.line(sub, x="batch", y="median_us", color="tile", facet_col="T", markers=True,
                                    log_x=True, log_y=True,
                                    title=f"{impl} KDA, {H} heads: median us by batch, a line a tile width"))
    dv = best(df)
    dv = dv[dv["T"] > 1]
    if len(dv):
        figs.append(px.line(dv, x="batch", y="median_us", color="impl", facet_col="T", facet_row="heads",
                            markers=True, log_x=True, log_y=True, title="KDA verify: best tile per implementation"))
    return figs


def winners(bd) -> pd.DataFrame:
    """The fastest passing tile per shape for our backends (what the `auto` policy is made from)."""
    from k3lab import policy

    w = policy.winners([dict(backend=r.backend, median_us=r.median_us, error=r.error, extra=r.extra)
                        for r in bd.rows], ("triton", "cute"))
    return pd.DataFrame.from_dict(w, orient="index")


def numerics_figure(df: pd.DataFrame):
    """Output error against state error, relative norm vs fp64, every implementation."""
    import plotly.express as px

    return px.scatter(df.dropna(subset=["out_err"]), x="out_err", y="state_err", color="impl", symbol="T",
                      log_x=True, log_y=True, hover_data=["case"], title="relative-norm error vs fp64")


def all_checks_pass(df: pd.DataFrame) -> bool:
    return bool(df.dropna(subset=["ok"]).ok.all())


def drift(bd, steps: int, *, every: int = 10, heads: int = 0, D: int = 0, backend: str = "auto", log=print):
    """The drift study (k3lab.studies.kda_drift): `steps` decode steps with fp32 and bf16 state against fp64
    (heads 0: 12 on a GPU, 2 on a CPU; D 0: 128 on a GPU, 16 on a CPU). Adds its summary to the bundle's
    notes and returns the figure of error per step."""
    import plotly.express as px

    from k3lab.studies.kda_drift import drift_study

    on_gpu = torch.cuda.is_available()
    dH = heads or (12 if on_gpu else 2)
    dD = D or (128 if on_gpu else 16)
    dr = drift_study(steps, H=dH, D=dD, every=every, backend=backend)
    be = dr.backend.iloc[0]
    log(f"drift: {steps} steps, {dH} heads, D={dD}, backend {be}")
    long = dr.melt(id_vars=["step", "state_dtype"], value_vars=["out_err", "state_err"], var_name="error of")
    fig = px.line(long, x="step", y="value", color="state_dtype", line_dash="error of", log_y=True,
                  title=f"error vs fp64 per decode step ({dH} heads, D={dD}, {be})")
    bd.notes.append("drift: " + dr.groupby("state_dtype")[["out_err", "state_err"]].max().to_json())
    bd.notes.append(f"drift config: steps={steps} heads={dH} D={dD} backend={be}")
    last = dr[dr.step == dr.step.max()].set_index("state_dtype")[["out_err", "state_err"]]
    bd.notes.append("drift last: " + last.to_json())
    return fig
