"""What notebooks/06_decode_step and 07_draft_depth show: runs from notebook parameters, figures and tables
from a step bundle (so a saved bundle re-plots without re-running), the interactive panel, the draft-depth
sweep. The step itself is `k3lab.step`.

    out = run_step(params, out_dir)           # bench_step + numerics + bundle + trace, from the parameters cell
    for fig in step_figures(out["bundle"]): show(fig)
    summary_html(bundle), kernels_html(bundle, layer), trace_link_html(...), nsight_html(...)
    panel(params, redraw)                     # ipywidgets: batch, context, draft depth, every switch
    df, bundle = depth_sweep(params)          # 07: the verify cycle per depth and batch
    depth_figures(df)

Figures use plotly (bar and scatter only: the repo's one partial plotly.js draws them offline).
"""
from __future__ import annotations

import html as _html
import json
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

from k3lab.report import param_values
from k3lab.switches import ALLOWED, BACKENDS, COMPONENTS, NOT_WIRED, Switches

SWITCH_PARAMS = tuple(ALLOWED)
BACKEND_PARAMS = tuple(f"backend_{c}" for c in COMPONENTS)
VIEW_PARAMS = ("preset", "batch", "context", "draft_depth", "kv_dtype", "expert_dtype")
STEP_PARAMS = VIEW_PARAMS + ("block", "n_experts", "backend") + BACKEND_PARAMS + SWITCH_PARAMS + (
    "compare", "compare_reps", "toggles", "components", "reps", "warmup", "allreduce_us", "allreduce_bundle",
    "numerics_steps",
    "numerics_preset", "nsight_layer", "kernels_layer", "panel", "profile", "trace", "seed", "bundle")
DEPTH_PARAMS = ("preset", "context", "kv_dtype", "expert_dtype", "batches", "depths", "curves", "draft_us_per_token",
                "n_experts", "backend") + BACKEND_PARAMS + SWITCH_PARAMS + ("components", "reps", "warmup", "seed")
STEP_TARGETS = {"x_floor": 1.3, "speedup_vs_compile": 1.5, "launches_per_layer": 10}


class DashboardError(ValueError):
    """A notebook parameter with a bad value (named)."""


# ---- parameters -> view, switches -------------------------------------------------------------------

def params_from(ns: dict[str, Any], names: tuple[str, ...] = STEP_PARAMS) -> dict[str, Any]:
    """The notebook's parameters (its globals) by name."""
    return {k: ns[k] for k in names if k in ns}


def switches_from_params(p: dict[str, Any]) -> Switches:
    """`backend` sets every component; a non-empty `backend_<component>` overrides it; every other switch has a
    parameter of its own name (k3lab.switches refuses bad values by name)."""
    be = p.get("backend", "auto")
    backend = {c: (p.get(f"backend_{c}") or be) for c in COMPONENTS}
    kw = {k: p[k] for k in SWITCH_PARAMS if k in p}
    return Switches(backend=backend, **kw)


def view_from_params(p: dict[str, Any], **over: Any):
    from k3lab.config import preset

    kw = {k: p[k] for k in VIEW_PARAMS[1:] if k in p}
    kw.update(over)
    return preset(p.get("preset", "tiny"), **kw)


def _toggles(v: Any) -> bool | tuple[str, ...]:
    """The `toggles` parameter: true / false, or the names to toggle ("split_router,owned_output" or a list)."""
    if isinstance(v, bool):
        return v
    if isinstance(v, str) and v.strip().lower() in ("true", "false"):
        return v.strip().lower() == "true"
    return tuple(str(x) for x in _list(v, "toggles"))


def _list(v: Any, name: str, ints: bool | str = "auto") -> list:
    """A list parameter (k3lab.report.param_values: a comma string, a list or one int); errors are DashboardErrors."""
    if not isinstance(v, (list, tuple, str, int)) or isinstance(v, bool):
        raise DashboardError(f"parameter {name!r} must be a list or a comma-separated string, got {v!r}")
    try:
        return param_values(v, name, ints=ints)
    except ValueError as e:
        raise DashboardError(str(e)) from None


def _n_experts(v: Any) -> int | None:
    if v in (0, None, "", "full"):
        return None
    if isinstance(v, bool) or not isinstance(v, int) or v < 0:
        raise DashboardError(f"parameter 'n_experts' must be 0 (the full pool) or a positive int, got {v!r}")
    return v


def allreduce_from(p: dict[str, Any], view) -> tuple[float, str]:
    """(us, label) of one all-reduce for the 93-layer estimate: `allreduce_bundle` (a k3lab.studies.allreduce bundle,
    its row at the step's tokens, over the view's TP width where it has one) when given, else `allreduce_us`,
    labelled assumed."""
    from k3lab import step as stepmod
    from k3lab.studies import allreduce

    path = p.get("allreduce_bundle") or ""
    if not path:
        return float(p.get("allreduce_us", stepmod.ALLREDUCE_ASSUMED_US)), "assumed"
    if not Path(path).is_file():
        raise DashboardError(f"parameter 'allreduce_bundle': no file {path!r} (a bundle of "
                             f"`python -m k3lab.studies.allreduce`)")
    try:
        return allreduce.measured(path, view.batch * view.tokens_per_seq, world=view.tp)
    except allreduce.AllReduceError as e:
        raise DashboardError(str(e)) from None


