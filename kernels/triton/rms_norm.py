"""RMSNorm of rows in one Triton launch: the decode step's norms that stand alone between two projections.

    out[r] = bf16( x[r] * rsqrt(mean(x[r]^2) + eps) * weight )        fp32 maths, one rounding

Used for the MLA q_norm (between the q down- and up-projections) and the MoE routed_norm (between the grouped
experts' fp32 sum and the latent up-projection). The kv_norm has its own kernel fused with the cache write
(`mla_cache_write.py`), the AttnRes norms theirs (`attnres_norm.py`).

Layout: x [R, D] (bf16 or fp32, unit stride along D, any row stride), weight [D] (bf16 or fp32, contiguous),
out [R, D] bf16 (unit stride along D, any row stride). Grid (R,): one program a row, the row held in
registers (D padded to a power of two; D <= 16384), so x is read once.

Floor (bytes, `k3lab.ops.glue.rms_norm_bytes`): R*D*(e_x + 2) + D*e_w at the read bandwidth: 14 KB (q_norm,
batch 1) to 0.9 MB (routed_norm, batch 64): launch-bound at every decode batch.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from k3lab_kernels.triton.pdl import chain_pdl, launch_kw, pdl_enter


@triton.jit
def rms_row(x, w, out, D, eps, BD: tl.constexpr):
    """out[:D] = bf16(rms(x[:D]; w)) for one row (x, out: the row's first element; also norm_glu.py's first part)."""
    d = tl.arange(0, BD)
    m = d < D
    v = tl.load(x + d, mask=m, other=0.0).to(tl.float32)
    g = tl.load(w + d, mask=m, other=0.0).to(tl.float32)
    inv = 1.0 / tl.sqrt(tl.sum(v * v, axis=0) / D + eps)
    tl.store(out + d, (v * inv * g).to(tl.bfloat16), mask=m)


@triton.jit
def _rms_norm_kernel(x, w, out, D, s_x, s_o, eps, BD: tl.constexpr, PDL: tl.constexpr):
    r = tl.program_id(0)
    pdl_enter(PDL)
    rms_row(x + r * s_x, w, out + r * s_o, D, eps, BD)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, out: torch.Tensor, *, eps: float,
             num_warps: int | None = None, pdl: bool | None = None) -> torch.Tensor:
    """out = rms(x; weight) in bf16 (module docstring); the component API validates the arguments. pdl: launched
    with programmatic dependent launch (None: the enclosing pdl.pdl_chain's setting)."""
    pdl = chain_pdl(pdl)
    R, D = x.shape
    BD = triton.next_power_of_2(D)
    nw = num_warps or (4 if BD <= 2048 else 8)
    _rms_norm_kernel[(R,)](x, weight, out, D, x.stride(0), out.stride(0), float(eps), BD=BD, PDL=pdl, num_warps=nw,
                           **launch_kw(pdl))
    return out
