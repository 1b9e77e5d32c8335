"""GPU check + timing for the CuTe DSL KDA kernels (kda_decode.py, kda_verify.py).

    python kernels/cute/check_kda.py [--quick] [--lean] [--tiny] [--no-time] [--verify-only] [--cold] [--exp]
                                     [--tiles=128,64,32,16]
    python kernels/cute/check_kda.py --prefill [--quick] [--no-time]   (kda_prefill.py only: main_prefill)
    python kernels/cute/check_kda.py --exp-b64        (the B = 64 decode candidates only: main_b64)
    python kernels/cute/check_kda.py --exp-chunk      (the verify chunk knob, then the B = 64 candidates)
    python kernels/cute/check_kda.py --exp-lat        (the latency knobs fast and bpro, and rs with fast)
    python kernels/cute/check_kda.py --exp-thr        (both sides of the latency knobs' resident-grid rule)
    python kernels/cute/check_kda.py --ncu-launch=B,H,tile[,pdl][,knob=value]   (a run for ncu: ncu_launch)

Checks (the same functions tests/test_kda_cute.py asserts on): fresh random inputs from
`make_kda_inputs` (never zeros), outputs poisoned with NaN first, compared against the fp64
reference (`k3lab.ref.kda`, inputs/params/state upcast to float64):
    out relative-norm error < 1e-2, state relative-norm error < 1e-4, conv_state exactly equal;
verify additionally: state_hist/conv_hist per position, state/conv_state untouched, and on the
ragged path every entry at positions >= lengths[b] still poisoned.
Timing: CUDA graph of 20 calls captured back to back, replayed; median per call. `rot` uses a
different buffer set per captured call (up to ~1 GB of distinct state so L2 cannot hold it), `hot`
reuses one set. Achieved bandwidth = the kernel's floor bytes / rot time.
Prints a table; writes JSON to $OUT/kda_cute_tiles<tiles>.json when OUT is set.
"""
import json
import math
import os
import sys
import time
import traceback

import torch

_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
try:
    import k3lab  # noqa: F401
except ImportError:  # not installed: run from the checkout
    sys.path.insert(0, _ROOT)
from k3lab.ref import kda as ref  # noqa: E402 - after the checkout fallback above

try:
    from k3lab_kernels.cute import kda_decode as _kd
    from k3lab_kernels.cute import kda_verify as _kv
    from k3lab_kernels.cute.kda_decode import kda_decode, kda_decode_bytes, kda_verify_bytes
    from k3lab_kernels.cute.kda_decode_persistent import kda_decode_persistent
except ImportError:  # the checkout's `kernels/` folder is the k3lab_kernels package
    if _ROOT not in sys.path:
        sys.path.insert(0, _ROOT)
    from kernels.cute import kda_decode as _kd
    from kernels.cute import kda_verify as _kv
    from kernels.cute.kda_decode import kda_decode, kda_decode_bytes, kda_verify_bytes
    from kernels.cute.kda_decode_persistent import kda_decode_persistent
kda_verify = _kv.kda_verify

OUT_TOL = 1e-2
STATE_TOL = 1e-4
COPY_BW = 4.275e12
# calls per timed graph; each call takes the next of up to N_CALLS buffer sets. 20 sets of a B=1 step
# (34 MB) stay in the 60 MB L2; --cold sets 80 (136 MB at B=1), so the state comes from DRAM as in a
# 69-layer model and as `k3lab bench kda` measures.
N_CALLS = 20
# where check_decode / check_verify / check_prefill put their tensors; tests/test_kda_cute_emulated.py sets
# "cpu" and swaps the kernel entry points for the CPU emulator's (kernels/cute/emulate.py)
DEVICE = "cuda"


def _sync():
    if DEVICE == "cuda":
        torch.cuda.synchronize()


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a = a.double()
    b = b.double()
    if not torch.isfinite(a).all():
        return float("nan")
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


def _inputs(B, H, T=None, seed=0):
    inp, p, st, cs = ref.make_kda_inputs(B, H, 128, T=T, seed=seed, device=DEVICE)
    return inp, p, st, cs


def _ref64(fn, inp, p, st, cs):
    d = torch.float64
    return fn(inp["qkv"].to(d), inp["f"].to(d), inp["b"].to(d), inp["gate"].to(d), p.to(dtype=d),
              st.to(d), cs.to(d), dtype=d, out_dtype=d)


def _decode(qkv, f, b, gate, p, st, cs, out, tile_v=128, stages=None, pdl=False, **knobs):
    """The grid decode (stages None; pdl: programmatic dependent launch; knobs: KDAStepKernel's measurement
    knobs, through kda_decode's _launch_decode) or the persistent one (stages = (CTAs per SM, stages);
    tile 128)."""
    if stages is None:
        knobs = {k: v for k, v in knobs.items() if v is not None}  # measurement knobs given (bare, fold, early)
        if knobs:
            kn = {**knobs, **({"pdl": True} if pdl else {})}
            return _kd._launch_decode(qkv, f, b, gate, p, st, cs, out, tile_v, **kn)
        if pdl:
            return kda_decode(qkv, f, b, gate, p, st, cs, out, tile_v=tile_v, pdl=True)
        return kda_decode(qkv, f, b, gate, p, st, cs, out, tile_v=tile_v)
    return kda_decode_persistent(qkv, f, b, gate, p, st, cs, out, ctas=stages[0], stages=stages[1])


def check_decode(B: int, H: int, seed: int = 0, steps: int = 1, tile_v: int = 128, stages=None,
                 pdl: bool = False, **knobs) -> dict:
    """Run `steps` decode steps with fresh inputs each step; compare each step with the fp64 oracle
    carried from the same start. Returns the worst errors. stages=(ctas, stages): the persistent kernel."""
    _, p, st, cs = _inputs(B, H, seed=seed)
    st_k, cs_k = st.clone(), cs.clone()
    st_r, cs_r = st.double(), cs.double()
    worst = {"out_err": 0.0, "state_err": 0.0, "conv_exact": True, "out_finite": True}
    for s in range(steps):
        inp, _, _, _ = _inputs(B, H, seed=seed + 1000 * (s + 1))
        out = torch.full((B, H * 128), float("nan"), dtype=torch.bfloat16, device=DEVICE)
        _decode(inp["qkv"], inp["f"], inp["b"], inp["gate"], p, st_k, cs_k, out, tile_v=tile_v, stages=stages,
                pdl=pdl, **knobs)
        _sync()
        o_r, st_r, cs_r = _ref64(ref.kda_decode, inp, p, st_r, cs_r)
        worst["out_finite"] &= bool(torch.isfinite(out).all())
        worst["out_err"] = max(worst["out_err"], _rel(out, o_r))
        worst["state_err"] = max(worst["state_err"], _rel(st_k, st_r))
        worst["conv_exact"] &= bool(torch.equal(cs_k.double(), cs_r))
        cs_r = cs_k.double()  # exact anyway; keeps the oracle on the same inputs
    worst["ok"] = (worst["out_finite"] and worst["out_err"] < OUT_TOL and worst["state_err"] < STATE_TOL
                   and worst["conv_exact"])
    return worst


def _verify(qkv, f, b, gate, p, st, cs, out, sh, ch, lengths, tile_v, layout, row_warps, knobs):
    if not knobs:
        return kda_verify(qkv, f, b, gate, p, st, cs, out, sh, ch, lengths=lengths, tile_v=tile_v,
                          layout=layout, row_warps=row_warps)
    _kv._launch(qkv, f, b, gate, p, st, cs, out, sh, ch, lengths, tile_v, layout,
                row_warps or _kv.ROW_WARPS[tile_v], **knobs)
    return out