# ---- runs ---------------------------------------------------------------------------------------------

def run_step(p: dict[str, Any], out_dir: str | Path, log: Callable[[str], None] = print) -> dict[str, Any]:
    """The step notebook's run: `k3lab.step.bench_step` at the parameters' view and switches (trace saved in
    `out_dir` beside the report), then the numerics (`numerics_preset`: "tiny", or "same" for the step's own
    view) as bundle rows, then the bundle saved under `out_dir`. Returns {bundle, result, bundle_path,
    trace_path, numerics, numerics_error}."""
    from k3lab import step as stepmod
    from k3lab.config import preset

    view = view_from_params(p)
    sw = switches_from_params(p)
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    name = f"decode_step-{p.get('preset', 'tiny')}-b{view.batch}-c{view.context}-d{view.draft_depth}"
    ar_us, ar_label = allreduce_from(p, view)
    trace = out_dir / f"trace-{name}.json.gz" if (p.get("trace", True) and p.get("profile", True)) else None
    res = stepmod.bench_step(view, sw, block=int(p.get("block", 0)), n_experts=_n_experts(p.get("n_experts", 0)),
                             compare=tuple(_list(p.get("compare", "reference,torch_compile"), "compare")),
                             toggles=_toggles(p.get("toggles", True)), components=bool(p.get("components", True)),
                             reps=int(p.get("reps", 20)), warmup=int(p.get("warmup", 3)),
                             compare_reps=int(p.get("compare_reps", 0)) or None, trace_path=trace,
                             allreduce_us=ar_us, allreduce_label=ar_label,
                             seed=int(p.get("seed", 0)), name=name, log=log, profile=bool(p.get("profile", True)),
                             checkpoint=lambda bb: bb.save(out_dir))
    b = res.bundle
    num, num_err = None, None
    n_steps = int(p.get("numerics_steps", 0))
    if n_steps > 0:
        npre = p.get("numerics_preset", "tiny")
        nview = view if npre == "same" else preset(npre, batch=min(view.batch, 4), draft_depth=view.draft_depth,
                                                    kv_dtype=view.kv_dtype, expert_dtype=view.expert_dtype)
        # kda_pdl is a launch order of the CuTe KDA kernels (the same arithmetic), which the tiny stack's KDA (head
        # width 16, not the CuTe kernels' 128) cannot take: its numerics run with it off, and say so
        nsw = sw.replace(kda_pdl=False) if (sw.kda_pdl and npre != "same") else sw
        try:
            num = stepmod.step_numerics(nview, nsw, n_steps=n_steps, seed=int(p.get("seed", 0)))
            for r in stepmod.numerics_rows(num):
                b.add(r)
            b.notes.append(f"numerics: the {npre} stack ({nview.cfg.num_hidden_layers} layers) in bf16 on "
                           f"{num['device']} against fp64 on the CPU over {n_steps} steps"
                           + (" (kda_pdl off there: a CuTe launch order the stack's KDA width does not take)"
                              if nsw is not sw else ""))
        except Exception as e:  # noqa: BLE001 - recorded and shown; the timing results stand
            num_err = f"{type(e).__name__}: {str(e).splitlines()[0][:300] if str(e) else ''}"
            b.notes.append(f"numerics not run: {num_err}")
            log(f"numerics not run: {num_err}")
    path = b.save(out_dir)
    return {"bundle": b, "result": res, "bundle_path": path, "trace_path": trace, "numerics": num,
            "numerics_error": num_err, "view": view, "switches": sw}


def load_step(bundle_path: str | Path, out_dir: str | Path) -> dict[str, Any]:
    """The step notebook's re-plot mode (its `bundle` parameter): a saved step bundle instead of a run, so the
    dashboards of a GPU run can be drawn anywhere. The bundle is never changed: it is copied byte for byte into
    `out_dir` beside the report (so `k3lab publish` finds it), and so is its trace when one lies beside it
    (trace-<bundle name>.json.gz, the name `run_step` saves it under), which the report then links. Returns the
    keys of `run_step` (no result, view or switches: nothing ran)."""
    import shutil

    from k3lab.harness.bundle import load

    src = Path(bundle_path)
    b = load(src)
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    copies = {}
    for f in (src, src.parent / f"trace-{b.name}.json.gz"):
        if f.is_file():
            copies[f] = out_dir / f.name
            if copies[f].resolve() != f.resolve():
                shutil.copyfile(f, copies[f])
    trace = copies.get(src.parent / f"trace-{b.name}.json.gz")
    return {"bundle": b, "result": None, "bundle_path": copies[src], "trace_path": trace, "numerics": None,
            "numerics_error": None, "view": None, "switches": None}


def saved_nsight(bundle) -> dict[str, Any]:
    """The nsight-python record a step bundle holds (`record_nsight`), or why there is none."""
    res = (bundle.config.get("step") or {}).get("nsight")
    return res or {"ok": False, "message": "the bundle holds no nsight-python record (its run collected none)",
                   "rows": []}


# ---- tables of a bundle --------------------------------------------------------------------------------

def _rows(bundle, prefix: str = "L", backend: str = "fused"):
    return [r for r in bundle.rows if r.backend == backend and r.name.startswith(prefix)]


