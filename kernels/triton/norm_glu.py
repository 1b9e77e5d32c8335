"""The MoE output's two input segments in one Triton launch: the RMSNorm of the routed experts' sum (routed_norm)
and the shared experts' SiTU-GLU, written side by side into the one input of the output projection over
[Wup | w2] (k3lab.step, moe_out).

    out[r, :D]      = bf16( y[r] * rsqrt(mean(y[r]^2) + eps) * weight )                    fp32 maths
    out[r, D + i]   = bf16( b1 tanh(g / b1) sigmoid(g) * b2 tanh(u / b2) ),  g = gu[r, i], u = gu[r, I + i]

The same row functions as `rms_norm.py` and `situ_glu.py` (`rms_row`, `situ_cols`: their two launches, which this
replaces in the step: one launch fewer a MoE layer).

Layout: y [R, D] fp32 or bf16, weight [D] bf16/fp32 (contiguous), gu [R, 2I] bf16, out [R, D + I] bf16; unit
stride along the last dim, any row strides. Grid (R, 1 + cdiv(I, BI)): program (r, 0) normalizes row r (the row
in registers, D padded to a power of two, D <= 16384), programs (r, j > 0) take columns BI (j - 1).. of the
SiTU-GLU.

Floor (bytes, `k3lab.ops.glue.norm_glu_bytes`): R*D*(e_y + 2) + D*e_w + R*I*6 at the read bandwidth: 36 KB (TP8,
batch 1) to 1.3 MB (batch 64): launch-bound at every decode batch.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from k3lab_kernels.triton.pdl import chain_pdl, launch_kw, pdl_enter

from k3lab_kernels.triton.rms_norm import rms_row
from k3lab_kernels.triton.situ_glu import situ_cols


@triton.jit
def _norm_glu_kernel(y, w, gu, out, D, I, s_y, s_gu, s_o, eps, b1, b2, BD: tl.constexpr, BI: tl.constexpr,
                     PDL: tl.constexpr):
    r = tl.program_id(0)
    j = tl.program_id(1)
    pdl_enter(PDL)
    if j == 0:
        rms_row(y + r * s_y, w, out + r * s_o, D, eps, BD)
    else:
        situ_cols(gu + r * s_gu, out + r * s_o + D, I, (j - 1) * BI, b1, b2, BI)


def norm_glu(y: torch.Tensor, weight: torch.Tensor, gu: torch.Tensor, out: torch.Tensor, *, eps: float, b1: float,
             b2: float, block: int | None = None, num_warps: int | None = None,
             pdl: bool | None = None) -> torch.Tensor:
    """out = [rms(y; weight) | situ(gu)] in bf16 (module docstring); the component API validates the arguments.
    pdl: launched with programmatic dependent launch (None: the enclosing pdl.pdl_chain's setting)."""
    pdl = chain_pdl(pdl)
    R, D = y.shape
    inter = gu.shape[1] // 2
    BD = triton.next_power_of_2(D)
    BI = block or min(1024, triton.next_power_of_2(inter))
    _norm_glu_kernel[(R, 1 + triton.cdiv(inter, BI))](
        y, weight, gu, out, D, inter, y.stride(0), gu.stride(0), out.stride(0), float(eps), float(b1), float(b2),
        BD=BD, BI=BI, PDL=pdl, num_warps=num_warps or (4 if BD <= 2048 else 8), **launch_kw(pdl))
    return out
