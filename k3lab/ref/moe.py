"""Latent MoE layer exact reference (routed experts on a latent, shared experts on the full hidden).

    idx, w  = route(h)                                    # k3lab.ref.router
    z       = Wdown h                                     # D -> L (7168 -> 3584)
    y       = sum_{e in idx} w_e * W2_e situ(W1_e z, W3_e z)   # each expert L -> I -> L
    routed  = Wup rms(y; routed_norm)                     # L -> D
    shared  = sum_j W2s_j situ(W1s_j h, W3s_j h)          # n_shared SiTU-GLU experts on h
    out     = routed + shared

Expert weights are stored as `ExpertWeight` in one of three formats and dequantized before use:
    "dense" any float dtype (bf16 as run),
    "fp8"   float8_e4m3fn with one float32 scale per output row (scale = row amax / 448),
    "mxfp4" k3lab.mxfp4 packing along the input dim (E2M1 + one E8M0 scale per 32).
Precision: projections and experts run in h's dtype; the weighted expert sum y is accumulated in the
compute dtype (float32, float64 for the oracle) and normed from there.

Tensor parallelism: a GPU holds a slice of every expert's intermediate (W1/W3 rows, W2 columns) and of
each shared expert's, so its y and shared are partial sums. Because the routed RMSNorm needs the whole
y, the partial y must be reduced before the norm; `moe_forward_tp` simulates that on one device.
The router and latent projections are replicated (every rank computes them whole) in this reference.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from k3lab import mxfp4
from k3lab.ref.rmsnorm import compute_dtype, rms_norm
from k3lab.ref.router import RouterWeights, route
from k3lab.ref.situ import GLUWeights, linear, situ, situ_glu_mlp

FP8_MAX = 448.0
EXPERT_FORMATS = ("dense", "fp8", "mxfp4")


@dataclass
class ExpertWeight:
    """A stack of per-expert matrices [E, out, in] in one storage format."""

    fmt: str
    data: torch.Tensor  # dense: [E,out,in] float; fp8: [E,out,in] e4m3fn; mxfp4: [E,out,in/2] uint8
    scale: torch.Tensor | None = None  # fp8: [E,out] float32; mxfp4: [E,out,in/32] uint8 (E8M0)

    def __post_init__(self) -> None:
        if self.fmt not in EXPERT_FORMATS:
            raise ValueError(f"ExpertWeight.fmt must be one of {EXPERT_FORMATS}, got {self.fmt!r}")

    @property
    def n_experts(self) -> int:
        return self.data.shape[0]

    @property
    def shape(self) -> tuple[int, int, int]:
        E, o, i = self.data.shape
        return (E, o, i * 2) if self.fmt == "mxfp4" else (E, o, i)

    def nbytes(self, n_experts: int | None = None) -> int:
        """Storage bytes of all experts, or of `n_experts` of them."""
        tot = self.data.numel() * self.data.element_size()
        if self.scale is not None:
            tot += self.scale.numel() * self.scale.element_size()
        return tot if n_experts is None else tot * n_experts // self.n_experts

    def dequant(self, dtype: torch.dtype, experts: torch.Tensor | int | None = None) -> torch.Tensor:
        """[E', out, in] in `dtype` for the given expert ids (all when None)."""
        data, scale = self.data, self.scale
        if experts is not None:
            data = data[experts]
            scale = None if scale is None else scale[experts]
        if self.fmt == "dense":
            return data.to(dtype)
        if self.fmt == "fp8":
            work = torch.float64 if dtype == torch.float64 else torch.float32
            return (data.to(work) * scale.to(work).unsqueeze(-1)).to(dtype)
        return mxfp4.unpack_mxfp4(data, scale, dtype)

    @classmethod
    def quantize(cls, w: torch.Tensor, fmt: str) -> ExpertWeight:
        """Store a float [E, out, in] stack in `fmt` ("dense" keeps w as given)."""
        if fmt == "dense":
            return cls("dense", w)
        if fmt == "fp8":
            wf = w.float()
            scale = (wf.abs().amax(-1) / FP8_MAX).clamp_min(1e-12)
            q = (wf / scale.unsqueeze(-1)).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
            return cls("fp8", q, scale)
        if fmt == "mxfp4":
            packed, scales = mxfp4.pack_mxfp4(w)
            return cls("mxfp4", packed, scales)
        raise ValueError(f"ExpertWeight.quantize: fmt must be one of {EXPERT_FORMATS}, got {fmt!r}")


@dataclass
class MoEWeights:
    router: RouterWeights
    w_down: torch.Tensor  # [L, D]
    w1: ExpertWeight  # [E, I, L]
    w3: ExpertWeight  # [E, I, L]
    w2: ExpertWeight  # [E, L, I]
    routed_norm: torch.Tensor  # [L]
    w_up: torch.Tensor  # [D, L]
    shared: list[GLUWeights] = field(default_factory=list)
    eps: float = 1e-6
    b1: float = 4.0
    b2: float = 25.0

    def __post_init__(self) -> None:
        E = self.router.n_experts
        for name in ("w1", "w3", "w2"):
            if getattr(self, name).n_experts != E:
                raise ValueError(f"MoEWeights.{name} holds {getattr(self, name).n_experts} experts, "
                                 f"the router scores {E}")


def glu_ffn(z: torch.Tensor, w1: torch.Tensor, w3: torch.Tensor, w2: torch.Tensor, b1: float, b2: float):
    """W2 situ(W1 z, W3 z) on dequantized matrices, in z's dtype."""
    return linear(situ(linear(z, w1), linear(z, w3), b1, b2), w2)


def expert_ffn(z: torch.Tensor, w: MoEWeights, e: int, ffn=glu_ffn) -> torch.Tensor:
    """One expert on z [N, L] -> [N, L], in z's dtype."""
    return ffn(z, w.w1.dequant(z.dtype, e), w.w3.dequant(z.dtype, e), w.w2.dequant(z.dtype, e), w.b1, w.b2)


def routed_experts(z: torch.Tensor, idx: torch.Tensor, weights: torch.Tensor, w: MoEWeights,
                   ffn=glu_ffn) -> torch.Tensor:
    """y = sum_e w_e * expert_e(z) per token, accumulated in the compute dtype. z [B, L] -> [B, L].
    Loops over the distinct selected experts (each dequantized once); `ffn` may be a compiled glu_ffn."""
    dt = compute_dtype(z, weights)
    y = torch.zeros(z.shape, dtype=dt, device=z.device)
    for e in torch.unique(idx).tolist():
        rows, slot = (idx == e).nonzero(as_tuple=True)
        ye = expert_ffn(z[rows], w, e, ffn).to(dt)
        y.index_add_(0, rows, ye * weights[rows, slot].to(dt).unsqueeze(-1))
    return y


def latent_up(y: torch.Tensor, w: MoEWeights, out_dtype: torch.dtype) -> torch.Tensor:
    """Wup rms(y; routed_norm) in out_dtype."""
    return linear(rms_norm(y, w.routed_norm, w.eps, out_dtype=out_dtype), w.w_up)


def shared_experts(h: torch.Tensor, w: MoEWeights) -> torch.Tensor:
    out = torch.zeros_like(h)
    for s in w.shared:
        out = out + situ_glu_mlp(h, s)
    return out


def moe_forward(h: torch.Tensor, w: MoEWeights, *, return_parts: bool = False, ffn=glu_ffn, router=route):
    """The whole MoE layer (one GPU holding every expert's whole intermediate). h [B, D] -> [B, D]."""
    idx, weights, _ = router(h, w.router)
    z = linear(h, w.w_down)
    y = routed_experts(z, idx, weights, w, ffn)
    routed = latent_up(y, w, h.dtype)
    shared = shared_experts(h, w)
    out = routed + shared
    if return_parts:
        return out, {"idx": idx, "weights": weights, "z": z, "y": y, "routed": routed, "shared": shared}
    return out


def moe_forward_tp(h: torch.Tensor, ranks: list[MoEWeights]) -> torch.Tensor:
    """TP simulated on one device: every rank routes and projects (replicated), computes its partial
    y and partial shared; the partial y are summed (the all-reduce before the routed norm), each
    rank's routed up-projection is the same, and the shared partials are summed."""
    w0 = ranks[0]
    idx, weights, _ = route(h, w0.router)
    z = linear(h, w0.w_down)
    y = sum(routed_experts(z, idx, weights, w) for w in ranks)
    routed = latent_up(y, w0, h.dtype)
    shared = sum(shared_experts(h, w).to(compute_dtype(h)) for w in ranks).to(h.dtype)
    return routed + shared
