"""SiTU-GLU activation and the dense SiTU-GLU MLP, exact reference. Any dtype; float64 is the oracle.

    situ(g, u) = b1 * tanh(g / b1) * sigmoid(g)  *  b2 * tanh(u / b2)        (b1 = 4, b2 = 25)
    mlp(x)     = W2 situ(W1 x, W3 x)

The gate branch is a SiLU whose linear part is soft-clipped at +-b1; the up branch is the identity
soft-clipped at +-b2. Weights use the nn.Linear layout [out, in]. The maths runs in x's dtype (the
weights are cast to it), so a bf16 x gives a bf16 run and a float64 x the oracle. Under tensor
parallelism W1/W3 hold a slice of the intermediate rows and W2 the matching columns: the result is
then a partial sum that an all-reduce completes.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

B1 = 4.0
B2 = 25.0


def situ(g: torch.Tensor, u: torch.Tensor, b1: float = B1, b2: float = B2) -> torch.Tensor:
    """a = b1*tanh(g/b1)*sigmoid(g) * b2*tanh(u/b2), elementwise."""
    if g.shape != u.shape:
        raise ValueError(f"situ: g and u must have the same shape, got {tuple(g.shape)} and {tuple(u.shape)}")
    return (b1 * torch.tanh(g / b1) * torch.sigmoid(g)) * (b2 * torch.tanh(u / b2))


def linear(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """x @ w^T in x's dtype (w [out, in])."""
    return x @ w.to(x.dtype).transpose(-1, -2)


@dataclass
class GLUWeights:
    """One SiTU-GLU MLP (a dense MLP, a shared expert, or one GPU's slice of either)."""

    w1: torch.Tensor  # [I, D] gate
    w3: torch.Tensor  # [I, D] up
    w2: torch.Tensor  # [D, I] down
    b1: float = B1
    b2: float = B2

    @property
    def inter(self) -> int:
        return self.w1.shape[0]

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.w1, self.w3, self.w2))


def situ_glu_mlp(x: torch.Tensor, w: GLUWeights) -> torch.Tensor:
    """W2 situ(W1 x, W3 x). x [..., D] -> [..., D]."""
    return linear(situ(linear(x, w.w1), linear(x, w.w3), w.b1, w.b2), w.w2)
