"""KDA benchmark: our fused kernels beside the torch reference, torch.compile and fla, per shape.

For each (heads, batch, positions T, value-tile width) it builds fresh random inputs, checks every
implementation once against the fp64 reference (output and saved state), then times CUDA-graph
replays with inputs rotated so the state is not served from L2. Each row carries the floor
(bytes / measured copy bandwidth, or the launch floor where bytes are tiny) and the distance to it.

Bytes counted (fp32 state, bf16 activations, W = 4):
    state   B*H*D*D*4 read + written (verify: read once, T states written to the history)
    inputs  B*T*(3HD + HD + H + HD)*2 read (qkv, f, b, gate)
    out     B*T*HD*2 written
    conv    B*3HD*(W-1)*2 read + written (verify: T windows written to the history)
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, Callable

import torch

from k3lab.ref import kda as ref


@dataclass
class KDACase:
    heads: int
    batch: int
    T: int = 1
    tile_v: int = 128
    D: int = 128
    W: int = 4
    state_dtype: str = "fp32"

    def key(self) -> str:
        return f"H{self.heads}_B{self.batch}_T{self.T}_tv{self.tile_v}_{self.state_dtype}"


def kda_bytes(c: KDACase, hist: bool = True) -> int:
    sb = 4 if c.state_dtype == "fp32" else 2
    HD = c.heads * c.D
    st = c.batch * c.heads * c.D * c.D * sb
    state = st * (2 if c.T == 1 else 1 + (c.T if hist else 1))
    io = c.batch * c.T * (3 * HD + HD + c.heads + HD) * 2 + c.batch * c.T * HD * 2
    conv_win = c.batch * 3 * HD * (c.W - 1) * 2
    conv = conv_win * (2 if c.T == 1 else 1 + (c.T if hist else 0))
    params = 3 * HD * c.W * 2 + HD * 4 + c.heads * 4 + c.D * 2
    return state + io + conv + params


def kda_flops(c: KDACase) -> int:
    # per position and head: decay D*D, kS 2*D*D, rank-1 update 2*D*D, S^T q 2*D*D
    return c.batch * c.T * c.heads * 7 * c.D * c.D


@dataclass
class Impl:
    name: str  # row label, e.g. "triton", "fla_path"
    backend: str
    launches_hint: int | None
    make: Callable[[dict], Callable[[], Any]]  # input set -> zero-arg callable
    check: Callable[[dict], dict] | None = None  # input set -> {"out_err":..., "state_err":...}
    note: str = ""
    extra: dict = field(default_factory=dict)


def make_set(c: KDACase, seed: int, device: str) -> dict:
    T = None if c.T == 1 else c.T
    inp, p, S, cs = ref.make_kda_inputs(c.batch, c.heads, c.D, T=T, W=c.W, seed=seed, device=device)
    if c.state_dtype == "bf16":
        S = S.to(torch.bfloat16)
    d = dict(inp=inp, p=p, state=S, conv_state=cs)
    B, H, D = c.batch, c.heads, c.D
    if c.T == 1:
        d["out"] = torch.empty(B, H * D, dtype=torch.bfloat16, device=device)
    else:
        d["out"] = torch.empty(B, c.T, H * D, dtype=torch.bfloat16, device=device)
        d["state_hist"] = torch.empty(B, c.T, H, D, D, dtype=S.dtype, device=device)
        d["conv_hist"] = torch.empty(B, c.T, 3 * H * D, c.W - 1, dtype=cs.dtype, device=device)
    return d


def fp64_truth(c: KDACase, s: dict):
    p64 = s["p"].to(torch.float64)
    args = [s["inp"][k] for k in ("qkv", "f", "b", "gate")]
    if c.T == 1:
        return ref.kda_decode(*args, p64, s["state"].double(), s["conv_state"], dtype=torch.float64,
                              out_dtype=torch.float64)
    out, St, ct = ref.kda_verify(*args, p64, s["state"].double(), s["conv_state"], dtype=torch.float64,
                                 out_dtype=torch.float64)
    return out, St, ct


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double(), b.double()
    if not torch.isfinite(a).all():
        return float("nan")
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


def clone_set(s: dict) -> dict:
    return {k: ({kk: vv.clone() for kk, vv in v.items()} if isinstance(v, dict) else
                (v.clone() if torch.is_tensor(v) else v)) for k, v in s.items()}


OUT_TOL = 1e-2  # bf16 output: one rounding of ~2^-9 relative per element, plus fp32 maths
STATE_TOL = {"fp32": 1e-4, "bf16": 1e-2}  # fp32 state: fp32 rounding over D-term sums; bf16: one rounding
CUTE_TILES = (16, 32, 64, 128)  # the CuTe kernels split a head over a cluster of 1, 2, 4 or 8 CTAs


def check_component(c: KDACase, s: dict, backend: str, pdl: bool = False) -> dict:
    """Run k3lab's component once on a copy of `s` with poisoned outputs; errors vs fp64."""
    from k3lab.components import kda as comp

    truth = fp64_truth(c, s)
    t = clone_set(s)
    t["out"].fill_(float("nan"))
    args = [t["inp"][k] for k in ("qkv", "f", "b", "gate")]
    if c.T == 1:
        comp.decode(*args, t["p"], t["state"], t["conv_state"], t["out"], backend=backend, tile_v=c.tile_v,
                    pdl=pdl)
        return _errs(c, t["out"], truth[0], t["state"], truth[1], torch.equal(t["conv_state"], truth[2]))
    t["state_hist"].fill_(float("nan"))
    comp.verify(*args, t["p"], t["state"], t["conv_state"], t["out"], state_hist=t["state_hist"],
                conv_hist=t["conv_hist"], backend=backend, tile_v=c.tile_v, pdl=pdl)
    return _errs(c, t["out"], truth[0], t["state_hist"], truth[1], torch.equal(t["conv_hist"], truth[2]))


