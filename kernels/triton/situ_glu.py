"""SiTU-GLU activation in one Triton launch: the shared experts' (and the dense MLP's) step between their fused
w1/w3 projection and w2.

    a[r, i] = bf16( b1 tanh(g / b1) sigmoid(g) * b2 tanh(u / b2) ),   g = gu[r, i], u = gu[r, I + i]

fp32 maths, one rounding (the reference rounds the same products once per torch op in bf16; the fp64
oracle rounds nothing). The routed experts' SiTU is fused into the grouped expert kernel (`moe_experts.py`).

Layout: gu [R, 2I] (bf16, the w1 outputs in columns 0..I-1 and the w3 outputs in I..2I-1, as one projection
over the concatenated [w1; w3] writes them; unit stride along the columns, any row stride); a [R, I] bf16
(unit stride along I, any row stride). Grid (R, cdiv(I, BI)).

Floor (bytes, `k3lab.ops.glue.situ_bytes`): R*I*(2*2 + 2) at the read bandwidth: 4.6 KB (two TP8 shared
experts, batch 1) to 0.3 MB (batch 64): launch-bound at every decode batch.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from k3lab_kernels.triton.pdl import chain_pdl, launch_kw, pdl_enter


@triton.jit
def _tanh(x):
    # tanh(x) = 1 - 2 / (exp(2x) + 1): exact limits at +-inf (exp overflows to inf -> 1, underflows to 0 -> -1)
    return 1.0 - 2.0 / (tl.exp(2.0 * x) + 1.0)


@triton.jit
def situ(g, u, b1, b2):
    """b1 tanh(g / b1) sigmoid(g) * b2 tanh(u / b2) in fp32 (also the projections' SiTU prologue, proj_gemv)."""
    sig = 1.0 / (1.0 + tl.exp(-g))
    return (b1 * _tanh(g / b1) * sig) * (b2 * _tanh(u / b2))


@triton.jit
def situ_cols(gu, a, I, i0, b1, b2, BI: tl.constexpr):
    """a[i] = bf16(situ(gu[i], gu[I + i])) for columns i0 .. i0+BI-1 of one row (gu, a: the row's first element;
    also norm_glu.py's second part)."""
    i = i0 + tl.arange(0, BI)
    m = i < I
    g = tl.load(gu + i, mask=m, other=0.0).to(tl.float32)
    u = tl.load(gu + I + i, mask=m, other=0.0).to(tl.float32)
    tl.store(a + i, situ(g, u, b1, b2).to(tl.bfloat16), mask=m)


@triton.jit
def _situ_glu_kernel(gu, a, I, s_gu, s_a, b1, b2, BI: tl.constexpr, PDL: tl.constexpr):
    r = tl.program_id(0)
    pdl_enter(PDL)
    situ_cols(gu + r * s_gu, a + r * s_a, I, tl.program_id(1) * BI, b1, b2, BI)


def situ_glu(gu: torch.Tensor, out: torch.Tensor, *, b1: float, b2: float, block: int | None = None,
             num_warps: int | None = None, pdl: bool | None = None) -> torch.Tensor:
    """out = situ(gu[:, :I], gu[:, I:]) in bf16 (module docstring); the component API validates the arguments.
    pdl: launched with programmatic dependent launch (None: the enclosing pdl.pdl_chain's setting)."""
    pdl = chain_pdl(pdl)
    R, I = out.shape
    BI = block or min(1024, triton.next_power_of_2(I))
    _situ_glu_kernel[(R, triton.cdiv(I, BI))](gu, out, I, gu.stride(0), out.stride(0), float(b1), float(b2), BI=BI,
                                             PDL=pdl, num_warps=num_warps or 4, **launch_kw(pdl))
    return out