def check_verify(B: int, H: int, T: int, ragged: bool = False, seed: int = 0,
                 tile_v: int = 128, layout: str = "columns", row_warps=None, knobs=None) -> dict:
    """One verify call against the fp64 oracle. knobs (dict: preload, scatter) force the column kernel's
    choices (measurement knobs: launched through kda_verify's _launch, unvalidated)."""
    inp, p, st, cs = _inputs(B, H, T=T, seed=seed)
    st0, cs0 = st.clone(), cs.clone()
    C = 3 * H * 128
    out = torch.full((B, T, H * 128), float("nan"), dtype=torch.bfloat16, device=DEVICE)
    sh = torch.full((B, T, H, 128, 128), float("nan"), dtype=torch.float32, device=DEVICE)
    ch = torch.full((B, T, C, 3), float("nan"), dtype=torch.bfloat16, device=DEVICE)
    lengths = None
    if ragged:
        g = torch.Generator().manual_seed(seed + 7)
        lengths = torch.randint(1, T + 1, (B,), generator=g, dtype=torch.int32)
        lengths[0] = T
        if B > 1:
            lengths[1] = 1
        lengths = lengths.to(DEVICE)
    _verify(inp["qkv"], inp["f"], inp["b"], inp["gate"], p, st, cs, out, sh, ch, lengths, tile_v, layout,
            row_warps, knobs)
    _sync()
    o_r, s_r, c_r = _ref64(ref.kda_verify, inp, p, st, cs)
    res = {"out_err": 0.0, "state_err": 0.0, "conv_exact": True, "untouched": True,
               "inputs_unchanged": bool(torch.equal(st, st0) and torch.equal(cs, cs0)), "out_finite": True}
    Ls = lengths.tolist() if ragged else [T] * B
    for bi, L in enumerate(Ls):
        res["out_finite"] &= bool(torch.isfinite(out[bi, :L]).all())
        res["out_err"] = max(res["out_err"], _rel(out[bi, :L], o_r[bi, :L]))
        res["state_err"] = max(res["state_err"], _rel(sh[bi, :L], s_r[bi, :L]))
        res["conv_exact"] &= bool(torch.equal(ch[bi, :L].double(), c_r[bi, :L]))
        if L < T:
            res["untouched"] &= bool(torch.isnan(out[bi, L:]).all() and torch.isnan(sh[bi, L:]).all()
                                     and torch.isnan(ch[bi, L:]).all())
    res["ok"] = (res["out_finite"] and res["out_err"] < OUT_TOL and res["state_err"] < STATE_TOL
                 and res["conv_exact"] and res["untouched"] and res["inputs_unchanged"])
    return res


def check_errors() -> dict:
    """The wrapper refuses what it does not support, with a clear error."""
    inp, p, st, cs = _inputs(1, 6)
    out = torch.empty((1, 6 * 128), dtype=torch.bfloat16, device="cuda")
    cases = {
        "tile_v=8": lambda: kda_decode(inp["qkv"], inp["f"], inp["b"], inp["gate"], p, st, cs, out,
                                       tile_v=8),
        "stages=4": lambda: kda_decode_persistent(inp["qkv"], inp["f"], inp["b"], inp["gate"], p, st, cs, out,
                                                  stages=4),
        "ctas=2 stages=2": lambda: kda_decode_persistent(inp["qkv"], inp["f"], inp["b"], inp["gate"], p, st, cs,
                                                         out, ctas=2, stages=2),
        "noncontig state": lambda: kda_decode(inp["qkv"], inp["f"], inp["b"], inp["gate"], p,
                                              st.transpose(2, 3), cs, out),
        "fp32 qkv": lambda: kda_decode(inp["qkv"].float(), inp["f"], inp["b"], inp["gate"], p, st, cs,
                                       out),
        "cpu": lambda: kda_decode(inp["qkv"].cpu(), inp["f"], inp["b"], inp["gate"], p, st, cs, out),
    }
    res = {}
    for k, fn in cases.items():
        try:
            fn()
            res[k] = "NOT RAISED"
        except (ValueError, TypeError, NotImplementedError) as e:
            res[k] = type(e).__name__
    res["ok"] = all(v != "NOT RAISED" for v in res.values())
    return res


# ---- timing ----------------------------------------------------------------------------------

