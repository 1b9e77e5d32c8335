"""Latent MoE component API (k3lab.ref.moe / k3lab.ref.router have the maths).

    forward(h, weights, out=None, *, backend="reference") -> out [B, D]      routed + shared
    route(h, router, *, backend="reference") -> (idx [B, k], weights [B, k])
    experts(z, idx, weights_k, moe, *, backend="reference") -> y [B, L] (float32)   the routed sum only

Experts may be stored dense (bf16), fp8 or MXFP4 (`ExpertWeight`); they are dequantized per expert.
Backends here: "reference", "torch_compile" (compiles the per-expert FFN, dynamic in the token count,
and the router; the loop over selected experts stays eager); others are refused with BackendUnavailable.
"""
from __future__ import annotations

import torch

from k3lab.components.dispatch import resolve_backend, write_out
from k3lab.ref import moe as ref
from k3lab.ref import router as ref_router
from k3lab.ref.moe import MoEWeights
from k3lab.ref.router import RouterWeights

COMPONENT = "moe"


def _check_h(h, D: int, name: str = "h") -> None:
    if not isinstance(h, torch.Tensor) or h.dim() != 2 or h.shape[1] != D or not h.is_floating_point():
        raise ValueError(f"{COMPONENT}: {name!r} must be a floating tensor [B, {D}], got "
                         f"{tuple(getattr(h, 'shape', ()))}")


def forward(h: torch.Tensor, weights: MoEWeights, out: torch.Tensor | None = None, *,
            backend: str = "reference") -> torch.Tensor:
    if not isinstance(weights, MoEWeights):
        raise TypeError(f"{COMPONENT}: 'weights' must be k3lab.ref.moe.MoEWeights, got {type(weights).__name__}")
    _check_h(h, weights.w_down.shape[1])
    # the expert loop stays eager (data-dependent); the per-expert FFN and the router are what compile
    ffn = resolve_backend(COMPONENT, backend, ref.glu_ffn, "glu_ffn", dynamic=True)
    router = resolve_backend("router", backend, ref_router.route, "route")
    y = ref.moe_forward(h, weights, ffn=ffn, router=router)
    return write_out(COMPONENT, y, out)


def route(h: torch.Tensor, router: RouterWeights, *, backend: str = "reference"):
    if not isinstance(router, RouterWeights):
        raise TypeError(f"{COMPONENT}: 'router' must be k3lab.ref.router.RouterWeights, got {type(router).__name__}")
    _check_h(h, router.w.shape[1])
    idx, w, _ = resolve_backend("router", backend, ref_router.route, "route")(h, router)
    return idx, w


def experts(z: torch.Tensor, idx: torch.Tensor, weights_k: torch.Tensor, moe: MoEWeights, *,
            backend: str = "reference") -> torch.Tensor:
    _check_h(z, moe.w_down.shape[0], "z")
    if idx.shape != weights_k.shape or idx.shape[0] != z.shape[0] or idx.dim() != 2:
        raise ValueError(f"{COMPONENT}: 'idx' and 'weights_k' must both be [{z.shape[0]}, k], got "
                         f"{tuple(idx.shape)} and {tuple(weights_k.shape)}")
    if int(idx.min()) < 0 or int(idx.max()) >= moe.router.n_experts:
        raise ValueError(f"{COMPONENT}: 'idx' must hold expert ids in 0..{moe.router.n_experts - 1}")
    ffn = resolve_backend(COMPONENT, backend, ref.glu_ffn, "glu_ffn", dynamic=True)
    return ref.routed_experts(z, idx, weights_k, moe, ffn)
