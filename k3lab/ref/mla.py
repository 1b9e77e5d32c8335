"""Gated MLA (multi-head latent attention) decode, exact reference, absorbed form. Any dtype; float64
is the oracle. No rotary embedding on either side (NoPE): the "rope" parts are plain dims.

Per token h (the normed layer input), per query head j (Dn = 128, Dr = 64, C = 512, Dv = 128):

    q          = Wuq rms(Wdq h; q_norm)            -> per head [q_nope (Dn) | q_rope (Dr)]
    [c, k_r]   = Wdkv h ;  c = rms(c; kv_norm)     -> the cache entry [c (C) | k_r (Dr)] = 576 values
    q_lat[j]   = q_nope[j] @ Wuk[j]                # Dn -> C (absorbed)
    score_t    = (q_lat[j] . c_t + q_rope[j] . k_r_t) * scale,   scale = (Dn + Dr)^-1/2
    o_lat[j]   = softmax_t(score) . c              # C
    o[j]       = (o_lat[j] @ Wuv[j]) * sigmoid(Wgate h)[j]   # C -> Dv, full-rank elementwise gate
    out        = Wo o

Equivalent non-absorbed form (`mla_decode_naive`, for tests): k_nope_t[j] = c_t @ Wuk[j]^T,
v_t[j] = c_t @ Wuv[j]; score = q_nope . k_nope + q_rope . k_r.

Partials: attention over any subset of positions returns (o_lat, lse) with lse = log sum exp(score);
subsets merge exactly: o = sum_p exp(lse_p - lse) o_p, lse = log sum_p exp(lse_p). Split-KV cuts the
history into `partitions` contiguous pieces; DCP-N gives rank r the positions t with t % N == r
("interleave", as vLLM lays DCP out) or the r-th contiguous slice ("contiguous"); both are merged the
same way. An empty subset has lse = -inf and o = 0. Head padding appends query heads (zeros or random
values) that attend like any other and are dropped; heads are independent, so outputs are unchanged.

Layouts: weights in nn.Linear layout [out, in]; Wuq rows head-major with [nope | rope] inside a head;
Wuk [H, Dn, C]; Wuv [H, C, Dv]; cache [B, S_max, C + Dr]. `lengths` [B] = positions already in the
cache before this step. Multi-token verify (T new positions of one sequence) writes entries at
lengths .. lengths+T-1 and lets new position t see positions <= lengths + t (causal among the new).

Precision: projections in h's dtype; scores, softmax, lse and o_lat in the compute dtype (float32, or
float64 for the oracle); o_lat is cast back to h's dtype for Wuv.

fp8 cache (kv_dtype "fp8"): float8_e4m3fn entries with a float32 scale, dequantized as e4m3 * scale.
Default is a PER-TENSOR static scale (one per layer cache, 1.0 unless given: the vLLM fp8 KV
convention, and what keeps the cache at exactly 576 bytes a position as K3_SPEC section 3 counts it);
a PER-TOKEN scale (amax / 448 of each 576-value entry, stored [B, S_max] float32, +4 bytes a position)
is available with fp8_scale="token". Values beyond 448 * scale saturate.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from k3lab.ref.rmsnorm import compute_dtype, rms_norm
from k3lab.ref.situ import linear

FP8_MAX = 448.0
FP8_SCALES = ("tensor", "token")
DCP_LAYOUTS = ("interleave", "contiguous")


@dataclass
class MLAWeights:
    """One gated MLA layer on one GPU (H local query heads; the down-projections are replicated)."""

    w_dq: torch.Tensor  # [Q, D]
    q_norm: torch.Tensor  # [Q]
    w_uq: torch.Tensor  # [H*(Dn+Dr), Q]
    w_dkv: torch.Tensor  # [C+Dr, D]
    kv_norm: torch.Tensor  # [C]
    w_uk: torch.Tensor  # [H, Dn, C]
    w_uv: torch.Tensor  # [H, C, Dv]
    w_gate: torch.Tensor  # [H*Dv, D]
    w_o: torch.Tensor  # [D, H*Dv]
    qk_rope_dim: int = 64
    eps: float = 1e-6

    @property
    def heads(self) -> int:
        return self.w_uk.shape[0]

    @property
    def nope_dim(self) -> int:
        return self.w_uk.shape[1]

    @property
    def rope_dim(self) -> int:
        return self.qk_rope_dim

    @property
    def kv_lora(self) -> int:
        return self.w_uk.shape[2]

    @property
    def v_dim(self) -> int:
        return self.w_uv.shape[2]

    @property
    def entry_width(self) -> int:
        return self.kv_lora + self.rope_dim

    @property
    def scale(self) -> float:
        return 1.0 / math.sqrt(self.nope_dim + self.rope_dim)

    def tensors(self) -> dict[str, torch.Tensor]:
        return {k: getattr(self, k) for k in ("w_dq", "q_norm", "w_uq", "w_dkv", "kv_norm", "w_uk", "w_uv",
                                              "w_gate", "w_o")}

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors().values())


@dataclass
class MLACache:
    """Latent cache [B, S_max, C+Dr] plus, for fp8, its scale (0-d per-tensor or [B, S_max] per-token)."""

    data: torch.Tensor
    scale: torch.Tensor | None = None

    def __post_init__(self) -> None:
        if self.data.dim() != 3:
            raise ValueError(f"MLACache.data must be [B, S_max, width], got shape {tuple(self.data.shape)}")
        if self.is_fp8 and self.scale is None:
            raise ValueError("MLACache: an fp8 cache needs a scale (0-d per-tensor or [B, S_max] per-token)")

    @property
    def is_fp8(self) -> bool:
        return self.data.dtype == torch.float8_e4m3fn

    @property
    def scale_mode(self) -> str | None:
        if not self.is_fp8:
            return None
        return "tensor" if self.scale.dim() == 0 else "token"

    @property
    def capacity(self) -> int:
        return self.data.shape[1]

    @classmethod
    def empty(cls, batch: int, capacity: int, width: int, *, dtype=torch.bfloat16, device="cpu",
              kv_dtype: str | None = None, fp8_scale: str = "tensor", tensor_scale: float = 1.0) -> MLACache:
        """kv_dtype "fp8" stores float8_e4m3fn (fp8_scale "tensor" or "token"); otherwise `dtype`."""
        if kv_dtype == "fp8":
            if fp8_scale not in FP8_SCALES:
                raise ValueError(f"MLACache.empty: fp8_scale must be one of {FP8_SCALES}, got {fp8_scale!r}")
            data = torch.zeros(batch, capacity, width, dtype=torch.float8_e4m3fn, device=device)
            if fp8_scale == "tensor":
                scale = torch.tensor(float(tensor_scale), dtype=torch.float32, device=device)
            else:
                scale = torch.ones(batch, capacity, dtype=torch.float32, device=device)
            return cls(data, scale)
        if kv_dtype not in (None, "bf16"):
            raise ValueError(f"MLACache.empty: kv_dtype must be 'bf16' or 'fp8', got {kv_dtype!r}")
        return cls(torch.zeros(batch, capacity, width, dtype=dtype, device=device))

    def write(self, lengths: torch.Tensor, entries: torch.Tensor) -> None:
        """In place: entries [B, T, W] go to positions lengths[b] .. lengths[b]+T-1."""
        B, T, W = entries.shape
        if W != self.data.shape[2] or B != self.data.shape[0]:
            raise ValueError(f"MLACache.write: entries {tuple(entries.shape)} do not fit cache "
                             f"{tuple(self.data.shape)}")
        if int(lengths.max()) + T > self.capacity:
            raise ValueError(f"MLACache.write: writing {T} positions after length {int(lengths.max())} "
                             f"exceeds the capacity {self.capacity}")
        pos = lengths.to(torch.long)[:, None] + torch.arange(T, device=entries.device)  # [B, T]
        bidx = torch.arange(B, device=entries.device)[:, None].expand(B, T)
        if not self.is_fp8:
            self.data[bidx, pos] = entries.to(self.data.dtype)
            return
        ef = entries.to(torch.float32)
        if self.scale_mode == "tensor":
            s = self.scale
        else:
            s = (ef.abs().amax(-1) / FP8_MAX).clamp_min(1e-12)  # [B, T]
            self.scale[bidx, pos] = s
            s = s.unsqueeze(-1)
        self.data[bidx, pos] = (ef / s).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)

    def read(self, dtype: torch.dtype) -> torch.Tensor:
        """The whole cache dequantized to `dtype`."""
        if not self.is_fp8:
            return self.data.to(dtype)
        s = self.scale if self.scale_mode == "tensor" else self.scale.unsqueeze(-1)
        return (self.data.to(dtype) * s.to(dtype))

    def nbytes(self) -> int:
        n = self.data.numel() * self.data.element_size()
        return n + (0 if self.scale is None else self.scale.numel() * self.scale.element_size())


# ---- projections -------------------------------------------------------------------------------

def mla_q(h: torch.Tensor, w: MLAWeights) -> tuple[torch.Tensor, torch.Tensor]:
    """h [..., D] -> (q_nope [..., H, Dn], q_rope [..., H, Dr]) in h's dtype."""
    cq = rms_norm(linear(h, w.w_dq), w.q_norm, w.eps)
    q = linear(cq, w.w_uq).unflatten(-1, (w.heads, w.nope_dim + w.rope_dim))
    return q[..., : w.nope_dim], q[..., w.nope_dim:]