def _graph_us(calls, iters=15):
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for c in calls:
            c()
    torch.cuda.current_stream().wait_stream(s)
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for c in calls:
            c()
    g.replay()
    torch.cuda.synchronize()
    ts = []
    for _ in range(iters):
        e0 = torch.cuda.Event(enable_timing=True)
        e1 = torch.cuda.Event(enable_timing=True)
        e0.record()
        g.replay()
        e1.record()
        e1.synchronize()
        ts.append(e0.elapsed_time(e1) * 1e3 / len(calls))
    ts.sort()
    del g
    return ts[len(ts) // 2]


def _sets(make, set_bytes, budget=1 << 30, n_calls=20):
    n = max(1, min(n_calls, math.ceil(budget / max(set_bytes, 1))))
    base = make()
    return [base] + [{k: (v.clone() if isinstance(v, torch.Tensor) else v) for k, v in base.items()}
                     for _ in range(n - 1)]


def _rot_hot(call, sets, n_calls, nbytes, hot_sets=1) -> dict:
    """Time n_calls of call(set) in one graph twice: rotating over `sets` (rot) and over the first `hot_sets`
    of them (hot); the result row every time_* function returns."""
    rot = _graph_us([call(sets[i % len(sets)]) for i in range(n_calls)])
    hot = _graph_us([call(sets[i % min(hot_sets, len(sets))]) for i in range(n_calls)])
    return {"rot_us": rot, "hot_us": hot, "bytes": nbytes, "tbps": nbytes / rot * 1e-6,
            "floor_us": nbytes / COPY_BW * 1e6}


def time_decode(B, H, n_calls=None, tile_v=128, stages=None, pdl=False, **knobs):
    inp, p, st, cs = _inputs(B, H, seed=1)

    def make():
        return {"qkv": inp["qkv"], "f": inp["f"], "b": inp["b"], "gate": inp["gate"], "st": st.clone(),
                    "cs": cs.clone(), "out": torch.empty(B, H * 128, dtype=torch.bfloat16, device="cuda")}

    n_calls = n_calls or N_CALLS
    nbytes = kda_decode_bytes(B, H)
    sets = _sets(make, nbytes, n_calls=n_calls)

    def call(d):
        return lambda: _decode(d["qkv"], d["f"], d["b"], d["gate"], p, d["st"], d["cs"], d["out"],
                               tile_v=tile_v, stages=stages, pdl=pdl, **knobs)

    # pdl: back-to-back calls on one set would break its precondition (read the state the previous call
    # is writing); the hot figure then alternates two sets
    return _rot_hot(call, sets, n_calls, nbytes, hot_sets=2 if pdl else 1)


def _verify_nohist(qkv, f, b, gate, p, st, cs, out, sh, ch, tile_v, row_warps):
    """The column-layout kernel compiled without its state_hist stores (measurement only: what the
    stores cost at small batch). Same arguments as kda_verify; sh is not written."""
    _kv._launch(qkv, f, b, gate, p, st, cs, out, sh, ch, None, tile_v, "columns", row_warps, hist=False)
    return out


def time_verify(B, H, T, n_calls=None, tile_v=128, layout="columns", row_warps=None, knobs=None):
    inp, p, st, cs = _inputs(B, H, T=T, seed=2)
    C = 3 * H * 128

    def make():
        return {"qkv": inp["qkv"].clone(), "f": inp["f"], "b": inp["b"], "gate": inp["gate"], "st": st.clone(),
                    "cs": cs.clone(), "out": torch.empty(B, T, H * 128, dtype=torch.bfloat16, device="cuda"),
                    "sh": torch.empty(B, T, H, 128, 128, device="cuda"),
                    "ch": torch.empty(B, T, C, 3, dtype=torch.bfloat16, device="cuda")}

    n_calls = n_calls or N_CALLS
    nbytes = kda_verify_bytes(B, H, T)
    sets = _sets(make, nbytes, n_calls=n_calls)

    def call(d):
        if layout == "columns-nohist":
            return lambda: _verify_nohist(d["qkv"], d["f"], d["b"], d["gate"], p, d["st"], d["cs"], d["out"],
                                          d["sh"], d["ch"], tile_v, row_warps or _kv.ROW_WARPS[tile_v])
        if knobs:
            return lambda: _kv._launch(d["qkv"], d["f"], d["b"], d["gate"], p, d["st"], d["cs"], d["out"], d["sh"],
                                       d["ch"], None, tile_v, layout, row_warps or _kv.ROW_WARPS[tile_v], **knobs)
        return lambda: kda_verify(d["qkv"], d["f"], d["b"], d["gate"], p, d["st"], d["cs"], d["out"],
                                  d["sh"], d["ch"], tile_v=tile_v, layout=layout, row_warps=row_warps)

    return _rot_hot(call, sets, n_calls, nbytes)


def copy_bw(nbytes=1 << 30):
    a = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    b = torch.empty_like(a)
    b.copy_(a)
    torch.cuda.synchronize()
    ts = []
    for _ in range(10):
        e0 = torch.cuda.Event(enable_timing=True)
        e1 = torch.cuda.Event(enable_timing=True)
        e0.record()
        b.copy_(a)
        e1.record()
        e1.synchronize()
        ts.append(e0.elapsed_time(e1) * 1e-3)
    ts.sort()
    return 2 * nbytes / ts[len(ts) // 2]


# ---- the tile-16 and persistent-decode experiment (--exp) -------------------------------------

def experiment(report: dict) -> None:
    """The measured alternatives to the defaults, checked then timed DRAM-cold (N_CALLS = 80), each beside
    the default it lost or won against: tile 16 vs 32 (decode and verify at B = 1); the verify knobs
    (register preload, butterfly reduce-scatter, delayed state_hist stores, late conv_hist stores,
    column-group named barriers, no stores at all); the persistent decode ((CTAs per SM, stages) =
    (2, 1), (1, 2), (1, 3), and the register-light (3, 1)) vs the grid kernel."""
    global N_CALLS
    t0 = time.time()
    ex = report.setdefault("exp", {"decode": [], "verify": [], "timing_decode": [], "timing_verify": []})
    print("\n== exp: decode correctness (persistent) ==")
    for B, H, stg in [(64, 12, (2, 1)), (5, 6, (2, 1)), (64, 12, (1, 2)), (256, 12, (1, 3)), (3, 96, (1, 3)),
                      (64, 12, (3, 1)), (5, 6, (3, 1)), (256, 12, (3, 1)), (3, 96, (3, 1))]:
        r = _safe(check_decode, B, H, seed=B * 7 + H, steps=2 if B <= 8 else 1, stages=stg)
        r.update(B=B, H=H, tile_v=128, stages=stg)
        ex["decode"].append(r)
        print(f"{B:>4} {H:>3} pers={stg!s:>6} out {r.get('out_err', float('nan')):.2e} "
              f"state {r.get('state_err', float('nan')):.2e} conv {r.get('conv_exact')} ok {r['ok']} "
              f"{r.get('error', '')}")
    print("\n== exp: decode correctness, programmatic dependent launch (pdl) ==")
    for B, H, tv in [(1, 12, 16), (2, 12, 32), (4, 6, 64), (64, 12, 128), (3, 96, 128), (256, 12, 128)]:
        r = _safe(check_decode, B, H, seed=B * 5 + H + tv, steps=2 if B <= 8 else 1, tile_v=tv, pdl=True)
        r.update(B=B, H=H, tile_v=tv, pdl=True)
        ex["decode"].append(r)
        print(f"{B:>4} {H:>3} tile {tv:>3} pdl out {r.get('out_err', float('nan')):.2e} "
              f"state {r.get('state_err', float('nan')):.2e} conv {r.get('conv_exact')} ok {r['ok']} "
              f"{r.get('error', '')}")
    print("\n== exp: verify correctness (knobs {} = the defaults) ==")
    vcases = [((1, 12, 4, False), 16, 4, {"delay": True}), ((5, 6, 8, True), 16, 4, {"delay": True}),
              ((64, 12, 4, False), 128, 4, {"delay": True}), ((1, 12, 4, False), 16, 4, {"scatter": False}),
              ((8, 12, 4, True), 32, 4, {"preload": False, "scatter": False}),
              ((3, 6, 5, True), 64, 2, {"delay": True}), ((1, 12, 4, False), 16, 4, {"late_conv": True}),
              ((5, 6, 8, True), 16, 4, {"late_conv": True}), ((3, 6, 5, True), 128, 2, {"late_conv": True}),
              ((1, 12, 4, False), 16, 4, {"group_bar": True}), ((5, 6, 8, True), 32, 2, {"group_bar": True}),
              ((64, 12, 4, False), 128, 4, {"group_bar": True}),
              ((1, 12, 4, False), 16, 4, {"pdl": True}), ((5, 6, 8, True), 16, 4, {"pdl": True}),
              ((64, 12, 4, False), 128, 4, {"pdl": True}), ((3, 6, 5, True), 32, 2, {"pdl": True, "late_conv": True})]
    for (B, H, T, rg), tv, wr, kn in vcases:
        r = _safe(check_verify, B, H, T, ragged=rg, seed=B + H + T + tv, tile_v=tv, row_warps=wr, knobs=kn)
        r.update(B=B, H=H, T=T, ragged=rg, tile_v=tv, row_warps=wr, knobs=kn)
        ex["verify"].append(r)
        print(f"{B:>4} {H:>3} {T:>2} {rg!s:>5} tile {tv:>3} wr {wr} {kn!s:>18} out "
              f"{r.get('out_err', float('nan')):.2e} state {r.get('state_err', float('nan')):.2e} conv "
              f"{r.get('conv_exact')} untouched {r.get('untouched')} ok {r['ok']} {r.get('error', '')}")
    print(f"  [{time.time() - t0:.0f}s]")
    N_CALLS = 80
    print("\n== exp: verify timing, DRAM-cold (80 calls a graph) ==")
    off = {"preload": False, "scatter": False}
    vt = [(1, 12, 4, 16, 4, {}), (1, 12, 4, 16, 4, {"delay": True}), (1, 12, 4, 16, 4, {"scatter": False}),
          (1, 12, 4, 16, 4, {"preload": False}), (1, 12, 4, 16, 4, off), (1, 12, 4, 16, 4, {"hist": False}),
          (1, 12, 4, 16, 8, {}), (1, 12, 4, 32, 4, {}), (1, 12, 4, 32, 4, off),
          (1, 12, 8, 16, 4, {}), (1, 12, 8, 16, 4, {"delay": True}), (1, 12, 8, 16, 4, {"preload": False}),
          (1, 12, 2, 16, 4, {}), (1, 12, 2, 16, 4, {"delay": True}), (1, 12, 4, 16, 4, {"late_conv": True}),
          (1, 12, 8, 16, 4, {"late_conv": True}), (1, 12, 4, 16, 4, {"group_bar": True}),
          (1, 12, 4, 16, 4, {"group_bar": True, "late_conv": True}), (1, 12, 8, 16, 4, {"group_bar": True}),
          (64, 12, 4, 128, 4, {"group_bar": True}),
          (64, 12, 4, 128, 4, {}), (64, 12, 4, 128, 4, {"delay": True}), (64, 12, 4, 128, 4, {"scatter": False}),
          (1, 12, 4, 16, 4, {"pdl": True}), (1, 12, 8, 16, 4, {"pdl": True}), (1, 12, 2, 16, 4, {"pdl": True}),
          (1, 12, 4, 16, 4, {"pdl": True, "late_conv": True}), (1, 12, 4, 16, 4, {"pdl": True, "group_bar": True}),
          (64, 12, 4, 128, 4, {"pdl": True})]
    for B, H, T, tv, wr, kn in vt:
        if kn.get("hist") is False:
            r = _safe(time_verify, B, H, T, tile_v=tv, layout="columns-nohist", row_warps=wr)
        else:
            r = _safe(time_verify, B, H, T, tile_v=tv, row_warps=wr, knobs=kn)
        r.update(B=B, H=H, T=T, tile_v=tv, row_warps=wr, knobs=kn)
        ex["timing_verify"].append(r)
        if "rot_us" in r:
            print(f"{B:>4} {H:>3} {T:>2} tile {tv:>3} wr {wr} {kn!s:>36} rot {r['rot_us']:8.2f} "
                  f"hot {r['hot_us']:8.2f} {r['tbps']:.3f} TB/s")
    print(f"  [{time.time() - t0:.0f}s]")
    print("\n== exp: decode timing, DRAM-cold ==")
    tcases = [(1, 12, 16, None), (1, 12, 32, None)]
    for B in (16, 64, 256):
        tcases += [(B, 12, 128, stg) for stg in (None, (2, 1), (1, 2), (1, 3), (3, 1))]
    tcases += [(64, 96, 128, None), (64, 96, 128, (2, 1)), (64, 96, 128, (3, 1)), (32, 12, 128, None),
               (32, 12, 128, (3, 1))]
    tcases = [(B, H, tv, stg, False) for B, H, tv, stg in tcases]
    tcases += [(1, 12, 16, None, True), (2, 12, 32, None, True), (4, 12, 64, None, True), (8, 12, 128, None, True),
               (16, 12, 128, None, True), (32, 12, 128, None, True), (64, 12, 128, None, True),
               (256, 12, 128, None, True), (64, 96, 128, None, True), (1, 6, 16, None, True), (64, 6, 128, None, True),
               (1, 6, 16, None, False), (64, 6, 128, None, False)]
    for B, H, tv, stg, pdl in tcases:
        r = _safe(time_decode, B, H, tile_v=tv, stages=stg, pdl=pdl)
        r.update(B=B, H=H, tile_v=tv, stages=stg, pdl=pdl)
        ex["timing_decode"].append(r)
        if "rot_us" in r:
            print(f"{B:>4} {H:>3} {tv:>4} pers={stg!s:>6} pdl={pdl!s:>5} rot {r['rot_us']:8.2f} hot {r['hot_us']:8.2f} "
                  f"floor {r['floor_us']:7.2f} {r['tbps']:.3f} TB/s")
    b64_experiment(ex)
    print(f"  [{time.time() - t0:.0f}s]")
    N_CALLS = 20
    ex["all_ok"] = all(r.get("ok") for r in ex["decode"] + ex["verify"])


# the B = 64 decode target: (B, H, tile, knobs). {} = the defaults (fold and early on at tile 128); OFF = the
# kernel before them; bare = the same grid's state traffic alone (see KDAStepKernel)
OFF = {"fold": False, "early": False}
B64_CASES = [(64, 12, 128, {}), (64, 12, 128, {"pdl": True}), (64, 12, 128, OFF), (64, 12, 128, {**OFF, "pdl": True}),
             (64, 12, 128, {"fold": False}), (64, 12, 128, {"early": False}),
             (64, 12, 128, {"bare": "pad2"}), (64, 12, 128, {"bare": "pad2", "pdl": True}),
             (64, 12, 128, {"rs": True}), (64, 12, 128, {"rs": True, "pdl": True}),
             (256, 12, 128, {}), (256, 12, 128, OFF), (16, 12, 128, {}), (16, 12, 128, OFF),
             (1, 12, 16, {}), (1, 12, 16, {"fold": True}), (4, 12, 64, {}), (4, 12, 64, {"fold": False})]


EXP_CALLS = 80  # calls a graph in the experiments' timing: DRAM-cold at B = 1, as `k3lab bench kda` measures


def _exp_check_decode(ex: dict, cases, seed_add: int = 0) -> None:
    """Each (B, H, tile, knobs) of `cases` through check_decode (two steps) against fp64; rows into ex["decode"]."""
    for B, H, tv, kn in cases:
        r = _safe(check_decode, B, H, seed=B * 3 + H + tv + seed_add, steps=2, tile_v=tv, **kn)
        r.update(B=B, H=H, tile_v=tv, **kn)
        ex["decode"].append(r)
        print(f"{B:>4} {H:>3} tile {tv:>3} {kn!s:>34} out {r.get('out_err', float('nan')):.2e} "
              f"state {r.get('state_err', float('nan')):.2e} conv {r.get('conv_exact')} ok {r['ok']} "
              f"{r.get('error', '')}")


def _exp_check_verify(ex: dict, cases, seed_add: int = 0) -> None:
    """Each ((B, H, T, ragged), tile, knobs) of `cases` through check_verify at the tile's default row warps;
    rows into ex["verify"]."""
    for (B, H, T, rg), tv, kn in cases:
        wr = _kv.ROW_WARPS[tv]
        r = _safe(check_verify, B, H, T, ragged=rg, seed=B + H + T + tv + seed_add, tile_v=tv, row_warps=wr,
                  knobs=kn)
        r.update(B=B, H=H, T=T, ragged=rg, tile_v=tv, row_warps=wr, knobs=kn)
        ex["verify"].append(r)
        print(f"{B:>4} {H:>3} {T:>2} {rg!s:>5} tile {tv:>3} {kn!s:>34} out {r.get('out_err', float('nan')):.2e} "
              f"state {r.get('state_err', float('nan')):.2e} conv {r.get('conv_exact')} untouched "
              f"{r.get('untouched')} ok {r['ok']} {r.get('error', '')}")


def _exp_time_decode(ex: dict, cases) -> None:
    """Each (B, H, tile, knobs) of `cases` timed DRAM-cold (EXP_CALLS a graph); rows into ex["timing_decode"]."""
    for B, H, tv, kn in cases:
        r = _safe(time_decode, B, H, n_calls=EXP_CALLS, tile_v=tv, **kn)
        r.update(B=B, H=H, tile_v=tv, stages=None, **kn)
        ex["timing_decode"].append(r)
        if "rot_us" in r:
            print(f"{B:>4} {H:>3} {tv:>4} grid {B * H * (128 // tv):>5} {kn!s:>46} rot {r['rot_us']:8.2f} "
                  f"hot {r['hot_us']:8.2f} floor {r['floor_us']:7.2f} {r['tbps']:.3f} TB/s")


def _exp_time_verify(ex: dict, cases) -> None:
    """Each (B, H, T, tile, knobs) of `cases` timed DRAM-cold at the tile's default row warps; rows into
    ex["timing_verify"]."""
    for B, H, T, tv, kn in cases:
        wr = _kv.ROW_WARPS[tv]
        r = _safe(time_verify, B, H, T, n_calls=EXP_CALLS, tile_v=tv, row_warps=wr, knobs=kn)
        r.update(B=B, H=H, T=T, tile_v=tv, row_warps=wr, knobs=kn)
        ex["timing_verify"].append(r)
        if "rot_us" in r:
            print(f"{B:>4} {H:>3} {T:>2} tile {tv:>3} grid {B * H * (128 // tv):>5} {kn!s:>46} "
                  f"rot {r['rot_us']:8.2f} hot {r['hot_us']:8.2f} {r['tbps']:.3f} TB/s")


def b64_experiment(ex: dict) -> None:
    """The B = 64 decode target (--exp, or alone with --exp-b64): the decode as it is and with its fold /
    early knobs off (each checked against fp64 first), with and without pdl, beside `bare` (the same grid's
    state traffic with nothing else) and torch's in-place scale of the same state, all timed DRAM-cold
    (80 calls a graph)."""
    print("\n== exp: decode correctness ==")
    _exp_check_decode(ex, [(64, 12, 128, {}), (5, 6, 64, {}), (3, 96, 32, {}), (2, 12, 16, {"pdl": True}),
                           (7, 6, 128, {"pdl": True}), (64, 12, 128, OFF), (3, 96, 128, {"fold": False}),
                           (5, 6, 64, {"fold": False}), (2, 12, 16, {"fold": True, "pdl": True}),
                           (7, 6, 32, {"fold": True}), (4, 12, 128, {"early": False, "pdl": True}),
                           (64, 12, 128, {"rs": True}), (3, 96, 128, {"rs": True, "pdl": True})])
    print("\n== exp: decode timing, the B = 64 target (bare = the state traffic alone), DRAM-cold ==")
    _exp_time_decode(ex, B64_CASES)
    print("\n== exp: torch's in-place scale of the same state (read and written in place, as the kernel does) ==")
    for B in (64,):
        r = _safe(time_inplace, B, 12, n_calls=EXP_CALLS)
        r.update(B=B, H=12, impl="torch_inplace")
        ex["timing_decode"].append(r)
        if "rot_us" in r:
            print(f"{B:>4} {12:>3} state.mul_ rot {r['rot_us']:8.2f} hot {r['hot_us']:8.2f} "
                  f"floor {r['floor_us']:7.2f} {r['tbps']:.3f} TB/s (of the decode's bytes)")


# the verify `chunk` knob (the T positions as one chunk: one pass over the state, one exchange) beside the
# stepwise chain: (B, H, T, tile, knobs); {} = the defaults
CHUNK = {"chunk": True}
CHUNK_CHECKS = [((1, 12, 4, False), 16, CHUNK), ((1, 12, 8, False), 16, CHUNK), ((5, 6, 8, True), 16, CHUNK),
                ((2, 12, 2, False), 16, CHUNK), ((3, 6, 3, True), 32, CHUNK), ((8, 12, 4, True), 64, CHUNK),
                ((64, 12, 4, False), 128, CHUNK), ((2, 96, 5, True), 128, CHUNK), ((1, 12, 1, False), 16, CHUNK),
                ((1, 12, 4, True), 16, {**CHUNK, "pdl": True}), ((4, 6, 8, True), 32, {**CHUNK, "preload": True}),
                ((1, 12, 8, False), 16, {**CHUNK, "preload": True}),
                ((3, 12, 4, False), 16, {**CHUNK, "group_bar": False})]
CHUNK_TIMES = [(1, 12, 4, 16, {}), (1, 12, 4, 16, CHUNK), (1, 12, 4, 16, {"pdl": True}),
               (1, 12, 4, 16, {**CHUNK, "pdl": True}), (1, 12, 4, 32, CHUNK),
               (1, 12, 4, 16, {**CHUNK, "preload": False}),
               (1, 12, 2, 16, {}), (1, 12, 2, 16, CHUNK), (1, 12, 8, 16, {}), (1, 12, 8, 16, CHUNK),
               (1, 12, 8, 16, {**CHUNK, "preload": True}), (1, 12, 8, 16, {**CHUNK, "pdl": True}),
               (1, 6, 4, 16, {}), (1, 6, 4, 16, CHUNK),
               (2, 12, 4, 32, {}), (2, 12, 4, 32, CHUNK), (2, 12, 4, 16, {}), (2, 12, 4, 16, CHUNK),
               (4, 12, 4, 32, {}), (4, 12, 4, 32, CHUNK), (4, 12, 4, 64, CHUNK),
               (8, 12, 4, 64, {}), (8, 12, 4, 64, CHUNK), (8, 12, 8, 128, {}), (8, 12, 8, 128, CHUNK),
               (16, 12, 4, 128, {}), (16, 12, 4, 128, CHUNK), (64, 12, 4, 128, {}), (64, 12, 4, 128, CHUNK)]


# the latency knobs (third call of the fifth session): fast (single-MUFU transcendentals, decode and verify)
# and bpro (the verify's batched prologue), each alone and together, beside the defaults
FAST, BPRO = {"fast": True}, {"bpro": True}
FB = {"fast": True, "bpro": True}
LAT_CHECKS = [((1, 12, 4, False), 16, FB), ((1, 12, 8, False), 16, FB), ((5, 6, 8, True), 16, FB),
              ((2, 12, 2, False), 32, FB), ((3, 6, 3, True), 32, BPRO), ((8, 12, 4, True), 64, FB),
              ((64, 12, 4, False), 128, FB), ((2, 96, 5, True), 128, FB), ((1, 12, 1, False), 16, FB),
              ((1, 12, 4, True), 16, {**FB, "pdl": True}), ((4, 6, 8, True), 32, FAST), ((3, 12, 7, True), 16, BPRO)]
LAT_TIMES = [(1, 12, 4, 16, {}), (1, 12, 4, 16, FAST), (1, 12, 4, 16, BPRO), (1, 12, 4, 16, FB),
             (1, 12, 4, 16, {"pdl": True}), (1, 12, 4, 16, {**FB, "pdl": True}), (1, 12, 4, 32, FB),
             (1, 12, 4, 16, {**FB, "hist": False}), (1, 12, 4, 16, {**FB, "chunk": True}),
             (1, 12, 2, 16, {}), (1, 12, 2, 16, FB), (1, 12, 8, 16, {}), (1, 12, 8, 16, FAST), (1, 12, 8, 16, BPRO),
             (1, 12, 8, 16, FB), (1, 12, 8, 16, {**FB, "pdl": True}), (1, 6, 4, 16, {}), (1, 6, 4, 16, FB),
             (2, 12, 4, 32, {}), (2, 12, 4, 32, FB), (4, 12, 4, 32, {}), (4, 12, 4, 32, FB),
             (8, 12, 4, 64, {}), (8, 12, 4, 64, FB), (8, 12, 8, 128, {}), (8, 12, 8, 128, FB),
             (16, 12, 4, 128, {}), (16, 12, 4, 128, FB), (64, 12, 4, 128, {}), (64, 12, 4, 128, FB),
             (64, 12, 4, 128, FAST)]
LAT_DECODE = [(1, 12, 16, {}), (1, 12, 16, FAST), (1, 12, 16, {"pdl": True}), (1, 12, 16, {**FAST, "pdl": True}),
              (2, 12, 16, {}), (2, 12, 16, FAST), (4, 12, 128, {}), (4, 12, 128, FAST), (8, 12, 128, {}),
              (8, 12, 128, FAST), (16, 12, 128, {}), (16, 12, 128, FAST), (16, 12, 128, {"rs": True}),
              (16, 12, 128, {**FAST, "rs": True}), (32, 12, 128, {}), (32, 12, 128, {"rs": True}),
              (64, 12, 128, {}), (64, 12, 128, FAST), (64, 12, 128, {"rs": True}), (64, 12, 128, {**FAST, "rs": True}),
              (64, 12, 128, {"rs": True, "pdl": True}), (64, 12, 128, {**FAST, "rs": True, "pdl": True}),
              (256, 12, 128, {}), (256, 12, 128, {"rs": True}), (256, 12, 128, {**FAST, "rs": True}),
              (1, 6, 16, {}), (1, 6, 16, FAST), (64, 6, 128, {}), (64, 6, 128, {**FAST, "rs": True}),
              (64, 96, 128, {}), (64, 96, 128, {**FAST, "rs": True})]
LAT_DECODE_CHECKS = [(1, 12, 16, FAST), (2, 12, 16, {**FAST, "pdl": True}), (5, 6, 64, FAST), (3, 96, 32, FAST),
                     (64, 12, 128, {**FAST, "rs": True}), (7, 6, 128, {**FAST, "rs": True, "pdl": True}),
                     (256, 12, 128, {"rs": True}), (3, 96, 128, {**FAST, "rs": True})]


# where the resident-grid rule (decode fast, verify bpro on while B H NC <= 2 x 132) switches: each knob on and
# off on both sides of it (12 heads: B 16 / 24 below or at it, 32 / 48 above; 6 heads: B 32 below, 64 above)
THR_DECODE = [(B, H, 128, {"fast": f}) for B, H in ((16, 12), (24, 12), (32, 12), (48, 12), (32, 6), (64, 6))
              for f in (True, False)]
THR_VERIFY = [(B, H, T, 128, {"bpro": bp}) for B, H, T in ((16, 12, 4), (24, 12, 2), (32, 12, 2), (32, 12, 4),
                                                          (32, 6, 4), (64, 6, 4)) for bp in (True, False)]


def thr_experiment(ex: dict) -> None:
    """--exp-thr: the resident-grid threshold of the latency knobs, timed DRAM-cold on both sides."""
    print("\n== exp: the resident-grid rule, decode fast on / off ==")
    _exp_time_decode(ex, THR_DECODE)
    print("\n== exp: the resident-grid rule, verify bpro on / off ==")
    _exp_time_verify(ex, THR_VERIFY)


def lat_experiment(ex: dict) -> None:
    """The latency knobs: verify fast / bpro and decode fast (and rs with them), checked against fp64, then
    timed DRAM-cold (80 calls a graph) beside the defaults."""
    print("\n== exp: verify correctness, fast / bpro ==")
    _exp_check_verify(ex, LAT_CHECKS, seed_add=5)
    print("\n== exp: decode correctness, fast / rs ==")
    _exp_check_decode(ex, LAT_DECODE_CHECKS, seed_add=1)
    print("\n== exp: verify timing, fast / bpro beside the defaults, DRAM-cold ==")
    _exp_time_verify(ex, LAT_TIMES)
    print("\n== exp: decode timing, fast / rs beside the defaults, DRAM-cold ==")
    _exp_time_decode(ex, LAT_DECODE)


def chunk_experiment(ex: dict) -> None:
    """The verify `chunk` knob: checked against fp64 (every tile, T 1..8, ragged, pdl, preload forced), then
    timed DRAM-cold (80 calls a graph) beside the stepwise chain at the same tile."""
    print("\n== exp: verify correctness, chunk ==")
    _exp_check_verify(ex, CHUNK_CHECKS, seed_add=3)
    print("\n== exp: verify timing, chunk beside the stepwise chain, DRAM-cold ==")
    _exp_time_verify(ex, CHUNK_TIMES)


def time_inplace(B, H, n_calls=None):
    """torch's in-place scale of the decode's fp32 state and bf16 conv state on the same rotated sets: the
    plainest kernel that reads and writes those bytes in place. tbps counts the decode's floor bytes, so
    the figure compares with the kernel's."""
    _, _, st, cs = _inputs(B, H, seed=1)
    n_calls = n_calls or N_CALLS
    nbytes = kda_decode_bytes(B, H)
    sets = _sets(lambda: {"st": st.clone(), "cs": cs.clone()}, nbytes, n_calls=n_calls)

    def call(d):
        def run():
            d["st"].mul_(0.999)
            d["cs"].mul_(1.0)
        return run

    return _rot_hot(call, sets, n_calls, nbytes)


def ncu_launch(spec: str) -> int:
    """--ncu-launch=B,H,tile[,pdl][,knob=value...] (bare=pad2, fold=0, early=0) or --ncu-launch=inplace,B,H:
    build 8 rotated sets, run each once (compiles), then launch 6 more calls between cudaProfilerStart/Stop, so
    `ncu --profile-from-start off --launch-skip 4 --launch-count 1` profiles one call in the middle
    of a back-to-back run (the previous calls' dirty state still in L2, as in the timed graphs)."""
    parts = spec.split(",")
    inplace = parts[0] == "inplace"
    if inplace:
        parts = parts[1:]
    B, H = int(parts[0]), int(parts[1])
    tv = int(parts[2]) if len(parts) > 2 and not inplace else 128
    pdl = "pdl" in parts[3:]
    # the rest: pdl, or knob=value (bare=pad2, fold=0, early=0, rs=1)
    knobs = {k: (v if k == "bare" else bool(int(v)))
             for k, v in (x.split("=", 1) for x in parts[3:] if "=" in x)}
    inp, p, st, cs = _inputs(B, H, seed=1)
    sets = [{"st": st.clone(), "cs": cs.clone(),
             "out": torch.empty(B, H * 128, dtype=torch.bfloat16, device="cuda")} for _ in range(8)]

    def call(d):
        if inplace:
            d["st"].mul_(0.999)
            return
        _decode(inp["qkv"], inp["f"], inp["b"], inp["gate"], p, d["st"], d["cs"], d["out"], tile_v=tv,
                pdl=pdl, **knobs)

    for d in sets:
        call(d)
    torch.cuda.synchronize()
    torch.cuda.profiler.start()
    for i in range(6):
        call(sets[i])
    torch.cuda.synchronize()
    torch.cuda.profiler.stop()
    print(f"ncu-launch {spec}: 6 calls")
    return 0


# ---- main ------------------------------------------------------------------------------------

def main_b64(mode: str = "b64") -> int:
    """--exp-b64: the B = 64 decode candidates alone (b64_experiment), with the copy bandwidth; writes
    $OUT/kda_cute_exp_b64.json. --exp-chunk: the verify chunk knob (chunk_experiment) first, then the same;
    writes $OUT/kda_cute_exp_chunk.json. --exp-lat: the latency knobs (lat_experiment) alone; writes
    $OUT/kda_cute_exp_lat.json."""
    if not torch.cuda.is_available():
        print("no CUDA GPU: nothing to check")
        return 0
    dev = torch.cuda.get_device_name()
    print(f"device: {dev}, torch {torch.__version__}")
    t0 = time.time()
    ex = {"decode": [], "verify": [], "timing_decode": [], "timing_verify": []}
    if mode == "chunk":
        chunk_experiment(ex)
        print(f"  [{time.time() - t0:.0f}s]")
    if mode == "lat":
        lat_experiment(ex)
    elif mode == "thr":
        thr_experiment(ex)
    else:
        b64_experiment(ex)
    bw = _safe(copy_bw)
    if isinstance(bw, float):
        print(f"\nD2D copy bandwidth here: {bw / 1e12:.3f} TB/s")
    ok = all(r.get("ok") for r in ex["decode"] + ex["verify"])
    report = {"device": dev, "torch": torch.__version__, "exp": ex, "copy_bw": bw, "all_ok": ok}
    print(f"  [{time.time() - t0:.0f}s]")
    print("\nALL CHECKS PASS" if ok else "\nSOME CHECKS FAILED")
    out_dir = os.environ.get("OUT")
    if out_dir:
        with open(os.path.join(out_dir, f"kda_cute_exp_{mode}.json"), "w") as fh:
            json.dump(report, fh, indent=1, default=str)
    return 0 if ok else 1


def _safe(fn, *a, **k):
    try:
        return fn(*a, **k)
    except Exception as e:  # noqa: BLE001  (report and keep going)
        traceback.print_exc()
        return {"ok": False, "error": f"{type(e).__name__}: {e}"[:500]}


def main(argv=None):
    argv = sys.argv[1:] if argv is None else argv
    if "--prefill" in argv:  # the chunked prefill only (main_prefill, below)
        return main_prefill(argv)
    for a in argv:
        if a.startswith("--ncu-launch="):
            return ncu_launch(a.split("=", 1)[1])
    for mode in ("b64", "chunk", "lat", "thr"):
        if f"--exp-{mode}" in argv:
            return main_b64(mode)
    quick = "--quick" in argv
    lean = "--lean" in argv  # fewer shapes: for a tight device budget
    tiny = "--tiny" in argv  # fewest shapes that still cover every tile width
    tiles = (128, 64, 32, 16)
    for a in argv:
        if a.startswith("--tiles="):
            tiles = tuple(int(x) for x in a.split("=", 1)[1].split(","))
    do_time = "--no-time" not in argv
    if "--cold" in argv:  # rotate 80 buffer sets: DRAM-cold at B = 1, as `k3lab bench kda` measures
        global N_CALLS
        N_CALLS = 80
    verify_only = "--verify-only" in argv  # skip the decode checks and timing
    if not torch.cuda.is_available():
        print("no CUDA GPU: nothing to check")
        return 0
    dev = torch.cuda.get_device_name()
    print(f"device: {dev}, torch {torch.__version__}")
    report = {"device": dev, "torch": torch.__version__, "decode": [], "verify": [], "timing_decode": [],
                  "timing_verify": []}
    t0 = time.time()
    Bs = [1, 2, 8, 64]
    Hs = [6, 12, 96]
    print("\n== decode correctness (fp64 oracle; out tol 1e-2, state tol 1e-4, conv exact) ==")
    print(f"{'B':>4} {'H':>3} {'tile':>4} {'steps':>5} {'out_err':>10} {'state_err':>10} {'conv':>6} "
          f"{'ok':>4}")
    shapes = [(B, H, 128) for H in Hs for B in Bs]
    shapes += [(B, H, tv) for tv in (64, 32, 16) for B, H in [(1, 12), (8, 6), (64, 12), (2, 96)]]
    if quick:
        shapes = [(1, 12, 128), (64, 12, 128), (1, 12, 32)]
    shapes = [x for x in shapes if x[2] in tiles]
    if lean:
        shapes = [x for x in shapes if x[0] in (1, 64) or x[2] != 128]
    if tiny:
        shapes = [(1, 12, 128), (64, 96, 128), (1, 12, 64), (8, 6, 64), (64, 12, 32), (2, 96, 32)]
    if verify_only:
        shapes = []
    for B, H, tv in shapes:
        r = _safe(check_decode, B, H, seed=B * 100 + H + tv, steps=2 if B <= 8 else 1, tile_v=tv)
        r.update(B=B, H=H, tile_v=tv)
        report["decode"].append(r)
        print(f"{B:>4} {H:>3} {tv:>4} {2 if B <= 8 else 1:>5} {r.get('out_err', float('nan')):>10.2e} "
              f"{r.get('state_err', float('nan')):>10.2e} {r.get('conv_exact')!s:>6} "
              f"{r['ok']!s:>4} {r.get('error', '')}")
    print(f"  [{time.time() - t0:.0f}s]")

    print("\n== verify correctness ==")
    print(f"{'B':>4} {'H':>3} {'T':>2} {'tile':>4} {'ragged':>6} {'lay':>6} {'out_err':>10} {'state_err':>10} "
          f"{'conv':>6} {'untouched':>9} {'in_same':>7} {'ok':>4}")
    vshapes = [(1, 12, 4, False, 128), (2, 6, 8, False, 128), (8, 12, 2, False, 128),
               (64, 12, 4, False, 128), (1, 96, 3, False, 128), (8, 12, 4, True, 128),
               (5, 6, 8, True, 128)]
    vshapes += [(B, H, T, rg, tv) for tv in (64, 32, 16)
                for B, H, T, rg in [(1, 12, 4, False), (2, 6, 8, False), (8, 12, 4, True)]]
    if quick:
        vshapes = vshapes[:1] + vshapes[-1:]
    vshapes = [x for x in vshapes if x[4] in tiles]
    if lean:
        vshapes = [x for x in vshapes if x[:3] in ((1, 12, 4), (5, 6, 8), (8, 12, 4), (2, 6, 8))]
    if tiny:
        vshapes = [(5, 6, 8, True, 128), (1, 12, 4, False, 64), (8, 12, 4, True, 64),
                   (2, 6, 8, False, 32), (8, 12, 4, True, 32)]
    few = ((1, 12, 4), (8, 12, 4), (5, 6, 8))
    vcases = [(x, "columns", None) for x in vshapes]
    vcases += [(x, "columns", wr) for x in vshapes if x[:3] in few for wr in _kv.ROW_WARPS_ALLOWED[x[4]]]
    vcases += [(x, "rows", None) for x in vshapes if x[:3] in few]
    for (B, H, T, rg, tv), lay, wr in vcases:
        r = _safe(check_verify, B, H, T, ragged=rg, seed=B + H + T + tv, tile_v=tv, layout=lay, row_warps=wr)
        r.update(B=B, H=H, T=T, ragged=rg, tile_v=tv, layout=lay, row_warps=wr)
        report["verify"].append(r)
        lt = lay[:4] + ("" if wr is None else f"/{wr}")
        print(f"{B:>4} {H:>3} {T:>2} {tv:>4} {rg!s:>6} {lt:>6} {r.get('out_err', float('nan')):>10.2e} "
              f"{r.get('state_err', float('nan')):>10.2e} {r.get('conv_exact')!s:>6} "
              f"{r.get('untouched')!s:>9} {r.get('inputs_unchanged')!s:>7} {r['ok']!s:>4} "
              f"{r.get('error', '')}")
    print(f"  [{time.time() - t0:.0f}s]")

    r = _safe(check_errors)
    report["errors"] = r
    print("\n== refusals ==", r)

    if "--exp" in argv:
        experiment(report)

    if do_time:
        bw = _safe(copy_bw)
        report["copy_bw"] = bw
        if isinstance(bw, float):
            print(f"\nD2D copy bandwidth here: {bw / 1e12:.3f} TB/s (spec: 4.275)")
        print("\n== decode timing (CUDA graph of 20 calls; rot = distinct buffers per call) ==")
        print(f"{'B':>4} {'H':>3} {'tile':>4} {'rot_us':>8} {'hot_us':>8} {'floor_us':>8} {'MB':>8} "
              f"{'TB/s':>6}")
        tshapes = [(1, 12), (8, 12), (64, 12), (256, 12), (1, 6), (64, 6), (1, 96), (64, 96)]
        if quick:
            tshapes = [(1, 12), (64, 12)]
        if lean:
            tshapes = [(1, 12), (8, 12), (64, 12), (1, 96), (64, 96)]
        if tiny:
            tshapes = [(1, 12), (64, 12)]
        if verify_only:
            tshapes = []
        for B, H in tshapes:
            for tv in tiles:
                r = _safe(time_decode, B, H, tile_v=tv)
                r.update(B=B, H=H, tile_v=tv)
                report["timing_decode"].append(r)
                if "rot_us" in r:
                    print(f"{B:>4} {H:>3} {tv:>4} {r['rot_us']:>8.2f} {r['hot_us']:>8.2f} "
                          f"{r['floor_us']:>8.2f} {r['bytes'] / 1e6:>8.2f} {r['tbps']:>6.3f}")
        print(f"  [{time.time() - t0:.0f}s]")
        print("\n== verify timing ==")
        print(f"{'B':>4} {'H':>3} {'T':>2} {'tile':>4} {'layout':>16} {'rot_us':>8} {'hot_us':>8} {'floor_us':>8} "
              f"{'TB/s':>6}")
        vt = [(1, 12, 4), (1, 12, 8), (8, 12, 4), (64, 12, 4), (1, 6, 4)]
        if quick:
            vt = [(1, 12, 4)]
        if lean:
            vt = [(1, 12, 4), (1, 12, 8), (64, 12, 4)]
        if tiny:
            vt = [(1, 12, 4), (1, 12, 8)]
        for B, H, T in vt:
            for tv in tiles:
                allowed = _kv.ROW_WARPS_ALLOWED[tv]
                variants = [("columns", wr) for wr in allowed] + [("rows", None)]
                if B == 1:
                    variants += [("columns-nohist", allowed[0]), ("columns-nohist", 8)]
                for lay, wr in variants:
                    r = _safe(time_verify, B, H, T, tile_v=tv, layout=lay, row_warps=wr)
                    r.update(B=B, H=H, T=T, tile_v=tv, layout=lay, row_warps=wr)
                    report["timing_verify"].append(r)
                    if "rot_us" in r:
                        lt = lay + ("" if wr is None else f"/{wr}")
                        print(f"{B:>4} {H:>3} {T:>2} {tv:>4} {lt:>16} {r['rot_us']:>8.2f} {r['hot_us']:>8.2f} "
                              f"{r['floor_us']:>8.2f} {r['tbps']:>6.3f}")
        print(f"  [{time.time() - t0:.0f}s]")

    ok = (all(r.get("ok") for r in report["decode"]) and all(r.get("ok") for r in report["verify"])
          and report["errors"].get("ok") and report.get("exp", {}).get("all_ok", True))
    report["all_ok"] = bool(ok)
    print("\nALL CHECKS PASS" if ok else "\nSOME CHECKS FAILED")
    out_dir = os.environ.get("OUT")
    if out_dir:
        tag = "_".join(str(t) for t in tiles)
        with open(os.path.join(out_dir, f"kda_cute_tiles{tag}.json"), "w") as fh:
            json.dump(report, fh, indent=1, default=str)
    return 0 if ok else 1


# ---- chunked prefill (--prefill; kernels/cute/kda_prefill.py) ---------------------------------------
# Oracles in float64 on the same inputs (make_kda_inputs with T = L, never zeros; out poisoned with NaN):
#   out relative error < OUT_TOL (1e-2: bf16 output), conv_state exactly equal;
#   inverse="fp32": state < STATE_TOL (1e-4) against the exact recurrence (the decode step L times);
#   inverse="bf16": state < STATE_TOL against kda_prefill_chunked in float64 with the same bf16 rounding of
#     A, i.e. the kernel does exactly what the switch means (fp32 maths against fp64 under the same
#     rounding: 0.2-5.6e-6 on CPU), and < PREFILL_BF16_LOSS_TOL (1e-3) against the exact recurrence: what
#     the switch itself loses is 0.7-2.9e-4 in float64 on CPU (L 63..1000, chunk 16/32/64, two seeds), so
#     1e-3 leaves a 3x margin while still catching an inverse that goes wrong;
#   state dtype bf16: PREFILL_BF16_STATE_TOL (2e-2, as the Triton tests: one bf16 rounding of the result).
PREFILL_BF16_LOSS_TOL = 1e-3
PREFILL_BF16_STATE_TOL = 2e-2
PREFILL_LS = (1, 5, 63, 64, 65, 200, 1000)
_PREFILL_BH = ((1, 2), (3, 12), (1, 12), (3, 2))
_PREFILL_ORACLE: dict = {}


def _prefill_mod():
    try:
        from k3lab_kernels.cute import kda_prefill as kp
    except ImportError:  # the checkout's `kernels/` folder
        from kernels.cute import kda_prefill as kp
    return kp


def prefill_cases(quick: bool = False) -> list:
    """Every chunk x inverse x grouped over every L of PREFILL_LS at tile_v 32, (B, H) rotating through
    (1,2) (3,12) (1,12) (3,2) so each switch combination meets both batches and both head counts; then
    the other value tiles (both forms) and a bf16 state. quick: two lengths per combination."""
    kp = _prefill_mod()
    cases, k = [], 0
    for ch in kp.PREFILL_CHUNKS:
        for inv in kp.PREFILL_INVERSES:
            for gr in (False, True):
                for L in PREFILL_LS:
                    B, H = _PREFILL_BH[k % len(_PREFILL_BH)]
                    k += 1
                    if quick and L not in ((65, 1000) if k % 2 else (5, 200)):
                        continue
                    cases.append(dict(B=B, H=H, L=L, chunk=ch, inverse=inv, grouped=gr, tile_v=32))
    for tv in (16, 64, 128):
        for gr in (False, True):
            cases.append(dict(B=3, H=12, L=200, chunk=64 if tv != 16 else 16, inverse="fp32", grouped=gr, tile_v=tv))
    for gr in (False, True):
        cases.append(dict(B=3, H=2, L=200, chunk=32, inverse="bf16", grouped=gr, tile_v=32, state_dtype="bf16"))
    return cases


def _prefill_oracle(inp, p, st, cs, key):
    """The exact recurrence in float64: the decode step L times, keeping only the running state
    (kda_prefill_sequential would keep every position's state). Cached by the inputs' key."""
    if key in _PREFILL_ORACLE:
        return _PREFILL_ORACLE[key]
    d = torch.float64
    p64 = p.to(dtype=d)
    S, c = st.to(d), cs.to(d)
    outs = []
    for t in range(inp["qkv"].shape[1]):
        o, S, c = ref.kda_decode(*(inp[n][:, t].to(d) for n in ("qkv", "f", "b", "gate")), p64, S, c, dtype=d,
                                 out_dtype=d)
        outs.append(o)
    if len(_PREFILL_ORACLE) >= 32:  # prefill_cases() cycles through 28 (B, H, L) inputs
        _PREFILL_ORACLE.clear()
    _PREFILL_ORACLE[key] = (torch.stack(outs, 1), S, c)
    return _PREFILL_ORACLE[key]


def check_prefill(B: int, H: int, L: int, chunk: int = 64, inverse: str = "fp32", grouped: bool = False,
                  tile_v: int = 32, state_dtype: str = "fp32", seed=None) -> dict:
    """One CuTe prefill call against the fp64 oracles (tolerances above). The inputs depend only on
    (B, H, L) unless `seed` is given, so the exact oracle is shared by every switch combination."""
    kp = _prefill_mod()
    seed = B * 100 + H * 10 + L if seed is None else seed
    sdt = {"fp32": torch.float32, "bf16": torch.bfloat16}[state_dtype]
    inp, p, st, cs = _inputs(B, H, T=L, seed=seed)
    st = st.to(sdt)
    out = torch.full((B, L, H * 128), float("nan"), dtype=torch.bfloat16, device=DEVICE)
    st_k, cs_k = st.clone(), cs.clone()
    kp.kda_prefill(inp["qkv"], inp["f"], inp["b"], inp["gate"], p, st_k, cs_k, out, chunk=chunk, inverse=inverse,
                   grouped=grouped, tile_v=tile_v)
    _sync()
    o_s, S_s, c_s = _prefill_oracle(inp, p, st, cs, (B, H, L, seed, state_dtype))
    res = {"out_finite": bool(torch.isfinite(out).all()), "conv_exact": bool(torch.equal(cs_k.double(), c_s)),
           "exact_out_err": _rel(out, o_s), "exact_state_err": _rel(st_k, S_s)}
    state_tol = STATE_TOL if sdt == torch.float32 else PREFILL_BF16_STATE_TOL
    exact_ok = True
    if inverse == "bf16":
        d = torch.float64
        o_c, S_c, _ = ref.kda_prefill_chunked(*(inp[n].to(d) for n in ("qkv", "f", "b", "gate")), p.to(dtype=d),
                                              st.to(d), cs.to(d), chunk=chunk, dtype=d,
                                              inverse_dtype=torch.bfloat16, grouped=grouped)
        res["out_err"], res["state_err"] = _rel(out, o_c), _rel(st_k, S_c)
        res["inverse_loss"] = _rel(S_c, S_s)  # what the switch itself loses, in float64
        exact_ok = res["exact_state_err"] < max(PREFILL_BF16_LOSS_TOL, state_tol)
    else:
        res["out_err"], res["state_err"] = res["exact_out_err"], res["exact_state_err"]
    res["ok"] = bool(res["out_finite"] and res["conv_exact"] and res["out_err"] < OUT_TOL
                     and res["state_err"] < state_tol and exact_ok)
    return res


def check_prefill_errors() -> dict:
    """The prefill wrapper refuses bad switches and tensors, naming the argument."""
    kp = _prefill_mod()
    inp, p, st, cs = _inputs(1, 2, T=5)
    out = torch.empty((1, 5, 2 * 128), dtype=torch.bfloat16, device="cuda")
    a = [inp["qkv"], inp["f"], inp["b"], inp["gate"], p, st, cs, out]

    def with_(i, t):
        b = list(a)
        b[i] = t
        return b

    cases = {  # name: (call, the word the message must contain)
        "chunk=48": (lambda: kp.kda_prefill(*a, chunk=48), "chunk"),
        "inverse=fp16": (lambda: kp.kda_prefill(*a, inverse="fp16"), "inverse"),
        "grouped=1": (lambda: kp.kda_prefill(*a, grouped=1), "grouped"),
        "tile_v=8": (lambda: kp.kda_prefill(*a, tile_v=8), "tile_v"),
        "fp32 qkv": (lambda: kp.kda_prefill(*with_(0, inp["qkv"].float())), "qkv"),
        "cpu gate": (lambda: kp.kda_prefill(*with_(3, inp["gate"].cpu())), "gate"),
        "noncontig state": (lambda: kp.kda_prefill(*with_(5, st.transpose(2, 3))), "state"),
        "fp16 state": (lambda: kp.kda_prefill(*with_(5, st.half())), "state"),
        "short out": (lambda: kp.kda_prefill(*with_(7, out[:, :4])), "out"),
    }
    res = {}
    for k, (fn, word) in cases.items():
        try:
            fn()
            res[k] = "NOT RAISED"
        except (ValueError, TypeError, NotImplementedError) as e:
            res[k] = type(e).__name__ if word in str(e) else f"UNNAMED: {e}"
    res["ok"] = all(v in ("ValueError", "TypeError", "NotImplementedError") for v in res.values())
    return res


def time_prefill(backend: str = "cute", B: int = 1, L: int = 4096, H: int = 12, chunk: int = 64,
                 inverse: str = "fp32", grouped: bool = False, tile_v: int = 32, n_calls: int = 3) -> dict:
    """Median per call over replays of a CUDA graph of n_calls prefills (one buffer set; the state and
    conv state advance call to call). backend: "cute" or "triton"."""
    inp, p, st, cs = _inputs(B, H, T=L, seed=3)
    out = torch.empty((B, L, H * 128), dtype=torch.bfloat16, device="cuda")
    if backend == "cute":
        fn = _prefill_mod().kda_prefill
    else:
        try:
            from k3lab_kernels.triton.kda_prefill import kda_prefill as fn
        except ImportError:
            from kernels.triton.kda_prefill import kda_prefill as fn

    def call():
        fn(inp["qkv"], inp["f"], inp["b"], inp["gate"], p, st, cs, out, chunk=chunk, inverse=inverse,
           grouped=grouped, tile_v=tile_v)

    us = _graph_us([call] * n_calls, iters=7)
    nbytes = _prefill_mod().kda_prefill_bytes(B, L, H)
    return {"us": us, "bytes": nbytes, "floor_us": nbytes / COPY_BW * 1e6, "tbps": nbytes / us * 1e-6}


def main_prefill(argv) -> int:
    """--prefill: the prefill checks, the refusals, and (unless --no-time) CuTe beside Triton at B=1,
    L=4096, H=12. Writes $OUT/kda_cute_prefill.json."""
    if not torch.cuda.is_available():
        print("no CUDA GPU: nothing to check")
        return 0
    dev = torch.cuda.get_device_name()
    print(f"device: {dev}, torch {torch.__version__}")
    report = {"device": dev, "torch": torch.__version__, "prefill": [], "timing_prefill": []}
    t0 = time.time()
    print(f"\n== prefill correctness (fp64 oracles; out < {OUT_TOL:g}, state < {STATE_TOL:g}, bf16 inverse also "
          f"< {PREFILL_BF16_LOSS_TOL:g} against the exact recurrence, conv exact) ==")
    print(f"{'B':>2} {'H':>3} {'L':>5} {'ch':>3} {'inv':>4} {'grp':>5} {'tile':>4} {'state':>5} {'out_err':>9} "
          f"{'state_err':>9} {'exact_st':>9} {'conv':>5} {'ok':>5}")
    for case in prefill_cases(quick="--quick" in argv):
        r = _safe(check_prefill, **case)
        r.update(case)
        report["prefill"].append(r)
        print(f"{case['B']:>2} {case['H']:>3} {case['L']:>5} {case['chunk']:>3} {case['inverse']:>4} "
              f"{case['grouped']!s:>5} {case['tile_v']:>4} {case.get('state_dtype', 'fp32'):>5} "
              f"{r.get('out_err', float('nan')):>9.2e} {r.get('state_err', float('nan')):>9.2e} "
              f"{r.get('exact_state_err', float('nan')):>9.2e} {r.get('conv_exact')!s:>5} {r['ok']!s:>5} "
              f"{r.get('error', '')}", flush=True)
    print(f"  [{time.time() - t0:.0f}s]")
    report["errors"] = _safe(check_prefill_errors)
    print("\n== prefill refusals ==", report["errors"])
    if "--no-time" not in argv:
        print("\n== prefill timing, B=1 L=4096 H=12 (CUDA graph of 3 calls, median of 7 replays) ==")
        print(f"{'backend':>7} {'grouped':>7} {'inverse':>7} {'us':>10} {'floor_us':>9} {'TB/s':>6}")
        for be, gr, inv in [("cute", False, "fp32"), ("triton", False, "fp32"), ("cute", True, "fp32"),
                            ("triton", True, "fp32"), ("cute", False, "bf16")]:
            r = _safe(time_prefill, be, grouped=gr, inverse=inv)
            r.update(backend=be, grouped=gr, inverse=inv, B=1, L=4096, H=12, chunk=64, tile_v=32)
            report["timing_prefill"].append(r)
            if "us" in r:
                print(f"{be:>7} {gr!s:>7} {inv:>7} {r['us']:>10.1f} {r['floor_us']:>9.1f} {r['tbps']:>6.3f}")
        print(f"  [{time.time() - t0:.0f}s]")
    ok = all(r.get("ok") for r in report["prefill"]) and report["errors"].get("ok")
    report["all_ok"] = bool(ok)
    print("\nALL PREFILL CHECKS PASS" if ok else "\nSOME PREFILL CHECKS FAILED")
    out_dir = os.environ.get("OUT")
    if out_dir:
        with open(os.path.join(out_dir, "kda_cute_prefill.json"), "w") as fh:
            json.dump(report, fh, indent=1, default=str)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
