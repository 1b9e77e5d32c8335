"""AttnRes + RMSNorm in one Triton launch: the partial-sum update, the softmax mix over the block list
and the partial, and the RMSNorm of the mix (k3lab.ref.attnres, K3_SPEC section 2).

    p      = prefix                        update "none"   (the attention side: x is the partial)
           = bf16(prefix + a)              update "add"    (p = prefix + a; written to partial_out)
           = a                             update "fresh"  (the first layer of a block: p = a; written)
    score_i = dot(s_i, w_norm * w_proj) / sqrt(mean(s_i^2) + eps)   for s_i in blocks + [p]
    alpha   = softmax(score)                                          over the n + 1 sources
    mix     = sum_i alpha_i s_i                                       fp32, never stored
    out     = mix / sqrt(mean(mix^2) + eps) * norm_w                  out's dtype (bf16)

The updated partial is rounded once to bf16 (fp32 sum of two bf16 values, then round to nearest even:
the same bits as torch's bf16 add) and the mix reads that rounded value, as the layer reference does.

Layout: every source row [B, D] with unit stride along D (D = 7168; the block list as up to MAX_BLOCKS
separate tensors, each with its own row stride); w_norm, w_proj, norm_w [D]. Grid (B,): one program
per row holds the partial, w_norm * w_proj and the mix ([D] fp32 each) in registers; pass 1 streams the
blocks for their two sums (sum s^2, sum s * w), pass 2 reads them again (L2) for the mix.

Floor (bytes, `k3lab.ops.trunk.attnres_bytes`): sources (n + 1 + [a given]) * B * D * 2 + the three
weight vectors + out B*D*2 (+ partial_out B*D*2), at the read bandwidth: 9 blocks, "add", batch 1:
0.19 MB (launch-bound); batch 64: 10.1 MB = 2.2 us at 4.6 TB/s.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from k3lab_kernels.triton.mla_decode import _pow2, dot_f32, rne_bf16

MAX_BLOCKS = 9
UPDATES = ("none", "add", "fresh")


@triton.jit
def _src(ptr, s, b, d, dm):
    return tl.load(ptr + b.to(tl.int64) * s + d, mask=dm, other=0.0).to(tl.float32)


@triton.jit
def _score(x, wv, D, eps):
    return tl.sum(x * wv, 0) / tl.sqrt(tl.sum(x * x, 0) / D + eps)


@triton.jit
def _attnres_norm_kernel(b0, b1, b2, b3, b4, b5, b6, b7, b8, t0, t1, t2, t3, t4, t5, t6, t7, t8,
                         prefix, new, p_out, w_norm, w_proj, norm_w, out, s_p, s_a, s_po, s_o, D, eps,
                         NB: tl.constexpr, UPDATE: tl.constexpr, DP: tl.constexpr, RNE: tl.constexpr):
    b = tl.program_id(0)
    d = tl.arange(0, DP)
    dm = d < D
    wv = (tl.load(w_norm + d, mask=dm, other=0.0).to(tl.float32)
          * tl.load(w_proj + d, mask=dm, other=0.0).to(tl.float32))
    if UPDATE == 0:
        p = _src(prefix, s_p, b, d, dm)
    else:
        if UPDATE == 1:
            p = _src(prefix, s_p, b, d, dm) + _src(new, s_a, b, d, dm)
        else:
            p = _src(new, s_a, b, d, dm)
        if RNE:
            p = rne_bf16(p)
        pb = p.to(p_out.dtype.element_ty)
        tl.store(p_out + b.to(tl.int64) * s_po + d, pb, mask=dm)
        p = pb.to(tl.float32)
    jj = tl.arange(0, 16)
    sc = tl.where(jj == NB, _score(p, wv, D, eps), float("-inf"))
    if NB > 0:
        sc = tl.where(jj == 0, _score(_src(b0, t0, b, d, dm), wv, D, eps), sc)
    if NB > 1:
        sc = tl.where(jj == 1, _score(_src(b1, t1, b, d, dm), wv, D, eps), sc)
    if NB > 2:
        sc = tl.where(jj == 2, _score(_src(b2, t2, b, d, dm), wv, D, eps), sc)
    if NB > 3:
        sc = tl.where(jj == 3, _score(_src(b3, t3, b, d, dm), wv, D, eps), sc)
    if NB > 4:
        sc = tl.where(jj == 4, _score(_src(b4, t4, b, d, dm), wv, D, eps), sc)
    if NB > 5:
        sc = tl.where(jj == 5, _score(_src(b5, t5, b, d, dm), wv, D, eps), sc)
    if NB > 6:
        sc = tl.where(jj == 6, _score(_src(b6, t6, b, d, dm), wv, D, eps), sc)
    if NB > 7:
        sc = tl.where(jj == 7, _score(_src(b7, t7, b, d, dm), wv, D, eps), sc)
    if NB > 8:
        sc = tl.where(jj == 8, _score(_src(b8, t8, b, d, dm), wv, D, eps), sc)
    ex = tl.exp(sc - tl.max(sc, 0))
    alpha = ex / tl.sum(ex, 0)
    mix = tl.sum(tl.where(jj == NB, alpha, 0.0), 0) * p
    if NB > 0:
        mix += tl.sum(tl.where(jj == 0, alpha, 0.0), 0) * _src(b0, t0, b, d, dm)
    if NB > 1:
        mix += tl.sum(tl.where(jj == 1, alpha, 0.0), 0) * _src(b1, t1, b, d, dm)
    if NB > 2:
        mix += tl.sum(tl.where(jj == 2, alpha, 0.0), 0) * _src(b2, t2, b, d, dm)
    if NB > 3:
        mix += tl.sum(tl.where(jj == 3, alpha, 0.0), 0) * _src(b3, t3, b, d, dm)
    if NB > 4:
        mix += tl.sum(tl.where(jj == 4, alpha, 0.0), 0) * _src(b4, t4, b, d, dm)
    if NB > 5:
        mix += tl.sum(tl.where(jj == 5, alpha, 0.0), 0) * _src(b5, t5, b, d, dm)
    if NB > 6:
        mix += tl.sum(tl.where(jj == 6, alpha, 0.0), 0) * _src(b6, t6, b, d, dm)
    if NB > 7:
        mix += tl.sum(tl.where(jj == 7, alpha, 0.0), 0) * _src(b7, t7, b, d, dm)
    if NB > 8:
        mix += tl.sum(tl.where(jj == 8, alpha, 0.0), 0) * _src(b8, t8, b, d, dm)
    y = mix / tl.sqrt(tl.sum(mix * mix, 0) / D + eps) * tl.load(norm_w + d, mask=dm, other=0.0).to(tl.float32)
    if RNE:
        y = rne_bf16(y)
    tl.store(out + b.to(tl.int64) * s_o + d, y.to(out.dtype.element_ty), mask=dm)


def attnres_norm(blocks: list[torch.Tensor], prefix: torch.Tensor, new: torch.Tensor | None, w_norm: torch.Tensor,
                 w_proj: torch.Tensor, norm_w: torch.Tensor, out: torch.Tensor, partial_out: torch.Tensor | None,
                 *, update: str = "none", eps: float = 1e-6, num_warps: int | None = None) -> torch.Tensor:
    """blocks: 0..MAX_BLOCKS tensors [B, D]; prefix [B, D] (the partial before the update; unused for
    update "fresh"); new [B, D] (the attention/MLP output; None for "none"); partial_out [B, D] written
    for "add"/"fresh" (may be prefix itself); out [B, D] written. Returns out. The caller validates."""
    B, D = out.shape
    src = list(blocks) + [out] * (MAX_BLOCKS - len(blocks))
    u = UPDATES.index(update)
    a = new if new is not None else out
    po = partial_out if partial_out is not None else out
    _attnres_norm_kernel[(B,)](*src, *[t.stride(0) for t in src], prefix, a, po, w_norm, w_proj, norm_w, out,
                               prefix.stride(0), a.stride(0), po.stride(0), out.stride(0), D, float(eps),
                               NB=len(blocks), UPDATE=u, DP=_pow2(D), RNE=dot_f32(),
                               num_warps=num_warps or 8)
    return out
