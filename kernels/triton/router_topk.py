"""MoE router selection in one Triton launch, after the router projection (whose fp32 logits it reads):

    s      = sigmoid(logits[b])                          [E] fp32 (E = 896 experts)
    sel    = top-k of (s + e_bias)                       the bias only chooses (k = 16)
    w      = s[sel] / sum(s[sel]) * scaling              the weights come from the unbiased scores
    idx[b] = sel (int64, descending biased score), weights[b] = w (fp32)

Tie rule (deterministic, also the fp64 reference's in k3lab.ops.trunk): experts are taken in descending
order of their fp32 biased score; among equal biased scores the LOWER expert id is taken first (the
keys below are distinct and order by score, then by lower id). Scores that differ in fp64 but round
to the same fp32 value count as equal here.

Layout: logits [B, E] fp32 (unit stride along E), e_bias [E] fp32; idx [B, k] int64, weights [B, k] fp32,
both contiguous. Grid (B,): one program holds its row's E scores in registers (E padded to a power of
two), packs each into one int64 key (order-preserving score bits high, EP - 1 - id low), and takes the
k largest keys with a bitonic top-k (tl.topk: log2(k) sorting stages, then halving max-merges; 8 warps),
no dependent rounds (k rounds of one max each, and 4 per round, measured slower: docs/NOTES_trunk.md);
k = 1 is one max. The selected experts' scores are recomputed from their logits (a 16-entry gather) for
the weights.

Floor (bytes, `k3lab.ops.trunk.router_bytes`): logits B*E*4 + e_bias E*4 + idx B*k*8 + weights B*k*4 at
the read bandwidth: 3.6 KB at batch 1, 0.24 MB at batch 64: launch-bound at every decode batch.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from k3lab_kernels.triton.mla_decode import _pow2
from k3lab_kernels.triton.pdl import chain_pdl, launch_kw, pdl_on


NEG = tl.constexpr(-9223372036854775807)  # a key below every expert's


@triton.jit
def select_row(row, eb, e, ok, idx_out, wts_out, scaling, TOPK: tl.constexpr, EP: tl.constexpr, KP: tl.constexpr,
               TOPK_SORT: tl.constexpr):
    """One token: its E fp32 logits at `row` (read through L2: also right after other CTAs wrote them), the bias
    eb [EP] (0 past E), e = arange(EP), ok = e < E; writes idx_out[:TOPK] (int64) and wts_out[:TOPK] (fp32).
    Also the projection's fused selection (proj_gemv, `select`)."""
    z = tl.load(row + e, mask=ok, other=0.0, cache_modifier=".cg").to(tl.float32)
    v = 1.0 / (1.0 + tl.exp(-z)) + eb + 0.0  # -0 -> +0
    # one int64 key per expert: the biased score's bits made order-preserving as a signed int in the high
    # word, EP - 1 - id in the low word, so one max gives the best score and, among equal scores, the lower id
    bits = v.to(tl.int32, bitcast=True)
    key = (bits ^ ((bits >> 31) & 0x7FFFFFFF)).to(tl.int64) * 4294967296 + (EP - 1 - e)
    key = tl.where(ok, key, NEG)
    kk = tl.arange(0, KP)
    if TOPK_SORT:  # bitonic top-k (tl.topk): the KP best keys sorted descending, no dependent rounds
        sel = tl.topk(key, KP)
    else:  # k = 1: one maximum
        sel = tl.zeros((KP,), dtype=tl.int64)
        for j in tl.static_range(TOPK):
            m = tl.max(key, 0)
            sel = tl.where(kk == j, m, sel)
            key = tl.where(key == m, NEG, key)
    km = kk < TOPK
    i = (EP - 1 - (sel & 4294967295)).to(tl.int32)
    i = tl.where(km, i, 0)
    s = 1.0 / (1.0 + tl.exp(-tl.load(row + i, mask=km, other=0.0, cache_modifier=".cg").to(tl.float32)))
    s = tl.where(km, s, 0.0)
    w = s / tl.sum(s, 0) * scaling
    tl.store(idx_out + kk, i.to(tl.int64), mask=km)
    tl.store(wts_out + kk, w, mask=km)


@triton.jit
def _router_topk_kernel(logits, bias, idx, wts, E, s_l, scaling, TOPK: tl.constexpr, EP: tl.constexpr,
                        KP: tl.constexpr, TOPK_SORT: tl.constexpr, PDL: tl.constexpr):
    b = tl.program_id(0)
    e = tl.arange(0, EP)
    ok = e < E
    eb = tl.load(bias + e, mask=ok, other=0.0).to(tl.float32)
    if PDL:  # launched with PDL: the bias is read before waiting on the projection that writes the logits
        tl.extra.cuda.gdc_launch_dependents()
        tl.extra.cuda.gdc_wait()
    select_row(logits + b.to(tl.int64) * s_l, eb, e, ok, idx + b.to(tl.int64) * TOPK, wts + b.to(tl.int64) * TOPK,
               scaling, TOPK, EP, KP, TOPK_SORT)


def router_topk(logits: torch.Tensor, e_bias: torch.Tensor, idx: torch.Tensor, weights: torch.Tensor, *,
                top_k: int, scaling: float = 1.0, num_warps: int | None = None, pdl: bool | None = None):
    """logits [B, E] fp32, e_bias [E] fp32, idx [B, top_k] int64, weights [B, top_k] fp32 (written).
    pdl: launched with programmatic dependent launch (the bias read before waiting on the projection; None: the
    enclosing pdl.pdl_chain's setting).
    Returns (idx, weights). The caller validates."""
    pdl = chain_pdl(pdl)
    B, E = logits.shape
    KP = _pow2(top_k)
    _router_topk_kernel[(B,)](logits, e_bias, idx, weights, E, logits.stride(0), float(scaling), TOPK=top_k,
                              EP=max(_pow2(E), KP), KP=KP, TOPK_SORT=KP >= 2, PDL=pdl_on(pdl),
                              num_warps=num_warps or 8, **launch_kw(pdl))
    return idx, weights
