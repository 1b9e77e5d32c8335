"""MoE router exact reference: sigmoid scores, a selection-only bias, top-k, renormalized weights.

    s   = sigmoid(Wr h)                        # [E] scores, in float32 (float64 for the oracle)
    sel = topk(s + e_bias, k)                  # the bias only CHOOSES the experts
    w   = s[sel] / sum(s[sel]) * routed_scaling   # weights from the UNBIASED scores

Ties in the biased score (not specified by the model) are broken by the project's rule, the router kernel's:
equal biased scores take the lower expert id first; the selected experts come back in descending biased-score
order.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from k3lab.ref.rmsnorm import compute_dtype


@dataclass
class RouterWeights:
    w: torch.Tensor  # [E, D]
    e_bias: torch.Tensor  # [E] selection bias
    top_k: int = 16
    scaling: float = 1.0

    @property
    def n_experts(self) -> int:
        return self.w.shape[0]

    def nbytes(self) -> int:
        return self.w.numel() * self.w.element_size() + self.e_bias.numel() * self.e_bias.element_size()


def router_scores(h: torch.Tensor, w: RouterWeights) -> torch.Tensor:
    """sigmoid(Wr h) in the compute dtype. h [B, D] -> [B, E]."""
    dt = compute_dtype(h, w.w)
    return torch.sigmoid(h.to(dt) @ w.w.to(dt).T)


def route(h: torch.Tensor, w: RouterWeights) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Returns (idx [B, k] int64, weights [B, k] compute dtype, scores [B, E])."""
    if not 1 <= w.top_k <= w.n_experts:
        raise ValueError(f"route: top_k={w.top_k} must be in 1..{w.n_experts}")
    s = router_scores(h, w)
    # tie rule (the router kernel's, k3lab.ops.trunk): descending biased score, equal scores lower expert id first;
    # a stable sort of the negated scores gives it (torch.topk documents no order among equal values)
    idx = torch.sort(-(s + w.e_bias.to(s.dtype)), dim=-1, stable=True).indices[..., : w.top_k].contiguous()
    sel = torch.gather(s, -1, idx)
    weights = sel / sel.sum(-1, keepdim=True) * w.scaling
    return idx, weights, s