def _errs(c: KDACase, out, out_ref, st, st_ref, conv_exact) -> dict:
    o, e = rel(out, out_ref), rel(st, st_ref)
    ok = bool(o < OUT_TOL and e < STATE_TOL[c.state_dtype] and conv_exact)  # NaN compares False
    return dict(out_err=o, state_err=e, conv_exact=bool(conv_exact), ok=ok)


def component_impl(c: KDACase, backend: str, pdl: bool = False) -> Impl:
    """The component on `backend`. pdl=True (cute): the kda_pdl switch, row name "cute_pdl". The timed
    graph replays calls back to back on rotated sets (never one set twice in a row), so each launch
    overlaps the previous call's tail as it would overlap the layer's input projection in a model."""
    from k3lab.components import kda as comp

    def make(s):
        args = [s["inp"][k] for k in ("qkv", "f", "b", "gate")]
        if c.T == 1:
            return lambda: comp.decode(*args, s["p"], s["state"], s["conv_state"], s["out"], backend=backend,
                                       tile_v=c.tile_v, pdl=pdl)
        return lambda: comp.verify(*args, s["p"], s["state"], s["conv_state"], s["out"],
                                   state_hist=s["state_hist"], conv_hist=s["conv_hist"], backend=backend,
                                   tile_v=c.tile_v, pdl=pdl)

    name = f"{backend}_pdl" if pdl else backend
    note = ("programmatic dependent launch (kda_pdl): overlaps the previous call in the graph" if pdl else "")
    return Impl(name=name, backend=backend, launches_hint=None, make=make,
                check=lambda s: check_component(c, s, backend, pdl=pdl), note=note)


def cute_default_tile(op: str, B: int, T: int = 1) -> int | None:
    """The CuTe tile data/kda_defaults.json gives `op` at batch B, T positions (None: no CuTe rule)."""
    from k3lab.components import kda as comp

    rule = comp.table_rule(op, B, T)
    return rule.get("tile_v") if rule and rule.get("backend") == "cute" else None


