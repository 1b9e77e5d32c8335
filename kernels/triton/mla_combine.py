"""Gated-MLA combine in one Triton launch: the log-sum-exp merge of the attention partials (split-KV
pieces and/or DCP shards), the value up-projection and the sigmoid output gate.

    o[b,t,h]        = sum_k exp(lse[b,k,t,h] - lse) o_part[b,k,t,h],  lse = log sum_k exp(lse[b,k,t,h])
    out[b,t,h*Dv+v] = (o[b,t,h] @ Wuv[h])[v] * sigmoid(gate[b,t,h*Dv+v])          (bf16 [B,T,H*Dv])
what the output projection Wo reads (k3lab.ref.mla.mla_combine; Wo itself is the trunk's GEMM).

Inputs: o_part [B,K,T,H,C] fp32 (normalized partials) and lse_part [B,K,T,H] fp32 from
k3lab_kernels.triton.mla_decode (merge=False), or K = 1 (an already merged o_lat; lse unused);
Wuv [H, C, Dv] bf16 (C = 512, Dv = 128); gate logits [B,T,H*Dv] bf16; out [B,T,H*Dv] bf16.

Two paths, one launch either way:
  * rows (B*T > 8; 3..8 with one merged partial): grid (H, Dv / BV, ceil(B*T / BR)). A program owns one head, BV output
    columns and BR >= 16 rows (b, t) (default 16: at batch 64 four row blocks; 64-row blocks left 24 programs for the
    whole GPU). It reads its Wuv[h][:, v-block] slice once for its rows, merges its rows' partials one k at a time ([BR,
    C] tiles, fp32; empty partials (lse = -inf) weigh 0), rounds o to bf16 and multiplies on tensor cores (tl.dot [BR,
    C] x [C, BV], fp32 accumulation; padded rows masked), then applies sigmoid(gate) in fp32 and stores bf16.
  * one row (B*T <= 2, e.g. batch 1; up to 8 over K > 1 partials): grid (H, Dv / BV, B*T). Above PREMERGE_ABOVE partials
    the split's merge kernel merges them first (a second launch, all column blocks in parallel; `premerge`: True on
    either path whenever K > 1, False never; the rows path merges itself by default). A program merges one row's
    partials KB = 16 at a time ([KB, C] tiles: K / 16 steps, many loads in flight), rounds o to bf16 and forms o @
    Wuv[h] slice with fp32 FMAs (512 x BV; a 16-row tensor-core tile would be 15/16 padding).
The merge is repeated by the Dv / BV column programs of a head (from L2): BV trades Wuv-read parallelism
against that repeat (default 32 at small B*T: 48 programs at 12 heads).

Floor (bytes, per call): Wuv H*C*Dv*2 (12 heads: 1.57 MB: 0.34 us at 4.6 TB/s; the batch-1 floor is
launch-bound) + partials B*K*T*H*(C+1)*4 + gate and out B*T*H*Dv*2 each. At batch 1, 12 heads, K = 64:
1.57 MB + 1.58 MB.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from k3lab_kernels.triton.mla_decode import _mask2, _pow2, dot_f32, rne_bf16
from k3lab_kernels.triton.pdl import launch_kw, pdl_on

BLOCK_V_ALLOWED = (16, 32, 64, 128)
BLOCK_R_ALLOWED = (1, 16, 32, 64)
ROW_PATH_MAX_ROWS = 2  # B*T up to this: the one-row kernel (batch 1 decode, batch 1 T=2 / batch 2)
# and up to this over K > 1 partials: at 4 and 8 rows it beat the rows kernel with premerge at every partial count and
# lost at 16; over one merged partial (the decode step's call) the rows kernel leads from 4 rows (H100:
# profiles/h100-80gb-hbm3/mla_combine_rowk57.json.gz and mla_combine_k1_57.json.gz (git history at 7e3e20a);
# docs/NOTES_mla.md, fifty-seventh session)
ROW_PATH_MAX_ROWS_PARTIALS = 8
# the one-row kernel merges K partials serially (K / 16 dependent steps, repeated by each column program): above
# this many it lets the split's merge kernel (k3lab_kernels.triton.mla_decode.merge_partials) merge them first,
# then combines one (the measurement: docs/NOTES_mla.md)
PREMERGE_ABOVE = 8


@triton.jit
def _mla_combine_kernel(o_part, lse_part, w_uv, gate, out, K, T, H, NR,
                        C: tl.constexpr, CP: tl.constexpr, DV: tl.constexpr, BV: tl.constexpr,
                        BR: tl.constexpr, DOT_F32: tl.constexpr, PDL: tl.constexpr):
    """Rows path: BR >= 16 rows (b, t) of one head a program; the partials merged one k at a time as
    [BR, C] tiles in one pass (a running max per row rescales what is summed so far; elementwise only, no
    reductions); o @ Wuv[h][:, v-block] on tensor cores. Wuv and the gate do not depend on the split: they
    are loaded before the PDL wait."""
    h = tl.program_id(0)
    vb = tl.program_id(1)
    rb = tl.program_id(2)
    rows = rb * BR + tl.arange(0, BR)  # (b, t) = divmod(row, T)
    rok = rows < NR
    b = rows // T
    t = rows % T
    TH = T * H
    base = b.to(tl.int64) * K * TH + t * H + h  # partial k of (b, t, h) at base + k * TH
    cc = tl.arange(0, CP)
    cm = cc < C
    vv = vb * BV + tl.arange(0, BV)
    wv = tl.load(w_uv + h * C * DV + cc[:, None] * DV + vv[None, :], mask=cm[:, None], other=0.0)
    col = rows.to(tl.int64)[:, None] * (H * DV) + h * DV + vv[None, :]
    g = tl.load(gate + col, mask=rok[:, None], other=0.0).to(tl.float32)
    if PDL:  # launched with PDL: the partials are complete and visible after this
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()  # a PDL successor may launch now
    if K == 1:
        o = tl.load(o_part + base[:, None] * C + cc[None, :], mask=_mask2(rok, cm, CP == C), other=0.0)
    else:
        m = tl.full([BR], float("-inf"), tl.float32)
        den = tl.zeros([BR], tl.float32)
        o = tl.zeros([BR, CP], tl.float32)
        for k in range(0, K):
            lk = tl.load(lse_part + base + k * TH, mask=rok, other=float("-inf"))
            ok = tl.load(o_part + (base + k * TH)[:, None] * C + cc[None, :], mask=_mask2(rok, cm, CP == C),
                         other=0.0)
            m_new = tl.maximum(m, lk)
            m_use = tl.where(m_new == float("-inf"), 0.0, m_new)
            alpha = tl.exp(m - m_use)  # 0 while nothing is summed (m = -inf)
            w = tl.exp(lk - m_use)
            den = den * alpha + w
            o = o * alpha[:, None] + w[:, None] * ok
            m = m_new
        o = o / tl.where(den > 0.0, den, 1.0)[:, None]
    if DOT_F32:  # the interpreter (see mla_decode.dot_f32): the same bf16 values, multiplied in fp32
        y = tl.dot(rne_bf16(o), wv.to(tl.float32))
    else:
        y = tl.dot(o.to(tl.bfloat16), wv.to(tl.bfloat16))
    y = y / (1.0 + tl.exp(-g))
    if DOT_F32:
        y = rne_bf16(y)
    tl.store(out + col, y.to(out.dtype.element_ty), mask=rok[:, None])


@triton.jit
def _mla_combine_row_kernel(o_part, lse_part, w_uv, gate, out, K, T, H,
                            C: tl.constexpr, CP: tl.constexpr, DV: tl.constexpr, BV: tl.constexpr,
                            KB: tl.constexpr, RNE: tl.constexpr, PDL: tl.constexpr):
    """One-row path (small B*T, e.g. batch 1): one row (b, t) of one head and BV columns a program; the
    partials merged KB at a time as [KB, C] tiles in one pass (K / KB steps, a running max), o rounded to
    bf16 like the tensor-core path, then o @ Wuv[h][:, v-block] as fp32 FMAs (512 x BV: no 16-row tile to
    fill). Wuv and the gate are loaded before the PDL wait."""
    h = tl.program_id(0)
    vb = tl.program_id(1)
    row = tl.program_id(2)
    b = row // T
    t = row % T
    TH = T * H
    base = b.to(tl.int64) * K * TH + t * H + h
    cc = tl.arange(0, CP)
    cm = cc < C
    vv = vb * BV + tl.arange(0, BV)
    wv = tl.load(w_uv + h * C * DV + cc[:, None] * DV + vv[None, :], mask=cm[:, None], other=0.0).to(tl.float32)
    col = row.to(tl.int64) * (H * DV) + h * DV + vv
    g = tl.load(gate + col).to(tl.float32)
    if PDL:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()  # a PDL successor may launch now
    if K == 1:  # an already merged o_lat (no lse)
        o = tl.load(o_part + base * C + cc, mask=cm, other=0.0)
    else:
        kk = tl.arange(0, KB)
        m = tl.max(tl.full([KB], float("-inf"), tl.float32), 0)
        den = tl.sum(tl.zeros([KB], tl.float32), 0)
        o = tl.zeros([CP], tl.float32)
        for k0 in range(0, K, KB):
            km = k0 + kk < K
            lk = tl.load(lse_part + base + (k0 + kk) * TH, mask=km, other=float("-inf"))
            ok = tl.load(o_part + (base + (k0 + kk) * TH)[:, None] * C + cc[None, :],
                         mask=_mask2(km, cm, CP == C), other=0.0)
            m_new = tl.maximum(m, tl.max(lk, 0))
            m_use = tl.where(m_new == float("-inf"), 0.0, m_new)
            alpha = tl.exp(m - m_use)
            w = tl.exp(lk - m_use)
            den = den * alpha + tl.sum(w, 0)
            o = o * alpha + tl.sum(w[:, None] * ok, 0)
            m = m_new
        o = o / tl.where(den > 0.0, den, 1.0)
    if RNE:
        o = rne_bf16(o)
    else:
        o = o.to(tl.bfloat16).to(tl.float32)
    y = tl.sum(o[:, None] * wv, 0)
    y = y / (1.0 + tl.exp(-g))
    if RNE:
        y = rne_bf16(y)
    tl.store(out + col, y.to(out.dtype.element_ty))


def default_block_v(B: int, T: int, Dv: int) -> int:
    """More column programs at small batch (Wuv read by more SMs); fewer repeats of the merge at large."""
    return min(Dv, 32 if B * T <= 16 else 64)


def mla_combine(o_part: torch.Tensor, lse_part: torch.Tensor | None, w_uv: torch.Tensor, gate: torch.Tensor,
                out: torch.Tensor | None = None, *, block_v: int | None = None, block_r: int | None = None,
                num_warps: int | None = None, pdl: bool = False, premerge: bool | None = None) -> torch.Tensor:
    """o_part [B,K,T,H,C] fp32 contiguous (or a merged o_lat [B,T,H,C], K = 1), lse_part [B,K,T,H] fp32
    (None when K = 1), w_uv [H,C,Dv] bf16 contiguous, gate [B,T,H*Dv] contiguous; writes out [B,T,H*Dv]
    (bf16; allocated when None) and returns it. pdl=True launches it with PDL (it waits on its predecessor,
    the split, after loading Wuv and the gate). premerge: the partials merged by the split's merge kernel first
    (k3lab_kernels.triton.mla_decode.merge_partials, every column block and row in parallel), then combined as
    one (None: the one-row path above PREMERGE_ABOVE partials, the rows path never; True: whenever K > 1; False:
    never). The caller validates."""
    if o_part.dim() == 4:
        o_part = o_part.unsqueeze(1)
    B, K, T, H, C = o_part.shape
    Dv = w_uv.shape[2]
    assert o_part.is_contiguous() and w_uv.is_contiguous() and gate.is_contiguous()
    assert K == 1 or (lse_part is not None and lse_part.is_contiguous())
    if out is None:
        out = torch.empty(B, T, H * Dv, dtype=torch.bfloat16, device=o_part.device)
    BV = block_v or (Dv if dot_f32() else default_block_v(B, T, Dv))  # the interpreter's cost is per program
    NR = B * T
    one_row = NR <= ROW_PATH_MAX_ROWS or (K > 1 and NR <= ROW_PATH_MAX_ROWS_PARTIALS)
    BR = block_r or (1 if one_row else 16)  # 16 rows: 4x the programs of 64 at batch 64
    lse_arg = lse_part if lse_part is not None else o_part  # unused when K = 1
    if K > 1 and (premerge if premerge is not None else (BR == 1 and K > PREMERGE_ABOVE)):
        from k3lab_kernels.triton.mla_decode import merge_partials  # every column block and row in parallel

        o_m = torch.empty(B, T, H, C, dtype=torch.float32, device=o_part.device)
        l_m = torch.empty(B, T, H, dtype=torch.float32, device=o_part.device)
        merge_partials(o_part, lse_part, o_m, l_m, pdl=pdl)
        o_part, lse_arg, K = o_m.unsqueeze(1), o_m, 1
    if BR == 1:
        _mla_combine_row_kernel[(H, triton.cdiv(Dv, BV), NR)](
            o_part, lse_arg, w_uv, gate, out, K, T, H, C=C, CP=_pow2(C), DV=Dv, BV=BV, KB=min(16, _pow2(K)),
            RNE=dot_f32(), PDL=pdl_on(pdl), num_warps=num_warps or 8, **launch_kw(pdl))
        return out
    grid = (H, triton.cdiv(Dv, BV), triton.cdiv(NR, BR))
    _mla_combine_kernel[grid](o_part, lse_arg, w_uv, gate, out, K, T, H, NR,
                              C=C, CP=_pow2(C), DV=Dv, BV=BV, BR=BR, DOT_F32=dot_f32(), PDL=pdl_on(pdl),
                              num_warps=num_warps or (4 if BR <= 32 else 8), **launch_kw(pdl))
    return out
