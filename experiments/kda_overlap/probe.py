"""A Triton stand-in for the CuTe KDA decode's state traffic (docs/NOTES_kda.md, sixty-fourth section): a program
a (sequence, head) updates its [128, 128] fp32 state in place as S = d S + k (v - (d S)^T k)^T. `whole`: every load,
the column sums, every store; `cN`: N column chunks, each chunk's stores behind its own sums; `copy`: no sums;
`torch`: state.mul_. Checked against fp64, then timed by the harness (graph replay, states rotated past L2).
Run: python experiments/kda_overlap/probe.py OUT_DIR   (a table; OUT_DIR/kda_overlap.json)
"""
import json
import sys

import torch
import triton
import triton.language as tl

from k3lab.harness import timing

D = 128
HEADS = 12


@triton.jit
def _chunk(sp, vv, rows, c0, BC: tl.constexpr):
    cols = c0 + tl.arange(0, BC)
    p = sp + rows[:, None] * 128 + cols[None, :]
    return p, tl.load(p), tl.load(vv + cols)


@triton.jit
def _upd(p, x, v, k, d):
    x = x * d[:, None]
    s = tl.sum(x * k[:, None], axis=0)
    tl.store(p, x + k[:, None] * (v - s)[None, :])


@triton.jit
def _state_kernel(S, K, V, Dd, MODE: tl.constexpr):
    h = tl.program_id(0)
    rows = tl.arange(0, 128)
    sp = S + h.to(tl.int64) * 16384
    k = tl.load(K + h * 128 + rows)
    d = tl.load(Dd + h * 128 + rows)
    vv = V + h * 128
    if MODE == 0:  # whole
        p, x, v = _chunk(sp, vv, rows, 0, 128)
        _upd(p, x, v, k, d)
    elif MODE == 2:  # two chunks
        p0, x0, v0 = _chunk(sp, vv, rows, 0, 64)
        p1, x1, v1 = _chunk(sp, vv, rows, 64, 64)
        _upd(p0, x0, v0, k, d)
        _upd(p1, x1, v1, k, d)
    elif MODE == 4:  # four chunks
        p0, x0, v0 = _chunk(sp, vv, rows, 0, 32)
        p1, x1, v1 = _chunk(sp, vv, rows, 32, 32)
        p2, x2, v2 = _chunk(sp, vv, rows, 64, 32)
        p3, x3, v3 = _chunk(sp, vv, rows, 96, 32)
        _upd(p0, x0, v0, k, d)
        _upd(p1, x1, v1, k, d)
        _upd(p2, x2, v2, k, d)
        _upd(p3, x3, v3, k, d)
    else:  # copy: the same traffic, no sums
        cols = tl.arange(0, 128)
        p = sp + rows[:, None] * 128 + cols[None, :]
        tl.store(p, tl.load(p) * 0.5)


MODES = {"whole": 0, "c2": 2, "c4": 4, "copy": 9}


def run(mode, warps, st, k, v, d):
    _state_kernel[(st.shape[0],)](st, k, v, d, MODE=MODES[mode], num_warps=warps)


def main():
    out = sys.argv[1]
    dev = torch.device("cuda")
    rows = []
    for batch in (8, 12, 16, 24, 32, 64):
        n = batch * HEADS

        def make(n=n):
            return (torch.randn(n, D, D, device=dev), torch.randn(n, D, device=dev) / 11.3,
                    torch.randn(n, D, device=dev), torch.rand(n, D, device=dev))
        st, k, v, d = make()
        x = st.double() * d.double()[:, :, None]
        s = torch.einsum("nij,ni->nj", x, k.double())
        want = x + k.double()[:, :, None] * (v.double() - s)[:, None, :]
        for mode in ("whole", "c2", "c4"):
            for warps in (4, 8):
                got = st.clone()
                run(mode, warps, got, k, v, d)
                err = ((got.double() - want).norm() / want.norm()).item()
                assert err < 1e-5, (mode, warps, err)
        nbytes = 2 * n * D * D * 4
        for mode in ("whole", "c2", "c4", "copy", "torch"):
            for warps in ((4, 8) if mode != "torch" else (0,)):
                fn = (lambda st, k, v, d: st.mul_(0.5)) if mode == "torch" else \
                    (lambda st, k, v, d, m=mode, w=warps: run(m, w, st, k, v, d))
                t = timing.bench_gpu(fn, make_inputs=make, reps=30, bytes_per_call=nbytes)
                rows.append(dict(batch=batch, mode=mode, warps=warps, median_us=t.median_us, p10_us=t.p10_us,
                                 p90_us=t.p90_us, sets=t.input_sets, samples=t.samples_us))
                print(f"b{batch:3d} {mode:6s} w{warps} {t.median_us:7.2f} us  ({nbytes / t.median_us / 1e6:.2f} TB/s)",
                      flush=True)
    env = dict(gpu=torch.cuda.get_device_name(), torch=torch.__version__, triton=triton.__version__,
               copy_tbps=timing.measure_copy_bandwidth())
    json.dump(dict(env=env, rows=rows), open(f"{out}/kda_overlap.json", "w"), indent=1)


if __name__ == "__main__":
    main()