def fla_impls(c: KDACase) -> list[Impl]:
    from k3lab.bench import peers

    ok, why = peers.fla_available()
    if not ok or c.state_dtype != "fp32" or c.tile_v != 128:
        return []
    B, H, D, T = c.batch, c.heads, c.D, c.T
    impls = []

    def make_rec(s):
        inp = s["inp"]
        x = inp["qkv"].view(B, T, 3, H, D)
        q, k, v = (torch.nn.functional.silu(x[:, :, i].float()).to(torch.bfloat16).contiguous() for i in range(3))
        fg = inp["f"].view(B, T, H, D)
        bb = inp["b"].view(B, T, H)
        o = torch.empty(B, T, H, D, dtype=torch.bfloat16, device=q.device)
        return lambda: peers.fla_recurrence(q, k, v, fg, bb, s["p"].A_log, s["p"].dt_bias, s["state"], o)

    impls.append(Impl("fla_recurrence", "fla", 1, make_rec,
                      note="recurrence only (no conv, no output norm); final state only"))
    if T == 1:
        def make_path(s):
            path = peers.FlaDecodePath(s["p"], s["state"], s["conv_state"], B)
            a = [s["inp"][k] for k in ("qkv", "f", "b", "gate")]
            return lambda: path(*a)

        impls.append(Impl("fla_path", "fla", 5, make_path,
                          note="fla conv x3 + fused_recurrent_kda + gated rmsnorm"))
    return impls


def copy_impls(c: KDACase) -> list[Impl]:
    """torch's copy of the case's bytes (half read, half written) in the same rotated graph: what a plain
    copy of this size reaches, beside the copy bandwidth measured on 1 GiB (the floor). Decode only."""
    if c.T != 1 or c.tile_v != 128 or c.state_dtype != "fp32":
        return []
    n = kda_bytes(c) // 2

    def make(s):
        src = torch.empty(n, dtype=torch.uint8, device=s["state"].device).fill_(1)
        dst = torch.empty_like(src)
        return lambda: dst.copy_(src)

    return [Impl("torch_copy", "torch", 1, make, note="copy of the same bytes, half read and half written")]


def torch_impls(c: KDACase) -> list[Impl]:
    if c.tile_v != 128 or c.state_dtype != "fp32":
        return []
    out = [component_impl(c, "reference")]
    if c.T == 1:
        out.append(component_impl(c, "torch_compile"))
    return out