def component_rows(bundle):
    """The per-component rows (name "Lnn.kind.component") of the fused step."""
    return [r for r in _rows(bundle) if r.name.count(".") == 2]


def layer_rows(bundle):
    return [r for r in _rows(bundle) if r.name.count(".") == 1]


def _row(bundle, name: str, backend: str = "fused"):
    return next((r for r in bundle.rows if r.name == name and r.backend == backend), None)


def targets(bundle) -> dict[str, Any]:
    from k3lab.step import targets as t

    return t(bundle)


def summary_html(bundle) -> str:
    """The step at a glance: the three steps, floor, distance, capture, per-layer sum check, memory, launches,
    the 93-layer estimate and the issue's targets."""
    f = _row(bundle, "step")
    if f is None:
        return "<p class='k3-bad'>no step row in this bundle</p>"
    cells = []
    for be in ("fused", "reference", "torch_compile"):
        r = _row(bundle, "step", be)
        if r is not None:
            cells.append(f"<tr><td>step on {be}</td><td>{r.median_us:.1f} us ({r.kind})</td><td>"
                         f"x{r.median_us / f.median_us:.2f} of the fused step</td></tr>")
    x = f.extra
    mem = x.get("memory", {})
    cells.append(f"<tr><td>byte floor of the block</td><td>{f.floor_us:.1f} us</td><td>fused step at "
                 f"x{f.distance:.2f} of it</td></tr>" if f.floor_us else "")
    cells.append(f"<tr><td>capture</td><td colspan=2>{_html.escape(str(x.get('capture')))}</td></tr>")
    ok = x.get("layer_sum_ok")
    cells.append(f"<tr><td>per-layer sum vs whole</td><td>{x.get('layer_sum_us', 0):.1f} us</td>"
                 f"<td class='{'k3-ok' if ok else 'k3-bad'}'>x{x.get('layer_sum_ratio', 0):.2f} "
                 f"({'ok' if ok else 'outside'} +-25%)</td></tr>")
    cells.append(f"<tr><td>launches</td><td>{f.launches} a step</td><td>{x.get('launches_per_layer', 0):.1f} a layer"
                 f" ({_html.escape(str(bundle.config.get('step', {}).get('launch_count', '')))})</td></tr>")
    cells.append("<tr><td>memory (GB)</td><td colspan=2>" + ", ".join(
        f"{k} {v:.3f}" for k, v in mem.items()) + "</td></tr>")
    e = _row(bundle, "estimate:93_layers")
    if e is not None:
        ex = e.extra
        cells.append(f"<tr><td>93-layer estimate</td><td>{ex['step_us'] / 1e3:.3f} ms a step; "
                     f"{ex['tokens_per_s']:.1f} tok/s, {ex['tokens_per_s_per_gpu']:.1f} per GPU</td><td>byte floor "
                     f"{ex['floor_us'] / 1e3:.3f} ms ({ex['floor_tokens_per_s']:.1f} tok/s); all-reduce "
                     f"{ex['allreduces']} x {ex['allreduce_us_each']} us <b>{ex['allreduce_label']}</b></td></tr>")
    t = targets(bundle)
    for k, lim in STEP_TARGETS.items():
        if k in t and t[k] is not None:
            good = t.get(k + "_ok") if k != "speedup_vs_compile" else t.get("speedup_ok")
            if k == "launches_per_layer":
                good = t.get("launches_ok")
            cmp = ">=" if k == "speedup_vs_compile" else "<="
            cells.append(f"<tr><td>target {k} {cmp} {lim}</td><td>{t[k]:.2f}</td><td class="
                         f"'{'k3-ok' if good else 'k3-bad'}'>{'met' if good else 'not met'}</td></tr>")
    why = bundle.config.get("step", {}).get("why", {})
    be = bundle.config.get("step", {}).get("requested", {})
    cells.append("<tr><td>backends</td><td colspan=2>" + "<br>".join(
        f"{_html.escape(c)}: asked {_html.escape(str(be.get(c)))} -> "
        f"{_html.escape(str(bundle.switches['backend'].get(c)))}"
        f" ({_html.escape(w)})" for c, w in why.items()) + "</td></tr>")
    return "<table>" + "".join(cells) + "</table>"


def _ran_cell(x: dict[str, Any]) -> str:
    """A component row's record of what ran: the backend, and where the component API kept one its kernel, the
    options that were set (None ones left out) and the rule or request behind them."""
    out = _html.escape(str(x.get("ran")))
    if x.get("ran_kernel"):
        opts = ", ".join(f"{k}={v}" for k, v in (x.get("ran_options") or {}).items() if v is not None)
        out += (f"<br><small>{_html.escape(str(x['ran_kernel']))}" + (f" ({_html.escape(opts)})" if opts else "")
                + f"<br>{_html.escape(str(x.get('ran_why') or ''))[:160]}</small>")
    return out


