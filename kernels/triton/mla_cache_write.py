"""Gated-MLA cache write in one small Triton launch: the kv down-projection's output through kv_norm,
written into the latent cache in place.

    entry = [rms(kv[:C]; kv_norm, eps) | kv[C:]]     (C = 512 latent, Dr = 64 rope; fp32 statistics)
    cache[b, lengths[b] + t] = entry (rounded once to the cache format)       for t in 0..T-1

Grid: one program per new entry (B*T). It loads the 576 input values (bf16) as a [C] and a [Dr] vector,
normalizes the first C in fp32, rounds once to nearest-even, and stores the row (1152 contiguous bytes
in bf16, 576 in fp8) at its position: contiguous cache [B, S_max, W] row b*S_max + pos, or paged
(pool [n_pages, PAGE, W], block_table [B, max_pages] int32) row block_table[b, pos // PAGE]*PAGE +
pos % PAGE. Nothing else of the cache is touched. lengths stays as it is (the caller owns it).

fp8 e4m3 (float8_e4m3fn) cache, the scale scheme of k3lab.ref.mla: PER-TENSOR: a 0-d fp32 scale read in
the kernel, stored e4m3(clamp(x / scale, +-448)); PER-TOKEN: the entry's scale s = max(amax(|entry|) /
448, 1e-12) over all W values is written beside the row (scale [B, S_max] contiguous, [n_pages, PAGE]
paged) and the row stores e4m3(clamp(x / s, +-448)). Dequantized: e4m3 * scale.

Floor (bytes, per call): input B*T*W*2 + kv_norm C*2 + rows written B*T*W*e (e = 2 bf16, 1 fp8; + 4 per
row for per-token scales) + lengths/table: ~1.2 KB + 1.2 KB a position in bf16; launch-bound at decode.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from k3lab_kernels.triton.mla_decode import _pow2, dot_f32, rne_bf16, rne_e4m3
from k3lab_kernels.triton.pdl import chain_pdl, launch_kw, pdl_enter


@triton.jit
def _mla_cache_write_kernel(kv_in, norm_w, cache, scale, block_table, lengths, eps, T,
                            s_ib, s_it, s_cb, s_sb, s_btb,
                            C: tl.constexpr, DR: tl.constexpr, CP: tl.constexpr, DRP: tl.constexpr,
                            W: tl.constexpr, PAGED: tl.constexpr, PAGE: tl.constexpr, SCALE_MODE: tl.constexpr,
                            RNE: tl.constexpr, PDL: tl.constexpr):
    pid = tl.program_id(0)
    b = pid // T
    t = pid % T
    cc = tl.arange(0, CP)
    rr = tl.arange(0, DRP)
    cm = cc < C
    rm = rr < DR
    wt = tl.load(norm_w + cc, mask=cm, other=0.0).to(tl.float32)
    pos = tl.load(lengths + b).to(tl.int32) + t
    if PAGED:
        page = tl.load(block_table + b * s_btb + pos // PAGE)
        row = page.to(tl.int64) * PAGE + pos % PAGE
    else:
        row = b.to(tl.int64) * s_cb + pos
    dst = cache + row * W
    pdl_enter(PDL)  # the weight, the length and the page index above (never written in a step), then the input
    src = kv_in + b.to(tl.int64) * s_ib + t * s_it
    x = tl.load(src + cc, mask=cm, other=0.0).to(tl.float32)
    xr = tl.load(src + C + rr, mask=rm, other=0.0).to(tl.float32)
    y = x / tl.sqrt(tl.sum(x * x, 0) / C + eps) * wt
    if SCALE_MODE == 0:
        if RNE:
            y = rne_bf16(y)
            xr = rne_bf16(xr)
        tl.store(dst + cc, y.to(cache.dtype.element_ty), mask=cm)
        tl.store(dst + C + rr, xr.to(cache.dtype.element_ty), mask=rm)
    else:
        if SCALE_MODE == 1:
            s = tl.load(scale).to(tl.float32)
        else:
            amax = tl.maximum(tl.max(tl.abs(y), 0), tl.max(tl.abs(xr), 0))
            s = tl.maximum(amax / 448.0, 1e-12)
            if PAGED:
                tl.store(scale + row, s)
            else:
                tl.store(scale + b.to(tl.int64) * s_sb + pos, s)
        qy = tl.minimum(tl.maximum(y / s, -448.0), 448.0)
        qr = tl.minimum(tl.maximum(xr / s, -448.0), 448.0)
        if RNE:
            qy = rne_e4m3(qy)
            qr = rne_e4m3(qr)
        tl.store(dst + cc, qy.to(tl.float8e4nv), mask=cm)
        tl.store(dst + C + rr, qr.to(tl.float8e4nv), mask=rm)


def mla_cache_write(kv: torch.Tensor, kv_norm: torch.Tensor, cache: torch.Tensor, lengths: torch.Tensor, *,
                    eps: float = 1e-6, scale: torch.Tensor | None = None, block_table: torch.Tensor | None = None,
                    num_warps: int = 4, pdl: bool | None = None) -> None:
    """kv [B,T,W] (last dim contiguous; bf16/fp16/fp32), kv_norm [C]; cache [B,S_max,W] or, with block_table
    [B, max_pages] int32, the pool [n_pages, PAGE, W] (bf16/fp16 or float8_e4m3fn with `scale`: 0-d
    per-tensor, or per-token [B,S_max] / [n_pages, PAGE] fp32, written); lengths [B] int32/int64. In place;
    the caller validates (positions inside the capacity). pdl: launched with programmatic dependent launch
    (None: the enclosing pdl.pdl_chain's setting; the lengths and the block table are read before the
    wait: the caller does not change them in the kernel before)."""
    pdl = chain_pdl(pdl)
    B, T, W = kv.shape
    C = kv_norm.shape[0]
    assert kv.stride(-1) == 1 and cache.is_contiguous() and cache.shape[-1] == W
    paged = block_table is not None
    fp8 = cache.dtype == torch.float8_e4m3fn
    mode = 0 if not fp8 else (1 if scale.dim() == 0 else 2)
    _mla_cache_write_kernel[(B * T,)](
        kv, kv_norm, cache, scale if mode else kv_norm, block_table if paged else lengths, lengths, float(eps), T,
        kv.stride(0), kv.stride(1), 0 if paged else cache.shape[1], scale.stride(0) if mode == 2 and not paged else 0,
        block_table.stride(0) if paged else 0,
        C=C, DR=W - C, CP=_pow2(C), DRP=_pow2(W - C), W=W, PAGED=paged, PAGE=cache.shape[1] if paged else 1,
        SCALE_MODE=mode, RNE=dot_f32(), PDL=pdl, num_warps=num_warps, **launch_kw(pdl))