def run(heads=(6, 12), batches=(1, 2, 4, 8, 16, 32, 64), Ts=(1, 2, 4, 8), tiles=(4, 8, 16, 32, 64, 128), D=128,
        backends=("triton", "cute"), peers=True, reps: int = 50, device: str = "cuda", with_kernels=True,
        deadline_s: float | None = None, log: Callable[[str], None] = print, pdl: bool = True) -> list[dict]:
    """The KDA sweep. Returns (rows, meta): one row per implementation per case. On a CPU
    (Triton under TRITON_INTERPRET=1) the timings are cpu-smoke: logic only. pdl: also time the CuTe
    kernel with the kda_pdl switch on ("cute_pdl"), at the default tile of data/kda_defaults.json."""
    from k3lab.harness import timing
    from k3lab.switches import backend_status

    gpu = torch.device(device).type == "cuda"
    copy_bw = timing.measure_copy_bandwidth(device=device)
    launch_us = timing.launch_floor_us(device=device)
    log(f"copy bandwidth {copy_bw:.3f} TB/s, launch floor {launch_us:.2f} us")
    avail = {b: backend_status(b) for b in backends}
    rows: list[dict] = []
    t_end = time.time() + deadline_s if deadline_s else None
    skipped_cases: list[str] = []
    for H in heads:
        for B in batches:
            for T in Ts:
                for tv in tiles:
                    c = KDACase(H, B, T, tv, D=D)
                    if tv > D:
                        continue
                    impls: list[Impl] = []
                    for b in backends:
                        if avail[b][0] and not (b == "cute" and tv not in CUTE_TILES):
                            impls.append(component_impl(c, b))
                            if (b == "cute" and pdl and gpu
                                    and tv == cute_default_tile("decode" if T == 1 else "verify", B, T)):
                                impls.append(component_impl(c, b, pdl=True))
                    if peers:
                        impls += torch_impls(c) + fla_impls(c) + (copy_impls(c) if gpu else [])
                    if not impls:
                        continue
                    if t_end is not None and time.time() > t_end:
                        skipped_cases.append(c.key())
                        continue
                    nbytes = kda_bytes(c)
                    n_sets = max(2, timing.rotation_count(nbytes, timing.l2_bytes())) if gpu else 2
                    sets = [make_set(c, seed=1000 + i, device=device) for i in range(n_sets)]
                    for im in impls:
                        row = dict(component="kda_decode" if T == 1 else "kda_verify", impl=im.name,
                                   backend=im.backend, case=c.key(), heads=H, batch=B, T=T, tile_v=tv,
                                   state_dtype=c.state_dtype, bytes=nbytes, flops=kda_flops(c), note=im.note)
                        try:
                            if im.check is not None:
                                row.update(im.check(clone_set(sets[0])))
                            fns = [im.make(s) for s in sets]
                            if with_kernels and gpu:
                                ks = timing.kernel_list(fns[0])
                                row.update(kernels=ks, launches=timing.launches_per_call(ks))
                            bench = timing.bench_gpu if gpu else timing.bench_cpu
                            tm = bench(lambda f: f(), input_sets=[(f,) for f in fns], reps=reps,
                                       bytes_per_call=nbytes)
                            row.update(median_us=tm.median_us, p10_us=tm.p10_us, p90_us=tm.p90_us,
                                       samples_us=tm.samples_us, timing_kind=tm.kind)
                            floor_us = max(nbytes / (copy_bw * 1e12) * 1e6, launch_us)
                            row.update(floor_us=floor_us, x_floor=tm.median_us / floor_us,
                                       achieved_tbps=nbytes / (tm.median_us * 1e-6) / 1e12,
                                       pct_of_copy=100 * nbytes / (tm.median_us * 1e-6) / 1e12 / copy_bw)
                        except Exception as e:  # noqa: BLE001 - the row records what failed
                            row.update(error=f"{type(e).__name__}: {e}"[:400])
                        rows.append(row)
                        log(_fmt(row))
                    del sets
                    torch.cuda.empty_cache()
    if skipped_cases:
        log(f"deadline reached: {len(skipped_cases)} cases not run")
    return rows, dict(copy_tbps=copy_bw, launch_floor_us=launch_us, unavailable={
        b: why for b, (ok, why) in avail.items() if not ok}, time=time.time(), not_run=skipped_cases)


def _fmt(r: dict) -> str:
    if "error" in r:
        return f"{r['case']:<24} {r['impl']:<16} ERROR {r['error'][:120]}"
    err = r.get("out_err")
    es = f" out_err={err:.2e} st_err={r.get('state_err', float('nan')):.2e}" if err is not None else ""
    if err is not None and not r.get("ok"):
        es += "  FAIL (kept out of the winners)"
    return (f"{r['case']:<24} {r['impl']:<16} {r['median_us']:8.2f} us  floor {r['floor_us']:6.2f}"
            f"  x{r['x_floor']:5.2f}  {r['achieved_tbps']:5.2f} TB/s{es}")


