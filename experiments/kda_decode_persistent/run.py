"""Check the persistent study kernel against the fp64 reference, then time it beside the production grid
decode (k3lab_kernels.cute.kda_decode). Needs nvidia-cutlass-dsl and a GPU of compute capability 9.0.

    python experiments/kda_decode_persistent/run.py [--no-time]

Checks: two decode steps from the same start as k3lab.ref.kda.kda_decode in float64, out poisoned with NaN
first; out relative error < 1e-2, state < 1e-4, conv_state exact. Timing: one CUDA graph of 80 calls, each
on the next of up to 80 buffer sets (at most 1 GiB of them, so the state comes from DRAM), median of 15
replays per call.
"""
import math
import os
import sys

import torch

from k3lab.ref import kda as ref  # (importing k3lab maps k3lab_kernels onto a checkout that is not installed)
from k3lab_kernels.cute.kda_decode import kda_decode, kda_decode_bytes

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from kda_decode_persistent import CONFIGS, kda_decode_persistent  # noqa: E402


def _rel(a, b):
    a, b = a.double(), b.double()
    return float((a - b).norm() / b.norm().clamp_min(1e-30)) if torch.isfinite(a).all() else float("nan")


def _call(d, p, cfg):
    if cfg is None:
        return lambda: kda_decode(d["qkv"], d["f"], d["b"], d["gate"], p, d["st"], d["cs"], d["out"])
    return lambda: kda_decode_persistent(d["qkv"], d["f"], d["b"], d["gate"], p, d["st"], d["cs"], d["out"],
                                         ctas=cfg[0], stages=cfg[1])


def check(B, H, cfg, seed=0, steps=2):
    _, p, st, cs = ref.make_kda_inputs(B, H, 128, seed=seed, device="cuda")
    d = {"st": st.clone(), "cs": cs.clone()}
    st_r, cs_r = st.double(), cs.double()
    out_err = state_err = 0.0
    conv_exact = True
    for s in range(steps):
        inp, _, _, _ = ref.make_kda_inputs(B, H, 128, seed=seed + 1000 * (s + 1), device="cuda")
        d.update(inp, out=torch.full((B, H * 128), float("nan"), dtype=torch.bfloat16, device="cuda"))
        _call(d, p, cfg)()
        torch.cuda.synchronize()
        f64 = torch.float64
        o_r, st_r, cs_r = ref.kda_decode(*(inp[n].to(f64) for n in ("qkv", "f", "b", "gate")), p.to(dtype=f64),
                                         st_r, cs_r, dtype=f64, out_dtype=f64)
        out_err = max(out_err, _rel(d["out"], o_r))
        state_err = max(state_err, _rel(d["st"], st_r))
        conv_exact &= bool(torch.equal(d["cs"].double(), cs_r))
    return out_err < 1e-2 and state_err < 1e-4 and conv_exact, out_err, state_err


def time_us(B, H, cfg, n_calls=80):
    inp, p, st, cs = ref.make_kda_inputs(B, H, 128, seed=1, device="cuda")
    n_sets = max(1, min(n_calls, math.ceil((1 << 30) / kda_decode_bytes(B, H))))
    sets = [dict(inp, st=st.clone(), cs=cs.clone(), out=torch.empty(B, H * 128, dtype=torch.bfloat16, device="cuda"))
            for _ in range(n_sets)]
    calls = [_call(sets[i % n_sets], p, cfg) for i in range(n_calls)]
    for c in calls:  # compile, warm up
        c()
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for c in calls:
            c()
    ts = []
    for _ in range(15):
        e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        e0.record()
        g.replay()
        e1.record()
        e1.synchronize()
        ts.append(e0.elapsed_time(e1) * 1e3 / n_calls)
    return sorted(ts)[len(ts) // 2]


def main(argv):
    if not torch.cuda.is_available():
        print("no CUDA GPU: nothing to run")
        return 0
    ok = True
    for B, H in ((1, 12), (5, 6), (64, 12), (3, 96)):
        for cfg in CONFIGS:
            good, oe, se = check(B, H, cfg, seed=B * 3 + H)
            ok &= good
            print(f"check B={B:>3} H={H:>3} (ctas, stages)={cfg}: out {oe:.2e} state {se:.2e} "
                  f"{'ok' if good else 'FAIL'}")
    if "--no-time" not in argv:
        for B in (16, 64, 256):
            row = [f"grid {time_us(B, 12, None):8.2f}"] + [f"{cfg} {time_us(B, 12, cfg):8.2f}" for cfg in CONFIGS]
            print(f"time B={B:>3} H=12 (us a call): " + "  ".join(row))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
