"""MoE router selection in one Triton launch, after the router projection (whose fp32 logits it reads):

    s      = sigmoid(logits[b])                          [E] fp32 (E = 896 experts)
    sel    = top-k of (s + e_bias)                       the bias only chooses (k = 16)
    w      = s[sel] / sum(s[sel]) * scaling              the weights come from the unbiased scores
    idx[b] = sel (int64, descending biased score), weights[b] = w (fp32)

Tie rule (deterministic, also the fp64 reference's in k3lab.ops.trunk): experts are taken in descending
order of their fp32 biased score; among equal biased scores the LOWER expert id is taken first (each of
the k rounds takes the maximum, then the smallest id holding it). Scores that differ in fp64 but round
to the same fp32 value count as equal here.

Layout: logits [B, E] fp32 (unit stride along E), e_bias [E] fp32; idx [B, k] int64, weights [B, k] fp32,
both contiguous. Grid (B,): one program holds its row's E scores in registers (E padded to a power of
two), packs each into one int64 key (order-preserving score bits high, EP - 1 - id low), and takes the k
largest keys in k rounds of one max reduction each (a bitonic sort of the keys measured slower at every
warp count: docs/NOTES_trunk.md); the selected experts' scores are recomputed from their logits (a
16-entry gather) for the weights.

Floor (bytes, `k3lab.ops.trunk.router_bytes`): logits B*E*4 + e_bias E*4 + idx B*k*8 + weights B*k*4 at
the read bandwidth: 3.6 KB at batch 1, 0.24 MB at batch 64: launch-bound at every decode batch.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from k3lab_kernels.triton.mla_decode import _pow2, launch_kw, pdl_on


NEG = tl.constexpr(-9223372036854775807)  # a key below every expert's


@triton.jit
def _cs(x, y):
    """(max, min) of two int64 keys."""
    return tl.maximum(x, y), tl.minimum(x, y)


@triton.jit
def _merge4(a0, a1, a2, a3, b0, b1, b2, b3):
    """The best 4 of two descending 4-lists, descending: the elementwise max against the reversed other list
    is the top-4 set as a bitonic sequence, then a 4-element bitonic sort."""
    m0 = tl.maximum(a0, b3)
    m1 = tl.maximum(a1, b2)
    m2 = tl.maximum(a2, b1)
    m3 = tl.maximum(a3, b0)
    m0, m2 = _cs(m0, m2)
    m1, m3 = _cs(m1, m3)
    m0, m1 = _cs(m0, m1)
    m2, m3 = _cs(m2, m3)
    return m0, m1, m2, m3


@triton.jit
def _router_topk_kernel(logits, bias, idx, wts, E, s_l, scaling, TOPK: tl.constexpr, EP: tl.constexpr,
                        KP: tl.constexpr, METHOD: tl.constexpr, PDL: tl.constexpr):
    b = tl.program_id(0)
    e = tl.arange(0, EP)
    ok = e < E
    row = logits + b.to(tl.int64) * s_l
    eb = tl.load(bias + e, mask=ok, other=0.0).to(tl.float32)
    if PDL:  # launched with PDL: the bias is read before waiting on the projection that writes the logits
        tl.extra.cuda.gdc_launch_dependents()
        tl.extra.cuda.gdc_wait()
    z = tl.load(row + e, mask=ok, other=0.0).to(tl.float32)
    v = 1.0 / (1.0 + tl.exp(-z)) + eb + 0.0  # -0 -> +0
    # one int64 key per expert: the biased score's bits made order-preserving as a signed int in the high
    # word, EP - 1 - id in the low word, so one max gives the best score and, among equal scores, the lower id
    bits = v.to(tl.int32, bitcast=True)
    key = (bits ^ ((bits >> 31) & 0x7FFFFFFF)).to(tl.int64) * 4294967296 + (EP - 1 - e)
    key = tl.where(ok, key, NEG)
    kk = tl.arange(0, KP)
    if METHOD == 1:  # bitonic top-k (tl.topk): sorted descending, no dependent rounds
        sel = tl.topk(key, KP)
    elif METHOD == 2:  # the best 4 per round: one reduction of descending 4-lists, TOPK / 4 rounds
        sel = tl.zeros((KP,), dtype=tl.int64)
        neg = tl.full((EP,), NEG, tl.int64)
        for j in tl.static_range(0, TOPK, 4):
            t0, t1, t2, t3 = tl.reduce((key, neg, neg, neg), 0, _merge4)
            sel = tl.where(kk == j, t0, sel)
            sel = tl.where(kk == j + 1, t1, sel)
            sel = tl.where(kk == j + 2, t2, sel)
            sel = tl.where(kk == j + 3, t3, sel)
            key = tl.where(key >= t3, NEG, key)
    else:  # one maximum per round, TOPK dependent rounds
        sel = tl.zeros((KP,), dtype=tl.int64)
        for j in tl.static_range(TOPK):
            m = tl.max(key, 0)
            sel = tl.where(kk == j, m, sel)
            key = tl.where(key == m, NEG, key)
    km = kk < TOPK
    i = (EP - 1 - (sel & 4294967295)).to(tl.int32)
    i = tl.where(km, i, 0)
    s = 1.0 / (1.0 + tl.exp(-tl.load(row + i, mask=km, other=0.0).to(tl.float32)))
    s = tl.where(km, s, 0.0)
    w = s / tl.sum(s, 0) * scaling
    tl.store(idx + b.to(tl.int64) * TOPK + kk, i.to(tl.int64), mask=km)
    tl.store(wts + b.to(tl.int64) * TOPK + kk, w, mask=km)


METHODS = ("rounds", "topk", "quad")


def router_topk(logits: torch.Tensor, e_bias: torch.Tensor, idx: torch.Tensor, weights: torch.Tensor, *,
                top_k: int, scaling: float = 1.0, num_warps: int | None = None, method: str | None = None,
                pdl: bool = False):
    """logits [B, E] fp32, e_bias [E] fp32, idx [B, top_k] int64, weights [B, top_k] fp32 (written).
    method: "rounds" (top_k max reductions), "topk" (bitonic top-k), "quad" (4 per reduction); None =
    the default. Returns (idx, weights). The caller validates."""
    B, E = logits.shape
    m = METHODS.index(method or "rounds")
    KP = _pow2(top_k)
    if KP < 2 or (m == 2 and top_k % 4):
        m = 0  # topk needs k >= 2; quad takes k in fours
    _router_topk_kernel[(B,)](logits, e_bias, idx, weights, E, logits.stride(0), float(scaling), TOPK=top_k,
                              EP=max(_pow2(E), KP), KP=KP, METHOD=m, PDL=pdl_on(pdl), num_warps=num_warps or 4,
                              **launch_kw(pdl))
    return idx, weights
