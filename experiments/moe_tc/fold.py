"""The MXFP4 tensor-core experts with the block factors folded into the weights (issue 14; nineteenth session,
written after the device time was spent: checked under the interpreter, compiled for sm_90 offline, NOT timed).

The production `tc` path (kernels/triton/moe_experts.py) runs one K = 32 tensor-core dot a 32-block and multiplies
each block's fp32 result by its factor 2^(s - 119): every dot's result is needed at once, so the tensor-core work
of a program is a chain of short dots. This form widens the decoded e2m1 * 2^-14 (f16, exact) to fp32, multiplies
by 2^(s - 113) and rounds to bf16 (exact for s in 2..240, the grouped path's rule), so that a chunk of NBK blocks
is one dot with no factor after it; the activations are rounded to bf16 as on the grouped path.
sm_90 offline (Triton 3.6, compiled through `k3lab.harness.triton_compile.compile_only`): `VARIANTS` below.

    python experiments/moe_tc/fold.py $OUT   # H200: checks vs fp64, times beside path tc -> $OUT/moe_tc_fold.json
    (export PYTHONPATH=$PWD first)
"""
import json
import sys

import torch
import triton
import triton.language as tl

import k3lab  # noqa: F401 - maps kernels/ to k3lab_kernels in a checkout that is not installed
from k3lab_kernels.triton.mla_decode import dot_f32
from k3lab_kernels.triton.moe_experts import (_group, _kl_ptrs, _mm, _pow2, _round_act, _simt_decode, _situ,
                                              _slots, _tc_perm, default_blocks)


@triton.jit
def _tc_chunk(wp, sp, rows, c0, RW: tl.constexpr, NBR: tl.constexpr, R: tl.constexpr, NBK: tl.constexpr,
              INTERP: tl.constexpr):
    """NBK 32-blocks from block c0 of rows `rows` (RW words, NBR scale bytes a row) -> [R, 32 NBK] bf16 of the
    weights, exact (e2m1 * 2^-14 in f16, widened, times 2^(s - 113), to bf16: the grouped path's exactness), in the
    decoded order: tile column f is input 32 (f // 32) + _tc_perm(f % 32) of the chunk."""
    w = tl.load(wp + rows[:, None] * RW + c0 * 4 + tl.arange(0, 4 * NBK)[None, :])
    d0, d1, d2, d3 = _simt_decode(w, INTERP)
    d = tl.join(tl.join(d0, d1), tl.join(d2, d3))  # [R, 4 NBK (word), 2 (a), 2 (b)]
    lo = (d & 0xFFFF).to(tl.int16).to(tl.float16, bitcast=True)
    hi = (d >> 16).to(tl.int16).to(tl.float16, bitcast=True)
    v = tl.join(lo, hi).to(tl.float32).reshape(R, NBK, 32)
    sc = tl.load(sp + rows[:, None] * NBR + c0 + tl.arange(0, NBK)[None, :]).to(tl.int32)
    fac = ((sc + 14) << 23).to(tl.float32, bitcast=True)  # 2^(s - 113)
    return (v * fac[:, :, None]).reshape(R, 32 * NBK).to(tl.bfloat16)