def to_bundle(rows: list[dict], meta: dict, name: str = "kda_sweep", grid: dict | None = None):
    """Results bundle: one Row per (case, implementation); failed rows are kept as notes."""
    from k3lab.harness.bundle import Bundle, Row
    from k3lab.switches import Switches

    b = Bundle.new(name, switches=Switches(), copy_tbps=meta["copy_tbps"],
                   launch_floor_us=meta["launch_floor_us"])
    b.config = {"bench": "kda", "grid": grid or {}, "D": 128, "conv_kernel": 4}
    b.backends_skipped = dict(meta.get("unavailable", {}))
    if meta.get("not_run"):
        b.notes.append(f"deadline reached; cases not run: {meta['not_run']}")
    for r in rows:
        if "median_us" not in r:
            b.notes.append(f"{r['component']} {r['case']} {r['impl']}: {r.get('error')}")
            continue
        b.backends_ran.setdefault(r["backend"], r.get("note") or r["backend"])
        err = None
        if "out_err" in r:
            err = dict(rel_norm=r["out_err"], state_rel_norm=r["state_err"], conv_exact=r["conv_exact"],
                       ok=r["ok"], tol=OUT_TOL, state_tol=STATE_TOL[r["state_dtype"]])
        row = Row(name=f"{r['component']}[{r['case']}]", backend=r["impl"], kind=r["timing_kind"],
                  median_us=r["median_us"], p10_us=r["p10_us"], p90_us=r["p90_us"], samples_us=r["samples_us"],
                  floor_us=r["floor_us"], bytes=r["bytes"], flops=r["flops"], achieved_tbps=r["achieved_tbps"],
                  pct_of_copy=r["pct_of_copy"], launches=r.get("launches"), kernels=r.get("kernels") or [],
                  error=err, extra={k: r[k] for k in ("component", "case", "heads", "batch", "T", "tile_v",
                                                      "state_dtype", "note", "x_floor")})
        b.add(row)
    return b


def winners(rows: list[dict], impls=("triton", "cute")) -> dict:
    """Per (heads, batch, T): the fastest of our implementations whose check passed, with its tile."""
    best: dict[str, dict] = {}
    for r in rows:
        if r.get("impl") not in impls or "median_us" not in r or not r.get("ok"):
            continue
        k = f"H{r['heads']}_B{r['batch']}_T{r['T']}"
        if k not in best or r["median_us"] < best[k]["median_us"]:
            best[k] = dict(backend=r["impl"], tile_v=r["tile_v"], median_us=r["median_us"])
    return best


def default_rules(bundle_rows: list[dict], impl: str, heads: int = 12) -> dict[str, list[dict]]:
    """The auto rules for `impl` ("cute" or "triton") from sweep bundles' rows (their JSON form): per op,
    per measured batch and T, the fastest tile whose fp64 check passed, at `heads` heads. A rule
    {max_batch, max_T, backend, tile_v} matches the first (B, T) with B <= max_batch and T <= max_T
    (None: any), so an unmeasured batch or T takes the next measured one above it and anything beyond
    the sweep takes its largest. Rows of a later bundle replace an earlier one's for the same case."""
    best: dict[tuple, dict] = {}
    for r in bundle_rows:
        x = r.get("extra") or {}
        if r.get("backend") != impl or x.get("heads") != heads or not (r.get("error") or {}).get("ok"):
            continue
        best[(x["batch"], x["T"], x["tile_v"])] = r
    out: dict[str, list[dict]] = {}
    for op, is_op in (("decode", lambda t: t == 1), ("verify", lambda t: t > 1)):
        cells: dict[int, dict[int, tuple]] = {}
        for (B, T, tv), r in best.items():
            if is_op(T):
                cur = cells.setdefault(B, {}).get(T)
                if cur is None or r["median_us"] < cur[1]:
                    cells[B][T] = (tv, r["median_us"])
        groups = []  # per batch: ((max_T, tile), ...) with equal consecutive tiles merged
        for B in sorted(cells):
            g: list[list] = []
            for T in sorted(cells[B]):
                tv = cells[B][T][0]
                if g and g[-1][1] == tv:
                    g[-1][0] = T
                else:
                    g.append([T, tv])
            g[-1][0] = None  # the largest measured T also covers any T above it
            if groups and groups[-1][1] == [tuple(x) for x in g]:
                groups[-1][0] = B
            else:
                groups.append([B, [tuple(x) for x in g]])
        if groups:
            groups[-1][0] = None
        rules = []
        for B, g in groups:
            for max_T, tv in g:
                rule = {"max_batch": B}
                if len(g) > 1:
                    rule["max_T"] = max_T
                rule.update(backend=impl, tile_v=tv)
                rules.append(rule)
        out[op] = rules
    return out