def kernels_html(bundle, layer: int) -> str:
    """The kernels of one layer's components (from the profiled step: launches, kernel names and counts), and what
    the component API recorded for each call it made (kernel, options, rule)."""
    rows = [r for r in component_rows(bundle) if r.extra.get("layer") == layer]
    if not rows:
        return f"<p>no component rows for layer {layer}</p>"
    body = []
    for r in rows:
        ks = "<br>".join(f"{_html.escape(k['name'])} x{k['count']}" for k in r.kernels) or "(CPU run: no kernels)"
        body.append(f"<tr><td>{_html.escape(r.name)}</td><td style='text-align:left'>{_ran_cell(r.extra)}</td>"
                    f"<td>{r.launches}</td><td>{r.median_us:.2f}</td><td>{(r.floor_us or 0):.2f}</td>"
                    f"<td style='text-align:left'>{ks}</td></tr>")
    return ("<table><tr><th>component</th><th>ran</th><th>launches</th><th>us</th><th>floor us</th>"
            "<th>kernels (first 8 by count)</th></tr>" + "".join(body) + "</table>")


def trace_link_html(trace_path: str | Path | None, html_dir: str | Path) -> str:
    """A link to the saved trace, relative to the report's folder, and how to open it."""
    if not trace_path:
        return "<p>no trace saved (trace = False)</p>"
    rel = Path(os.path.relpath(Path(trace_path).resolve(), Path(html_dir).resolve())).as_posix()
    return (f"<p>Timeline: <a href='{_html.escape(rel)}' download>{_html.escape(Path(trace_path).name)}</a> "
            "(Chrome trace JSON, gzip): open it in <a href='https://ui.perfetto.dev'>ui.perfetto.dev</a> "
            "(Open trace file) or chrome://tracing. One eager step with a range per component "
            "(\"L03.mla.attn\"); kernels show on the GPU stream under the range that launched them.</p>")


def record_nsight(bundle, res: dict[str, Any], out_dir: str | Path | None) -> None:
    """Keep the nsight-python result (or why there is none) in the bundle (config["step"]["nsight"]) and save it
    again when the run has an out_dir."""
    bundle.config.setdefault("step", {})["nsight"] = res
    if out_dir:
        bundle.save(out_dir)


def nsight_html(res: dict[str, Any]) -> str:
    if not res.get("ok"):
        return f"<p class='k3-bad'>nsight-python metrics not collected: {_html.escape(res.get('message', ''))}</p>"
    rows = res.get("rows") or []
    if not rows:
        return f"<p>{_html.escape(res.get('message', ''))}</p>"
    keys = list(rows[0])
    head = "".join(f"<th>{_html.escape(k)}</th>" for k in keys)
    body = "".join("<tr>" + "".join(f"<td>{_html.escape(str(r.get(k)))}</td>" for k in keys) + "</tr>" for r in rows)
    return f"<p>{_html.escape(res.get('message', ''))}</p><table><tr>{head}</tr>{body}</table>"


# ---- figures ------------------------------------------------------------------------------------------

_COLORS = ("#4c78a8", "#f58518", "#54a24b", "#e45756", "#72b7b2", "#eeca3b", "#b279a2", "#ff9da6", "#9d755d",
           "#bab0ac", "#1f77b4", "#2ca02c", "#d62728", "#9467bd", "#8c564b")


def _kind_label(rows) -> str:
    kinds = sorted({r.kind for r in rows})
    return ", ".join({"cpu-smoke": "CPU smoke timing, not a GPU figure"}.get(k, k) for k in kinds)


def layer_figure(bundle):
    """Stacked per-layer bars by component (each timed alone in its own graph), the layer timed whole, and
    the layer's byte floor as a line."""
    import plotly.graph_objects as go

    comps = component_rows(bundle)
    layers = layer_rows(bundle)
    xs = [r.name for r in layers]
    fig = go.Figure()
    names = list(dict.fromkeys(r.extra.get("component") for r in comps))
    for k, cname in enumerate(names):
        ys = []
        for lr in layers:
            c = next((r for r in comps if r.extra.get("layer") == lr.extra.get("layer")
                      and r.extra.get("component") == cname), None)
            ys.append(c.median_us if c else 0.0)
        fig.add_bar(name=cname, x=xs, y=ys, marker_color=_COLORS[k % len(_COLORS)])
    fig.add_scatter(name="layer timed whole", x=xs, y=[r.median_us for r in layers], mode="markers",
                    marker=dict(symbol="diamond", size=10, color="black"))
    fig.add_scatter(name="byte floor", x=xs, y=[r.floor_us for r in layers], mode="markers",
                    marker=dict(symbol="line-ew-open", size=34, color="#d62728", line=dict(width=3)))
    fig.update_layout(barmode="stack", title=f"per layer, by component, against the floor [{_kind_label(layers)}]",
                      yaxis_title="us per step", height=480, template="plotly_white", legend=dict(font=dict(size=10)))
    return fig


def launches_figure(bundle):
    """Kernel launches per layer, stacked by component (profiled eager step), with the <= 10 target."""
    import plotly.graph_objects as go

    comps = component_rows(bundle)
    layers = layer_rows(bundle)
    xs = [r.name for r in layers]
    fig = go.Figure()
    names = list(dict.fromkeys(r.extra.get("component") for r in comps))
    for k, cname in enumerate(names):
        ys = [next((r.launches or 0 for r in comps if r.extra.get("layer") == lr.extra.get("layer")
                    and r.extra.get("component") == cname), 0) for lr in layers]
        fig.add_bar(name=cname, x=xs, y=ys, marker_color=_COLORS[k % len(_COLORS)])
    fig.add_scatter(name="target: 10 a layer", x=xs, y=[STEP_TARGETS["launches_per_layer"]] * len(xs),
                    mode="lines", line=dict(color="#d62728", dash="dash"))
    what = bundle.config.get("step", {}).get("launch_count", "kernels")
    fig.update_layout(barmode="stack", title=f"launches per layer ({what})", yaxis_title="launches",
                      height=420, template="plotly_white", legend=dict(font=dict(size=10)))
    return fig