def mla_kv_entry(h: torch.Tensor, w: MLAWeights) -> torch.Tensor:
    """h [..., D] -> cache entry [..., C + Dr] = [rms(c; kv_norm) | k_rope] in h's dtype."""
    ckv = linear(h, w.w_dkv)
    c = rms_norm(ckv[..., : w.kv_lora], w.kv_norm, w.eps)
    return torch.cat([c, ckv[..., w.kv_lora:]], dim=-1)


def absorb_q(q_nope: torch.Tensor, w: MLAWeights) -> torch.Tensor:
    """q_lat[..., j, :] = q_nope[..., j, :] @ Wuk[j]: [..., H, Dn] -> [..., H, C]."""
    return torch.einsum("...hn,hnc->...hc", q_nope, w.w_uk.to(q_nope.dtype))


def mla_out(o_lat: torch.Tensor, h: torch.Tensor, w: MLAWeights) -> torch.Tensor:
    """(o_lat[j] @ Wuv[j]) * sigmoid(Wgate h)[j], then Wo. o_lat [..., H, C], h [..., D] -> [..., D]."""
    o = torch.einsum("...hc,hcv->...hv", o_lat.to(h.dtype), w.w_uv.to(h.dtype))
    gate = torch.sigmoid(linear(h, w.w_gate))
    return linear(o.flatten(-2) * gate, w.w_o)


