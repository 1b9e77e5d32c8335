"""Attention Residuals (AttnRes) mix, exact reference. Any dtype; float64 is the oracle.

The residual stream is a list of block representations B = [b_1..b_n] plus the running partial p of
the current block. With the n+1 sources s_i = (b_1, .., b_n, p) and two per-layer vectors:

    score_i = dot(rms(s_i; 1) * w_norm, w_proj)          # weightless RMSNorm, then the two vectors
    alpha   = softmax(score)                             # over the n+1 sources
    mix     = sum_i alpha_i * s_i                        # the RAW sources, not the normed ones

Precision: sources are stored in the activation dtype (bf16); scores, softmax and the weighted sum
run in `compute_dtype` (float32, or float64 when any input is float64). The mix is returned in that
dtype by default, because the spec keeps it in registers straight into the following RMSNorm
(`attnres_norm` does both). The layer loop that keeps B and p is in `k3lab.ref.layers`.
"""
from __future__ import annotations

from collections.abc import Sequence

import torch

from k3lab.ref.rmsnorm import compute_dtype, rms_norm


def _sources(blocks: Sequence[torch.Tensor], partial: torch.Tensor) -> list[torch.Tensor]:
    srcs = list(blocks) + [partial]
    for i, s in enumerate(srcs):
        if s.shape != partial.shape:
            raise ValueError(f"attnres: source {i} has shape {tuple(s.shape)}, expected the partial's "
                             f"{tuple(partial.shape)}")
    return srcs


def attnres_weights(blocks: Sequence[torch.Tensor], partial: torch.Tensor, w_norm: torch.Tensor,
                    w_proj: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """Softmax weights alpha [..., n+1] over the sources (blocks in order, then the partial)."""
    srcs = _sources(blocks, partial)
    dt = compute_dtype(partial, w_norm, w_proj)
    S = torch.stack([s.to(dt) for s in srcs], dim=-2)  # [..., n+1, D]
    scores = (rms_norm(S, None, eps, out_dtype=dt) * w_norm.to(dt)) @ w_proj.to(dt)  # [..., n+1]
    return torch.softmax(scores, dim=-1)


def attnres(blocks: Sequence[torch.Tensor], partial: torch.Tensor, w_norm: torch.Tensor,
            w_proj: torch.Tensor, eps: float = 1e-6, *, out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """The mix sum_i alpha_i s_i over B + [p]. Returned in the compute dtype unless `out_dtype`."""
    srcs = _sources(blocks, partial)
    alpha = attnres_weights(blocks, partial, w_norm, w_proj, eps)
    S = torch.stack([s.to(alpha.dtype) for s in srcs], dim=-2)
    mix = (alpha.unsqueeze(-1) * S).sum(-2)
    return mix if out_dtype is None else mix.to(out_dtype)


def attnres_norm(blocks: Sequence[torch.Tensor], partial: torch.Tensor, w_norm: torch.Tensor,
                 w_proj: torch.Tensor, norm_w: torch.Tensor, eps: float = 1e-6, *,
                 out_dtype: torch.dtype | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """The fused form: (mix in the compute dtype, rms(mix; norm_w) in `out_dtype` (default partial's))."""
    mix = attnres(blocks, partial, w_norm, w_proj, eps)
    return mix, rms_norm(mix, norm_w, eps, out_dtype=out_dtype or partial.dtype)