COMPARE_IN_TOGGLES = 20  # the reference / torch.compile bars join the toggles' only within this many x their widest


def toggles_figure(bundle):
    """Each switch toggled alone, and the whole step on the reference / torch.compile: the change to the step."""
    import plotly.graph_objects as go

    f = _row(bundle, "step")
    if f is None:
        return None
    labels, deltas, texts = [], [], []
    for r in bundle.rows:
        if r.name.startswith("toggle:"):
            labels.append(r.name[len("toggle:"):])
            deltas.append(r.median_us - f.median_us)
            texts.append(f"{r.median_us:.0f} us")
    # the whole step on the reference / torch.compile, unless it would dwarf the switches' changes (a fused GPU step
    # against its reference: 400x; the summary table has those ratios)
    widest = max((abs(d) for d in deltas), default=0.0)
    left_out = []
    for be in ("reference", "torch_compile"):
        r = _row(bundle, "step", be)
        if r is None:
            continue
        if deltas and abs(r.median_us - f.median_us) > COMPARE_IN_TOGGLES * widest:
            left_out.append(f"{be} {r.median_us / f.median_us:.0f}x")
            continue
        labels.insert(0, f"every component on {be}")
        deltas.insert(0, r.median_us - f.median_us)
        texts.insert(0, f"{r.median_us:.0f} us")
    fig = go.Figure()
    fig.add_bar(x=deltas, y=labels, orientation="h", text=texts, name="timed",
                marker_color=["#e45756" if d > 0 else "#54a24b" for d in deltas])
    # a toggle whose exchange one GPU cannot time (split_router's all-gathers): the change with it at its assumed
    # latency, beside the timed bar
    ax, ay, at = [], [], []
    for r in bundle.rows:
        if r.name.startswith("toggle:") and r.extra.get("assumed_exchange_us") is not None:
            ax.append(r.median_us - f.median_us + r.extra["assumed_exchange_us"])
            ay.append(r.name[len("toggle:"):])
            at.append(f"with {r.extra['assumed_exchange_us']:+.0f} us of exchange, assumed")
    if ax:
        fig.add_scatter(x=ax, y=ay, mode="markers+text", text=at, textposition="middle right", name="with the "
                        "untimed exchange (assumed)", marker=dict(symbol="diamond-open", size=12, color="#4c78a8"))
    fig.update_layout(title=f"each switch alone: change to the step of {f.median_us:.0f} us (positive = slower "
                            f"without it) [{_kind_label([f])}]"
                            + (f"<br><sup>the whole step on {', '.join(left_out)} the fused step: off this scale, "
                               f"in the summary table</sup>" if left_out else ""),
                      xaxis_title="us per step vs the step as switched",
                      height=max(300, 40 * len(labels) + 120), template="plotly_white", margin=dict(l=260))
    return fig


def gap_figure(bundle):
    """Each component's gap to its floor, summed over the step's layers (what is left for the kernel issues)."""
    import plotly.graph_objects as go

    comps = component_rows(bundle)
    agg: dict[str, list[float]] = {}
    for r in comps:
        key = f"{r.name.split('.')[1]}.{r.extra.get('component')}" if r.extra.get("part") == "attn" else \
            str(r.extra.get("component"))
        a = agg.setdefault(key, [0.0, 0.0])
        a[0] += r.median_us
        a[1] += r.floor_us or 0.0
    items = sorted(agg.items(), key=lambda kv: -(kv[1][0] - kv[1][1]))
    fig = go.Figure()
    fig.add_bar(name="floor", x=[k for k, _ in items], y=[v[1] for _, v in items], marker_color="#54a24b")
    fig.add_bar(name="gap to the floor", x=[k for k, _ in items], y=[max(0.0, v[0] - v[1]) for _, v in items],
                marker_color="#e45756", text=[f"x{v[0] / v[1]:.1f}" if v[1] else "" for _, v in items])
    fig.update_layout(barmode="stack", title=f"each component's time over the block: floor + gap "
                                             f"[{_kind_label(comps)}]", yaxis_title="us per step (block)",
                      height=440, template="plotly_white")
    return fig


def error_figure(bundle):
    """Relative error of each layer's output stream against fp64, after each decode step."""
    import plotly.graph_objects as go

    rows = [r for r in bundle.rows if r.name.startswith("numerics:")]
    if not rows:
        return None
    fig = go.Figure()
    for k, r in enumerate(rows):
        e = r.extra.get("rel_err_by_step") or []
        fig.add_scatter(name=r.name[len("numerics:"):], x=list(range(1, len(e) + 1)), y=e, mode="lines+markers",
                        line=dict(color=_COLORS[k % len(_COLORS)]))
        # a router near-tie aligned at that step (k3lab.step.step_numerics): a star, the note on hover
        al = [(int(a.split(":", 1)[0].split()[1]), a) for a in r.extra.get("aligned") or ()
              if a.startswith("step ")]
        al = [(s, a) for s, a in al if 0 <= s < len(e)]
        if al:
            fig.add_scatter(name=f"{r.name[len('numerics:'):]} aligned", x=[s + 1 for s, _ in al],
                            y=[e[s] for s, _ in al], mode="markers", hovertext=[a for _, a in al], showlegend=False,
                            marker=dict(symbol="star", size=12, color=_COLORS[k % len(_COLORS)]))
    v = rows[0].extra.get("preset_view", {})
    fig.update_layout(title=f"relative error per layer vs fp64, over the decode steps ({rows[0].extra.get('device')}, "
                            f"batch {v.get('batch')}, heads {v.get('heads')})", xaxis_title="decode step",
                      yaxis=dict(title="rel. norm error of the layer's output", type="log"), height=420,
                      template="plotly_white", legend=dict(font=dict(size=10)))
    return fig