# ---- attention over the latent cache ----------------------------------------------------------

def attend(q_lat: torch.Tensor, q_rope: torch.Tensor, kv: torch.Tensor, pos: torch.Tensor,
           limit: torch.Tensor, scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention of queries over the cache positions `pos` that are <= `limit`.

    q_lat [B,T,H,C], q_rope [B,T,H,Dr], kv [B,S,C+Dr] (dequantized), pos [S] global positions of kv's
    rows, limit [B,T] the last position each query may see. Returns (o_lat [B,T,H,C], lse [B,T,H]) in
    the compute dtype; rows that see nothing get o = 0, lse = -inf."""
    dt = compute_dtype(q_lat, kv)
    C = q_lat.shape[-1]
    kv = kv.to(dt)
    c, kr = kv[..., :C], kv[..., C:]
    s = (torch.einsum("bthc,bsc->bths", q_lat.to(dt), c)
         + torch.einsum("bthr,bsr->bths", q_rope.to(dt), kr)) * scale
    valid = pos.view(1, 1, 1, -1) <= limit[:, :, None, None]  # [B,T,1,S]
    s = s.masked_fill(~valid, float("-inf"))
    m = s.amax(-1, keepdim=True) if s.shape[-1] else torch.full(s.shape[:-1] + (1,), float("-inf"), dtype=dt,
                                                                  device=s.device)
    m = torch.where(torch.isfinite(m), m, torch.zeros_like(m))
    p = torch.exp(s - m)
    l = p.sum(-1)
    o = torch.einsum("bths,bsc->bthc", p, c) / l.clamp_min(torch.finfo(dt).tiny).unsqueeze(-1)
    lse = m.squeeze(-1) + torch.log(l)
    return o, lse


def merge(parts: list[tuple[torch.Tensor, torch.Tensor]]) -> tuple[torch.Tensor, torch.Tensor]:
    """Merge partials (o [...,C], lse [...]) over disjoint position subsets by their log-sum-exp."""
    lses = torch.stack([lse for _, lse in parts])  # [P, ...]
    lse = torch.logsumexp(lses, dim=0)
    safe = torch.where(torch.isfinite(lse), lse, torch.zeros_like(lse))
    wts = torch.exp(lses - safe)  # exp(-inf) = 0 for empty partials
    o = sum(wts[i].unsqueeze(-1) * parts[i][0] for i in range(len(parts)))
    return o, lse


def partition_bounds(n_positions: int, partitions: int) -> list[tuple[int, int]]:
    """Contiguous split-KV pieces of [0, n_positions): `partitions` pieces of ceil(n / P)."""
    size = max(1, -(-n_positions // partitions))
    return [(min(p * size, n_positions), min((p + 1) * size, n_positions)) for p in range(partitions)]


def dcp_shard_positions(n_positions: int, n_ranks: int, layout: str = "interleave") -> list[torch.Tensor]:
    """The global positions each DCP rank holds."""
    if layout not in DCP_LAYOUTS:
        raise ValueError(f"dcp layout must be one of {DCP_LAYOUTS}, got {layout!r}")
    if layout == "interleave":
        return [torch.arange(r, n_positions, n_ranks) for r in range(n_ranks)]
    return [torch.arange(a, b) for a, b in partition_bounds(n_positions, n_ranks)]


def pad_query_heads(q_lat, q_rope, heads: int, fill: str = "zeros", seed: int = 0):
    """Append query heads up to `heads` (zeros, or random values with fill="random")."""
    H = q_lat.shape[-2]
    if heads < H:
        raise ValueError(f"pad_heads={heads} must be >= the {H} query heads (0 = no padding)")
    if heads == H:
        return q_lat, q_rope
    extra = heads - H

    def pad(q):
        shape = q.shape[:-2] + (extra, q.shape[-1])
        if fill == "zeros":
            z = torch.zeros(shape, dtype=q.dtype, device=q.device)
        elif fill == "random":
            gen = torch.Generator(device="cpu").manual_seed(seed)
            z = torch.randn(shape, generator=gen).to(device=q.device, dtype=q.dtype)
        else:
            raise ValueError(f"pad fill must be 'zeros' or 'random', got {fill!r}")
        return torch.cat([q, z], dim=-2)

    return pad(q_lat), pad(q_rope)


def mla_attend(q_lat: torch.Tensor, q_rope: torch.Tensor, kv: torch.Tensor, lengths: torch.Tensor, *,
               scale: float, partitions: int = 1, dcp: int = 1, dcp_layout: str = "interleave",
               pad_heads: int = 0, pad_fill: str = "zeros",
               n_positions: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention of T new positions per sequence over the cache, query t seeing positions <= lengths+t.

    q_lat [B,T,H,C], q_rope [B,T,H,Dr], kv [B,S,C+Dr] dequantized (the new entries already written),
    lengths [B]. dcp > 1 shards positions over `dcp` simulated ranks; partitions > 1 splits each rank's
    positions into contiguous pieces; pad_heads > H pads the query heads. n_positions = max(lengths) + T
    when the caller knows it (saves a host sync; keeps torch.compile graphs whole). Returns (o_lat, lse)."""
    _B, T, H, _ = q_lat.shape
    if pad_heads:
        q_lat, q_rope = pad_query_heads(q_lat, q_rope, pad_heads, pad_fill)
    if partitions < 1 or dcp < 1:
        raise ValueError(f"partitions and dcp must be >= 1, got partitions={partitions}, dcp={dcp}")
    lengths = lengths.to(torch.long).to(kv.device)
    limit = lengths[:, None] + torch.arange(T, device=kv.device)  # [B, T]
    n = int(limit.max()) + 1 if n_positions is None else n_positions  # positions any query can see
    parts = []
    for rank_pos in dcp_shard_positions(n, dcp, dcp_layout):
        rank_pos = rank_pos.to(kv.device)
        rank_kv = kv[:, rank_pos]  # rank r's shard of the cache
        for a, b in partition_bounds(rank_pos.numel(), partitions):
            parts.append(attend(q_lat, q_rope, rank_kv[:, a:b], rank_pos[a:b], limit, scale))
    o, lse = merge(parts) if len(parts) > 1 else parts[0]
    return o[..., :H, :], lse[..., :H]


# ---- the layer's attention ----------------------------------------------------------------------

def _as_lengths(lengths, batch: int, device) -> torch.Tensor:
    if isinstance(lengths, int):
        return torch.full((batch,), lengths, dtype=torch.long, device=device)
    if lengths.shape != (batch,):
        raise ValueError(f"lengths must be an int or shape [{batch}], got {tuple(lengths.shape)}")
    return lengths.to(device=device, dtype=torch.long)


def mla_verify(h: torch.Tensor, w: MLAWeights, cache: MLACache, lengths, **attend_kw) -> torch.Tensor:
    """T positions per sequence: h [B,T,D] -> out [B,T,D]. Writes the T entries into `cache` in place
    (the caller advances lengths by however many it accepts)."""
    B, _T, _ = h.shape
    lengths = _as_lengths(lengths, B, h.device)
    q_nope, q_rope = mla_q(h, w)
    q_lat = absorb_q(q_nope, w)
    cache.write(lengths, mla_kv_entry(h, w))
    kv = cache.read(compute_dtype(h))
    o_lat, _ = mla_attend(q_lat, q_rope, kv, lengths, scale=w.scale, **attend_kw)
    return mla_out(o_lat, h, w)


def mla_decode(h: torch.Tensor, w: MLAWeights, cache: MLACache, lengths, **attend_kw) -> torch.Tensor:
    """One position: h [B,D] -> out [B,D]; writes the entry at lengths[b] in place."""
    return mla_verify(h.unsqueeze(1), w, cache, lengths, **attend_kw).squeeze(1)


def mla_decode_naive(h: torch.Tensor, w: MLAWeights, cache: MLACache, lengths) -> torch.Tensor:
    """Non-absorbed single-position form (per head decompressed keys and values), for tests."""
    B = h.shape[0]
    lengths = _as_lengths(lengths, B, h.device)
    q_nope, q_rope = mla_q(h, w)
    cache.write(lengths, mla_kv_entry(h, w).unsqueeze(1))
    dt = compute_dtype(h)
    kv = cache.read(dt)
    c, kr = kv[..., : w.kv_lora], kv[..., w.kv_lora:]
    k_nope = torch.einsum("bsc,hnc->bhsn", c, w.w_uk.to(dt))
    v = torch.einsum("bsc,hcv->bhsv", c, w.w_uv.to(dt))
    s = (torch.einsum("bhn,bhsn->bhs", q_nope.to(dt), k_nope)
         + torch.einsum("bhr,bsr->bhs", q_rope.to(dt), kr)) * w.scale
    valid = torch.arange(kv.shape[1], device=h.device)[None, None, :] <= lengths[:, None, None]
    p = torch.softmax(s.masked_fill(~valid, float("-inf")), dim=-1)
    o = torch.einsum("bhs,bhsv->bhv", p, v).to(h.dtype)
    gate = torch.sigmoid(linear(h, w.w_gate))
    return linear(o.flatten(-2) * gate, w.w_o)
