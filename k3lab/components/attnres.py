"""AttnRes component API: the residual mix over the block list B and the partial p, optionally fused
with the RMSNorm that follows (k3lab.ref.attnres has the maths).

    mix(blocks, partial, w_norm, w_proj, *, eps=1e-6, backend="reference") -> mix [B, D] float32
    mix_norm(blocks, partial, w_norm, w_proj, norm_w, out=None, *, eps=1e-6, backend="reference")
        -> rms(mix; norm_w) [B, D] in partial's dtype (written into `out` when given)

Backends here: "reference" (the torch reference) and "torch_compile" (torch.compile of it, one
compiled graph per number of sources). Any other backend is refused with BackendUnavailable.
"""
from __future__ import annotations

from collections.abc import Sequence

import torch

from k3lab.ref import attnres as ref
from k3lab.components.dispatch import resolve_backend

COMPONENT = "attnres"


def _check(blocks, partial, w_norm, w_proj, norm_w=None) -> None:
    if not isinstance(partial, torch.Tensor) or partial.dim() < 1 or not partial.is_floating_point():
        raise ValueError(f"{COMPONENT}: 'partial' must be a floating tensor [..., D], got "
                         f"{getattr(partial, 'shape', type(partial).__name__)}")
    if not isinstance(blocks, (list, tuple)):
        raise TypeError(f"{COMPONENT}: 'blocks' must be a list of tensors shaped like partial, got "
                         f"{type(blocks).__name__}")
    for i, b in enumerate(blocks):
        if not isinstance(b, torch.Tensor) or b.shape != partial.shape:
            raise ValueError(f"{COMPONENT}: 'blocks[{i}]' must have partial's shape {tuple(partial.shape)}, got "
                             f"{tuple(getattr(b, 'shape', ()))}")
        if b.device != partial.device:
            raise ValueError(f"{COMPONENT}: 'blocks[{i}]' is on {b.device}, partial on {partial.device}")
    D = partial.shape[-1]
    for name, v in (("w_norm", w_norm), ("w_proj", w_proj), ("norm_w", norm_w)):
        if v is None and name == "norm_w":
            continue
        if not isinstance(v, torch.Tensor) or v.shape != (D,):
            raise ValueError(f"{COMPONENT}: {name!r} must have shape [{D}], got {tuple(getattr(v, 'shape', ()))}")


def mix(blocks: Sequence[torch.Tensor], partial: torch.Tensor, w_norm: torch.Tensor, w_proj: torch.Tensor, *,
        eps: float = 1e-6, backend: str = "reference") -> torch.Tensor:
    """sum_i softmax(score)_i s_i over B + [p], in float32 (float64 if the inputs are)."""
    _check(blocks, partial, w_norm, w_proj)
    fn = resolve_backend(COMPONENT, backend, ref.attnres, "mix")
    return fn(list(blocks), partial, w_norm, w_proj, eps)


def _mix_norm(blocks, partial, w_norm, w_proj, norm_w, eps):
    return ref.attnres_norm(blocks, partial, w_norm, w_proj, norm_w, eps)[1]


def mix_norm(blocks: Sequence[torch.Tensor], partial: torch.Tensor, w_norm: torch.Tensor, w_proj: torch.Tensor,
             norm_w: torch.Tensor, out: torch.Tensor | None = None, *, eps: float = 1e-6,
             backend: str = "reference") -> torch.Tensor:
    """rms(mix; norm_w) in partial's dtype: the mix never leaves the compute dtype before the norm."""
    _check(blocks, partial, w_norm, w_proj, norm_w)
    if out is not None and (out.shape != partial.shape or out.dtype != partial.dtype):
        raise ValueError(f"{COMPONENT}: 'out' must be {tuple(partial.shape)} {partial.dtype}, got "
                         f"{tuple(out.shape)} {out.dtype}")
    fn = resolve_backend(COMPONENT, backend, _mix_norm, "mix_norm")
    y = fn(list(blocks), partial, w_norm, w_proj, norm_w, eps)
    if out is None:
        return y
    out.copy_(y)
    return out