def timeline_figure(trace_path: str | Path | None, layer: int | None = None):
    """The saved trace's GPU work as bars on a time axis, one row a CUDA stream (so the `shared_expert_stream`
    switch's side stream shows beside the main one), each kernel coloured by the component range it ran under
    ("L03.mla.attn" -> attn); `layer`: only the kernels under that layer's ranges. None when there is no trace; a
    figure saying so when the trace holds no GPU kernels (a CPU run)."""
    import plotly.graph_objects as go

    from k3lab import step as stepmod

    if not trace_path or not Path(trace_path).exists():
        return None
    events = stepmod.trace_events(trace_path)
    work = [e for e in events if e.get("cat") in stepmod.GPU_WORK and "ts" in e and "dur" in e]
    ranges = [e for e in events if e.get("cat") == "gpu_user_annotation" and "ts" in e and "dur" in e]
    if layer is not None:
        ranges = [r for r in ranges if str(r.get("name", "")).startswith(f"L{layer:02d}.")]
    fig = go.Figure()
    if not work:
        fig.update_layout(title="timeline: no GPU kernels in the trace (a CPU run)", height=200,
                          template="plotly_white")
        return fig

    def owner(e):
        """The innermost component range holding the kernel's start (None: outside every range kept)."""
        inside = [r for r in ranges if r["ts"] <= e["ts"] <= r["ts"] + r["dur"]]
        return min(inside, key=lambda r: r["dur"])["name"] if inside else None

    rows = [(e, owner(e)) for e in work]
    if layer is not None:
        rows = [(e, o) for e, o in rows if o is not None]
    if not rows:
        fig.update_layout(title=f"timeline: no kernels under layer {layer}'s ranges", height=200,
                          template="plotly_white")
        return fig
    t0 = min(e["ts"] for e, _ in rows)
    streams = sorted({e.get("tid") for e, _ in rows}, key=str)
    comps = list(dict.fromkeys((o or "(outside a range)").split(".")[-1] for _, o in rows))
    for k, comp in enumerate(comps):
        sel = [(e, o) for e, o in rows if (o or "(outside a range)").split(".")[-1] == comp]
        fig.add_bar(name=comp, orientation="h", base=[e["ts"] - t0 for e, _ in sel], x=[e["dur"] for e, _ in sel],
                    y=[f"stream {e.get('tid')}" for e, _ in sel], marker_color=_COLORS[k % len(_COLORS)],
                    hovertext=[f"{o or ''}<br>{str(e.get('name', ''))[:90]}<br>{e['dur']:.2f} us" for e, o in sel],
                    hoverinfo="text")
    where = f"layer {layer}" if layer is not None else "the step"
    fig.update_layout(barmode="overlay", title=f"timeline of {where}: GPU work by stream (one profiled eager step)",
                      xaxis_title="us from the first kernel", height=180 + 60 * len(streams),
                      template="plotly_white", legend=dict(font=dict(size=10)))
    fig.update_yaxes(categoryorder="array", categoryarray=[f"stream {t}" for t in streams])
    return fig


def step_figures(bundle) -> list:
    """Every figure of the step notebook that the bundle has data for."""
    figs = [layer_figure(bundle), launches_figure(bundle), toggles_figure(bundle), gap_figure(bundle),
            error_figure(bundle)]
    return [f for f in figs if f is not None]


# ---- the interactive panel ------------------------------------------------------------------------------

