"""GPU check + timing for the CuTe DSL KDA kernels (kda_decode.py, kda_verify.py, kda_prefill.py).

    python kernels/cute/check_kda.py [--quick] [--lean] [--tiny] [--no-time] [--verify-only] [--cold]
                                     [--tiles=128,64,32,16]
    python kernels/cute/check_kda.py --prefill [--quick] [--no-time]   (kda_prefill.py only: main_prefill)
    python kernels/cute/check_kda.py --ncu-launch=B,H,tile[,pdl] | --ncu-launch=inplace,B,H   (ncu_launch)

Checks (the same functions tests/test_kda_cute*.py assert on): fresh random inputs from
`make_kda_inputs` (never zeros), outputs poisoned with NaN first, compared against the fp64
reference (`k3lab.ref.kda`, inputs/params/state upcast to float64):
    out relative-norm error < 1e-2, state relative-norm error < 1e-4, conv_state exactly equal;
verify additionally: state_hist/conv_hist per position, state/conv_state untouched, and on the
ragged path every entry at positions >= lengths[b] still poisoned.
Timing: CUDA graph of 20 calls captured back to back, replayed; median per call. `rot` uses a
different buffer set per captured call (up to ~1 GB of distinct state so L2 cannot hold it), `hot`
reuses one set. Achieved bandwidth = the kernel's floor bytes / rot time.
Prints a table; writes JSON to $OUT/kda_cute_tiles<tiles>.json when OUT is set. The measured alternatives
that earlier versions of this script timed (--exp, --exp-b64, --exp-chunk, --exp-lat, --exp-thr) are in
profiles/h200/kda_cute_exp*.json and git history (commit cd071d0).
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
    from k3lab_kernels.cute import kda_verify as _kv
    from k3lab_kernels.cute.kda_decode import kda_decode, kda_decode_bytes, kda_verify_bytes
except ImportError:  # the checkout's `kernels/` folder is the k3lab_kernels package
    if _ROOT not in sys.path:
        sys.path.insert(0, _ROOT)
    from kernels.cute import kda_verify as _kv
    from kernels.cute.kda_decode import kda_decode, kda_decode_bytes, kda_verify_bytes
kda_verify = _kv.kda_verify

OUT_TOL = 1e-2
STATE_TOL = 1e-4
COPY_BW = 4.275e12
# calls per timed graph; each call takes the next of up to N_CALLS buffer sets. 20 sets of a B=1 step
# (34 MB) stay in the 60 MB L2; --cold sets 80 (136 MB at B=1), so the state comes from DRAM as in a
# 69-layer model and as `k3lab bench kda` measures.
N_CALLS = 20
# where check_decode / check_verify / check_prefill put their tensors; tests/test_kda_cute_emulated.py sets
# "cpu" and swaps the kernel entry points for the CPU emulator's (tests/cute_emulate.py)
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


def check_decode(B: int, H: int, seed: int = 0, steps: int = 1, tile_v: int = 128, pdl: bool = False) -> dict:
    """Run `steps` decode steps with fresh inputs each step; compare each step with the fp64 oracle
    carried from the same start. Returns the worst errors."""
    _, p, st, cs = _inputs(B, H, seed=seed)
    st_k, cs_k = st.clone(), cs.clone()
    st_r, cs_r = st.double(), cs.double()
    worst = {"out_err": 0.0, "state_err": 0.0, "conv_exact": True, "out_finite": True}
    for s in range(steps):
        inp, _, _, _ = _inputs(B, H, seed=seed + 1000 * (s + 1))
        out = torch.full((B, H * 128), float("nan"), dtype=torch.bfloat16, device=DEVICE)
        kda_decode(inp["qkv"], inp["f"], inp["b"], inp["gate"], p, st_k, cs_k, out, tile_v=tile_v, pdl=pdl)
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


def check_verify(B: int, H: int, T: int, ragged: bool = False, seed: int = 0, tile_v: int = 128, row_warps=None,
                 pdl: bool = False) -> dict:
    """One verify call against the fp64 oracle."""
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
    kda_verify(inp["qkv"], inp["f"], inp["b"], inp["gate"], p, st, cs, out, sh, ch, lengths=lengths, tile_v=tile_v,
               row_warps=row_warps, pdl=pdl)
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


def time_decode(B, H, n_calls=None, tile_v=128, pdl=False):
    inp, p, st, cs = _inputs(B, H, seed=1)

    def make():
        return {"qkv": inp["qkv"], "f": inp["f"], "b": inp["b"], "gate": inp["gate"], "st": st.clone(),
                "cs": cs.clone(), "out": torch.empty(B, H * 128, dtype=torch.bfloat16, device="cuda")}

    n_calls = n_calls or N_CALLS
    nbytes = kda_decode_bytes(B, H)
    sets = _sets(make, nbytes, n_calls=n_calls)

    def call(d):
        return lambda: kda_decode(d["qkv"], d["f"], d["b"], d["gate"], p, d["st"], d["cs"], d["out"],
                                  tile_v=tile_v, pdl=pdl)

    # pdl: back-to-back calls on one set would break its precondition (read the state the previous call
    # is writing); the hot figure then alternates two sets
    return _rot_hot(call, sets, n_calls, nbytes, hot_sets=2 if pdl else 1)


def time_verify(B, H, T, n_calls=None, tile_v=128, row_warps=None, pdl=False):
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
        return lambda: kda_verify(d["qkv"], d["f"], d["b"], d["gate"], p, d["st"], d["cs"], d["out"],
                                  d["sh"], d["ch"], tile_v=tile_v, row_warps=row_warps, pdl=pdl)

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


def ncu_launch(spec: str) -> int:
    """--ncu-launch=B,H,tile[,pdl] or --ncu-launch=inplace,B,H (torch's in-place scale of the same state):
    build 8 rotated sets, run each once (compiles), then launch 6 more calls between cudaProfilerStart/Stop,
    so `ncu --profile-from-start off --launch-skip 4 --launch-count 1` profiles one call in the middle of a
    back-to-back run (the previous calls' dirty state still in L2, as in the timed graphs)."""
    parts = spec.split(",")
    inplace = parts[0] == "inplace"
    if inplace:
        parts = parts[1:]
    B, H = int(parts[0]), int(parts[1])
    tv = int(parts[2]) if len(parts) > 2 and not inplace else 128
    pdl = "pdl" in parts[3:]
    inp, p, st, cs = _inputs(B, H, seed=1)
    sets = [{"st": st.clone(), "cs": cs.clone(),
             "out": torch.empty(B, H * 128, dtype=torch.bfloat16, device="cuda")} for _ in range(8)]

    def call(d):
        if inplace:
            d["st"].mul_(0.999)
            return
        kda_decode(inp["qkv"], inp["f"], inp["b"], inp["gate"], p, d["st"], d["cs"], d["out"], tile_v=tv, pdl=pdl)

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
    print(f"{'B':>4} {'H':>3} {'T':>2} {'tile':>4} {'ragged':>6} {'rw':>4} {'out_err':>10} {'state_err':>10} "
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
    vcases = [(x, None) for x in vshapes]
    vcases += [(x, wr) for x in vshapes if x[:3] in few for wr in _kv.ROW_WARPS_ALLOWED[x[4]]]
    for (B, H, T, rg, tv), wr in vcases:
        r = _safe(check_verify, B, H, T, ragged=rg, seed=B + H + T + tv, tile_v=tv, row_warps=wr)
        r.update(B=B, H=H, T=T, ragged=rg, tile_v=tv, row_warps=wr)
        report["verify"].append(r)
        print(f"{B:>4} {H:>3} {T:>2} {tv:>4} {rg!s:>6} {wr or '-'!s:>4} {r.get('out_err', float('nan')):>10.2e} "
              f"{r.get('state_err', float('nan')):>10.2e} {r.get('conv_exact')!s:>6} "
              f"{r.get('untouched')!s:>9} {r.get('inputs_unchanged')!s:>7} {r['ok']!s:>4} "
              f"{r.get('error', '')}")
    print(f"  [{time.time() - t0:.0f}s]")

    r = _safe(check_errors)
    report["errors"] = r
    print("\n== refusals ==", r)

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
        print(f"{'B':>4} {'H':>3} {'T':>2} {'tile':>4} {'rw':>4} {'rot_us':>8} {'hot_us':>8} {'floor_us':>8} "
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
                for wr in _kv.ROW_WARPS_ALLOWED[tv]:
                    r = _safe(time_verify, B, H, T, tile_v=tv, row_warps=wr)
                    r.update(B=B, H=H, T=T, tile_v=tv, row_warps=wr)
                    report["timing_verify"].append(r)
                    if "rot_us" in r:
                        print(f"{B:>4} {H:>3} {T:>2} {tv:>4} {wr:>4} {r['rot_us']:>8.2f} {r['hot_us']:>8.2f} "
                              f"{r['floor_us']:>8.2f} {r['tbps']:>6.3f}")
        print(f"  [{time.time() - t0:.0f}s]")

    ok = (all(r.get("ok") for r in report["decode"]) and all(r.get("ok") for r in report["verify"])
          and report["errors"].get("ok"))
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