@triton.jit
def _moe_tc2_kernel(z, idx, wk, w1, w3, w2, s1, s3, s2, y, B,
                    L: tl.constexpr, I: tl.constexpr, K: tl.constexpr, KP: tl.constexpr, BB: tl.constexpr,
                    BN: tl.constexpr, BL: tl.constexpr, BT: tl.constexpr, B1: tl.constexpr, B2: tl.constexpr,
                    NBK: tl.constexpr, INTERP: tl.constexpr):
    """The tc program with the block factors folded into bf16 weights: one dot a chunk of NBK blocks."""
    n = tl.program_id(0)
    p = tl.program_id(1)
    e, leader, mem, w_tok, q_tok, cnt, rank = _group(idx, wk, p, B, K, KP, BB)
    if leader:
        f = tl.arange(0, BN)
        rows = n * BN + (f // 32) * 32 + _tc_perm(f % 32)
        fk = tl.arange(0, 32 * NBK)
        kq = (fk // 32) * 32 + _tc_perm(fk % 32)
        w1e, w3e, w2e, s1e, s3e, s2e = _kl_ptrs(w1, w3, w2, s1, s3, s2, e, L, I)
        for t0 in range(0, cnt, BT):
            tok, w_t, q, ok = _slots(t0, mem, rank, w_tok, q_tok, BB, BT)
            g = tl.zeros([BN, BT], tl.float32)
            u = tl.zeros([BN, BT], tl.float32)
            for c0 in range(0, L // 32, NBK):
                zt = tl.load(z + tok[None, :] * L + c0 * 32 + kq[:, None], mask=ok[None, :], other=0.0)
                g = _mm(_tc_chunk(w1e, s1e, rows, c0, L // 8, L // 32, BN, NBK, INTERP), zt, g, INTERP)
                u = _mm(_tc_chunk(w3e, s3e, rows, c0, L // 8, L // 32, BN, NBK, INTERP), zt, u, INTERP)
            act = _round_act(_situ(g, u, B1, B2), INTERP)  # [BN, BT]: tile row f is intermediate rows[f]
            for l0 in range(0, L, BL):  # y[tok] += w_t * W2[:, rows] act
                lr = l0 + tl.arange(0, BL)
                o = tl.zeros([BL, BT], tl.float32)
                o = _mm(_tc_chunk(w2e, s2e, lr, n * (BN // 32), I // 8, I // 32, BL, BN // 32, INTERP), act, o,
                        INTERP)
                o = o * w_t[None, :]
                tl.atomic_add(y + tok[None, :] * L + lr[:, None], o, mask=ok[None, :], sem="relaxed")


def fold_experts(z, idx, wk, w1, w3, w2, s1, s3, s2, y, *, b1=4.0, b2=25.0, block_k=128, num_warps=4, num_stages=3):
    """y [B, L] fp32: the routed experts on the kernel-layout words (k3lab.components.moe.kernel_layout)."""
    B, K = idx.shape
    L, I = z.shape[1], w1.shape[1]
    d = default_blocks(B, K, I, L, "mxfp4", "tc")
    y.zero_()
    _moe_tc2_kernel[(I // 64, B * K)](z, idx, wk, w1, w3, w2, s1, s3, s2, y, B, L=L, I=I, K=K, KP=_pow2(K),
                                      BB=max(16, _pow2(B)), BN=64, BL=d["block_l"], BT=16, B1=float(b1),
                                      B2=float(b2), NBK=block_k // 32, INTERP=dot_f32(), num_warps=num_warps,
                                      num_stages=num_stages)
    return y


# (block_k, num_warps) without spills on sm_90 (Triton 3.6 offline: 254 / 210 / 213 registers, no stack; block_k
# 128 at 4 warps: 255 and 64 bytes of stack, 256 at 8 warps: 160 bytes)
VARIANTS = ((64, 4), (128, 8), (32, 4))


def main(out: str, reps: int = 10):
    """K3's TP8 pool, uniform routing, 64 and 256 tokens: each block_k checked against fp64 (the shared checker),
    then timed (graph replay, inputs rotated past L2) beside path tc of the same run."""
    from k3lab import registry
    from k3lab.components import moe as c_moe
    from k3lab.harness import checker, timing

    op = registry.get("moe_experts")
    pr = timing.probes("cuda")
    rows = []
    for batch in (64, 256):
        case = op.case(dtype="mxfp4", batch=batch, routing="uniform", tp=8, latent=3584, inter=3072, n_experts=896,
                       top_k=16)
        nbytes = op.nbytes(case)
        sets = [op.make_inputs(case, 100 + i, "cuda") for i in range(max(2, timing.rotation_count(nbytes,
                                                                                                  timing.l2_bytes())))]

        def fold(d, bk, nw):
            m = d["moe"]
            ws = [c_moe.kernel_layout(w) for w in (m.w1, m.w3, m.w2)]
            return fold_experts(d["z"], d["idx"], d["weights_k"], *ws, m.w1.scale, m.w3.scale, m.w2.scale, d["y"],
                                b1=float(m.b1), b2=float(m.b2), block_k=bk, num_warps=nw)
        for name, fn in [("tc", lambda d, c=case: op.call(d, c, "triton", dict(path="tc"), None))] + \
                [(f"fold bk{bk} w{nw}", lambda d, bk=bk, nw=nw: fold(d, bk, nw)) for bk, nw in VARIANTS]:
            chk = checker.check(op, case, impl=fn, inputs=sets[0])
            t = timing.bench_gpu(fn, input_sets=[(s,) for s in sets], reps=reps)
            rows.append(dict(batch=batch, variant=name, median_us=t.median_us, samples=t.samples_us, ok=chk.ok,
                             floor_us=nbytes / (pr["read_tbps"] * 1e12) * 1e6))
            print(batch, name, round(t.median_us, 1), chk.ok, flush=True)
        del sets
        torch.cuda.empty_cache()
    json.dump(dict(probes=pr, rows=rows, env=dict(torch=torch.__version__, gpu=torch.cuda.get_device_name())),
              open(f"{out}/moe_tc_fold.json", "w"), indent=1)


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "/tmp")