def panel(params: dict[str, Any], rerun: Callable[[dict[str, Any]], None]):
    """An ipywidgets panel: batch, context, draft depth, the backend of every component and every switch (the
    unwired ones shown, disabled). Changing a control calls `rerun(new_params)` (re-runs the step and redraws
    into the panel's output) while "live" is ticked; "run" re-runs on demand. The names are the notebook's
    parameter names, so a headless run sets the same things in the parameters cell."""
    import ipywidgets as W

    ctl: dict[str, Any] = {
        "batch": W.Dropdown(options=sorted({1, 2, 4, 8, 16, 32, 64, int(params["batch"])}), value=int(params["batch"]),
                            description="batch"),
        "context": W.IntText(value=int(params["context"]), description="context"),
        "draft_depth": W.IntSlider(value=int(params["draft_depth"]), min=0, max=7, description="draft depth",
                                   continuous_update=False),
        "backend": W.Dropdown(options=list(BACKENDS) + ["auto"], value=params.get("backend", "auto"),
                              description="backend"),
    }
    for c in COMPONENTS:
        ctl[f"backend_{c}"] = W.Dropdown(options=[""] + list(BACKENDS) + ["auto"],
                                         value=params.get(f"backend_{c}", ""), description=f"{c}")
    for k, allowed in ALLOWED.items():
        ctl[k] = W.Dropdown(options=list(allowed), value=params.get(k, getattr(Switches(), k)), description=k,
                            disabled=k in NOT_WIRED, tooltip=NOT_WIRED.get(k, ""),
                            style={"description_width": "initial"})
    live = W.Checkbox(value=True, description="live: re-run on every change")
    go_btn = W.Button(description="run", button_style="primary")
    out = W.Output()

    def current() -> dict[str, Any]:
        return {**params, **{k: w.value for k, w in ctl.items()}}

    def fire(*_):
        out.clear_output(wait=True)
        with out:
            try:
                rerun(current())
            except Exception as e:  # noqa: BLE001 - a refused switch is shown, the panel stays usable
                print(f"{type(e).__name__}: {e}")

    for w in ctl.values():
        w.observe(lambda ch: fire() if live.value and ch.get("name") == "value" else None, names="value")
    go_btn.on_click(fire)
    rows = [W.HBox([ctl["batch"], ctl["context"], ctl["draft_depth"]]),
            W.HBox([ctl["backend"]] + [ctl[f"backend_{c}"] for c in COMPONENTS[:3]]),
            W.HBox([ctl[f"backend_{c}"] for c in COMPONENTS[3:]]),
            W.GridBox([ctl[k] for k in ALLOWED], layout=W.Layout(grid_template_columns="repeat(3, 340px)")),
            W.HBox([live, go_btn]), out]
    box = W.VBox(rows)
    box.controls = ctl
    box.fire = fire
    return box


# ---- draft depth (07) ------------------------------------------------------------------------------------

def _release_memory() -> None:
    """Return a dropped step's GPU memory to the driver's pool before the next is built (cycles collected first)."""
    import gc

    import torch

    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def depth_sweep(p: dict[str, Any], log: Callable[[str], None] = print):
    """For every batch x draft depth of the parameters: the step built at that view (the verify path for depth
    > 0: KDA and MLA verify over depth + 1 positions, the MoE at batch x (depth + 1) tokens), timed per
    component and layer (k3lab.step.bench_step, no comparison or toggles), and its 93-layer estimate as the
    verify cycle (with components=False the layer times are split between attention and MLP by their floors).
    Committed tokens per cycle from each acceptance curve (k3lab.acceptance). The cycle of a curve adds the KDA
    commit of 69 layers, timed on the step's own buffers with the batch's accepted counts drawn from the curve
    (`DecodeStep.kda_commit_us`: a slot copy, or with `kda_checkpoint` > 1 the replay between slots; the MLA
    commit is a length update and the MoE has none). One step is alive at a time (each view's peak memory in its
    record, `peak_gb`). Returns (DataFrame, Bundle of the cycles)."""
    import pandas as pd

    from k3lab import acceptance
    from k3lab import step as stepmod
    from k3lab.harness.bundle import Bundle, Row

    sw = switches_from_params(p)
    curves = [acceptance.load(c) for c in _list(p.get("curves", "agentx_fixed,al6_at7"), "curves")]
    batches = _list(p.get("batches", "1"), "batches", ints=True)
    depths = _list(p.get("depths", "0,1,2,3,4"), "depths", ints=True)
    draft_us = float(p.get("draft_us_per_token", 0.0))
    if not draft_us >= 0:
        raise DashboardError(f"draft_us_per_token must be >= 0 (the drafter's time a drafted token), got {draft_us}")
    recs = []
    bundle = None
    for B in batches:
        for D in depths:
            view = view_from_params(p, batch=B, draft_depth=D)
            st = stepmod.DecodeStep(view, sw, n_experts=_n_experts(p.get("n_experts", 0)), seed=int(p.get("seed", 0)))
            res = stepmod.bench_step(view, sw, compare=(), toggles=False, step=st,
                                     components=bool(p.get("components", True)), reps=int(p.get("reps", 5)),
                                     warmup=int(p.get("warmup", 1)), seed=int(p.get("seed", 0)), profile=False,
                                     log=lambda s: None)
            est = res.estimate
            cycle = est["step_us"] + draft_us * D
            n_kda = est["counts"]["kda"]
            if bundle is None:
                bundle = Bundle.new(f"draft_depth-{p.get('preset', 'tiny')}-c{view.context}", view=view, switches=sw)
                bundle.copy_tbps, bundle.read_tbps = res.bundle.copy_tbps, res.bundle.read_tbps
                bundle.launch_floor_us = res.bundle.launch_floor_us
                bundle.notes.append(f"draft cost: {draft_us} us a draft token (assumed); cycle = 93-layer verify "
                                    f"estimate + that + 69 KDA commits at the curve's accepted counts (measured, "
                                    f"per curve: cycle_us[curve])")
                bundle.notes += [n for n in res.bundle.notes if "all-reduce" in n or "CPU run" in n]
            whole = _row(res.bundle, "step")
            rec = {"batch": B, "depth": D, "cycle_us": cycle, "block_step_us": whole.median_us, "kind": whole.kind,
                   "kda_us": est["type_us"]["kda"], "mla_us": est["type_us"]["mla"], "moe_us": est["type_us"]["moe"],
                   "floor_us": est["floor_us"]}
            for c in curves:
                rec[f"committed[{c.name}]"] = c.committed(D)
                commit_us, what = (st.kda_commit_us(acceptance.accepted_counts(c, D, B), reps=int(p.get("reps", 5)))
                                   if D else (0.0, {}))
                rec[f"commit_us[{c.name}]"] = commit_us  # one KDA layer's
                rec[f"cycle_us[{c.name}]"] = cycle + n_kda * commit_us
                rec[f"tok_s[{c.name}]"] = acceptance.committed_per_s(c, D, B, rec[f"cycle_us[{c.name}]"])
                if what:
                    rec["commit_ran"] = f"{what.get('kernel')} {what.get('options')}"
            rec["peak_gb"] = (res.bundle.config.get("step", {}).get("memory") or {}).get("peak_gb")
            # one step alive at a time: the next view's step is built only after this one's buffers are released
            # (K3's full expert pools take ~45 GB at tp8; two at once did not fit an 80 GB H100 from depth 1)
            del st, res
            _release_memory()
            recs.append(rec)
            r = Row(name=f"cycle:b{B}-d{D}", backend="fused", kind=whole.kind, median_us=cycle, p10_us=cycle,
                    p90_us=cycle, floor_us=est["floor_us"], samples_us=[], extra={**rec, "estimate": est})
            bundle.add(r)
            log(f"batch {B:3d} depth {D}: cycle {cycle / 1e3:9.3f} ms (KDA {rec['kda_us']:.1f}, "
                f"MLA {rec['mla_us']:.1f}, "
                f"MoE {rec['moe_us']:.1f} us a layer) " + "  ".join(
                    f"{c.name}: {rec[f'committed[{c.name}]']:.2f} tok/cycle, {rec[f'tok_s[{c.name}]']:.1f} tok/s"
                    for c in curves))
    df = pd.DataFrame(recs)
    for c in curves:
        col = f"tok_s[{c.name}]"
        df[f"best[{c.name}]"] = df.groupby("batch")[col].transform("max") == df[col]
    for rec in df.to_dict("records"):  # the best depth per batch and curve, in the bundle too
        row = _row(bundle, f"cycle:b{rec['batch']}-d{rec['depth']}")
        row.extra.update({k: bool(v) for k, v in rec.items() if k.startswith("best[")})
    return df, bundle


