"""RMSNorm exact reference (with and without a weight). Any dtype; pass float64 for the oracle.

    rms(x; w) = x / sqrt(mean(x^2) + eps) * w          # over the last dim; w = 1 for the weightless form

The statistics are taken in `compute_dtype(x)`: float64 stays float64, anything narrower is lifted to
float32 (the "mixing maths in fp32" rule of docs/MODEL.md, The stack). The result is cast to `out_dtype`
(default: x's dtype).
"""
from __future__ import annotations

import torch


def compute_dtype(*tensors: torch.Tensor | None) -> torch.dtype:
    """float64 if any tensor is float64, else float32: the precision the mixing maths runs in."""
    for t in tensors:
        if t is not None and t.dtype == torch.float64:
            return torch.float64
    return torch.float32


def rms_norm(x: torch.Tensor, weight: torch.Tensor | None = None, eps: float = 1e-6, *,
             out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """rms(x; weight) over the last dim. weight None = the weightless form rms(x; 1)."""
    if weight is not None and weight.shape != x.shape[-1:]:
        raise ValueError(f"rms_norm: weight must have shape [{x.shape[-1]}], got {tuple(weight.shape)}")
    dt = compute_dtype(x, weight)
    xf = x.to(dt)
    y = xf * torch.rsqrt((xf * xf).mean(-1, keepdim=True) + eps)
    if weight is not None:
        y = y * weight.to(dt)
    return y.to(out_dtype or x.dtype)
