"""Layer 0's dense MLP, exact reference: a SiTU-GLU on the full hidden size.

    out = W2 situ(W1 x, W3 x),   W1, W3: D -> I_dense,  W2: I_dense -> D

Under TP each GPU holds a slice of I_dense and returns a partial sum (see k3lab.ref.situ).
"""
from __future__ import annotations

import torch

from k3lab.ref.situ import GLUWeights, situ_glu_mlp

DenseWeights = GLUWeights


def dense_mlp(x: torch.Tensor, w: GLUWeights) -> torch.Tensor:
    """x [..., D] -> [..., D]."""
    return situ_glu_mlp(x, w)