def depth_figures(df) -> list:
    """Committed tokens/s against draft depth, one line per batch and curve, the best depth of each marked."""
    import plotly.graph_objects as go

    curves = [c[len("tok_s["):-1] for c in df.columns if c.startswith("tok_s[")]
    figs = []
    for cname in curves:
        fig = go.Figure()
        for k, (B, g) in enumerate(df.groupby("batch")):
            g = g.sort_values("depth")
            col = f"tok_s[{cname}]"
            fig.add_scatter(name=f"batch {B}", x=g["depth"], y=g[col], mode="lines+markers",
                            line=dict(color=_COLORS[k % len(_COLORS)]))
            best = g[g[f"best[{cname}]"]]
            fig.add_scatter(name=f"best at batch {B}", x=best["depth"], y=best[col], mode="markers+text",
                            marker=dict(symbol="star", size=16, color=_COLORS[k % len(_COLORS)]),
                            text=[f"D={d}" for d in best["depth"]], textposition="top center", showlegend=False)
        kinds = ", ".join(sorted(set(df["kind"])))
        fig.update_layout(title=f"committed tokens/s against draft depth, curve {cname} [{kinds}]",
                          xaxis_title="draft depth D (verify over D + 1 positions)",
                          yaxis=dict(title="committed tokens/s (93-layer estimate)", type="log"),
                          height=420, template="plotly_white")
        figs.append(fig)
    fig = go.Figure()
    for k, (B, g) in enumerate(df.groupby("batch")):
        g = g.sort_values("depth")
        fig.add_scatter(name=f"cycle, batch {B}", x=g["depth"], y=g["cycle_us"] / 1e3, mode="lines+markers",
                        line=dict(color=_COLORS[k % len(_COLORS)]))
    fig.update_layout(title="verify cycle (93-layer estimate) against draft depth", xaxis_title="draft depth",
                      yaxis_title="ms a cycle", height=380, template="plotly_white")
    figs.append(fig)
    return figs


def depth_table_html(df) -> str:
    cols = [c for c in df.columns if not c.startswith("best[")]
    return df[cols].to_html(index=False, float_format=lambda v: f"{v:.4g}")


def curves_html() -> str:
    from k3lab import acceptance

    body = []
    for name in acceptance.available():
        c = acceptance.load(name)
        body.append(f"<tr><td>{_html.escape(c.name)}</td><td>{c.form} {_html.escape(json.dumps(c.params))}</td>"
                    f"<td>{', '.join(f'{a:.3f}' for a in c.probs)}</td><td>" + ", ".join(
                        f"{t['drafts']} drafts -> {c.committed(int(t['drafts'])):.3f} (target {t['committed']})"
                        for t in c.targets) + f"</td><td>{c.residual:.1e}</td></tr>")
    return ("<p>model: " + _html.escape(acceptance.MODEL) + "</p><table><tr><th>curve</th><th>form</th>"
            "<th>a_1..a_7</th><th>fit</th><th>residual</th></tr>" + "".join(body) + "</table>")
