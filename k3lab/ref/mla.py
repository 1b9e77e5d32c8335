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
convention, and what keeps the cache at exactly 576 bytes a position as docs/MODEL.md, One GPU's share counts it);
a PER-TOKEN scale (amax / 448 of each 576-value entry, stored [B, S_max] float32, +4 bytes a position)
is available with fp8_scale="token". Values beyond 448 * scale saturate. Quantization rounds to nearest
(ties to even) once, from the compute dtype: `fp8_quantize`.

Paged cache (`PagedMLACache`): one pool of pages [n_pages, page_size, C+Dr] shared by the batch and a
block table [B, max_pages] int32; position t of sequence b lives in row t % page_size of page
block_table[b, t // page_size]. fp8 scales are per tensor (0-d) or per token ([n_pages, page_size],
beside the pool rows). `read` gathers the pages into the contiguous [B, max_pages * page_size, C+Dr]
form, so every reference here runs on either cache; `PagedMLACache.from_contiguous` pages a contiguous
cache (pages in a shuffled order, so a kernel that ignores the table fails).

Garbage beyond a sequence's visible positions (a shorter sequence of a ragged batch, the unused tail of
its last page) never reaches the maths: `attend` zeroes the rows no query of the sequence may see
before the products (0 * NaN would otherwise be NaN).
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


def fp8_quantize(entries: torch.Tensor, scale_mode: str, tensor_scale: torch.Tensor | float | None = None
                 ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Entries [..., W] -> (float8_e4m3fn [..., W], per-token scales [...] or None), rounding once to
    nearest. "tensor": e4m3(clamp(x / tensor_scale, +-448)); "token": s = max(amax(|x|) / 448, 1e-12)
    over each entry's W values, e4m3(clamp(x / s, +-448)). Computed in entries' dtype (fp64 for the
    oracle, fp32 otherwise)."""
    ef = entries if entries.dtype == torch.float64 else entries.to(torch.float32)
    if scale_mode == "tensor":
        s = torch.as_tensor(tensor_scale, dtype=ef.dtype, device=ef.device)
        return (ef / s).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn), None
    if scale_mode != "token":
        raise ValueError(f"fp8 scale mode must be one of {FP8_SCALES}, got {scale_mode!r}")
    s = (ef.abs().amax(-1) / FP8_MAX).clamp_min(1e-12)
    return (ef / s.unsqueeze(-1)).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn), s


@dataclass
class MLACache:
    """Latent cache [B, S_max, C+Dr] plus, for fp8, its scale (0-d per-tensor or [B, S_max] per-token)."""

    data: torch.Tensor
    scale: torch.Tensor | None = None

    def __post_init__(self) -> None:
        if self.data.dim() != 3:
            raise ValueError(f"MLACache.data must be [B, S_max, width], got shape {tuple(self.data.shape)}")
        if not self.data.is_floating_point():
            raise ValueError(f"MLACache.data must be a floating tensor (bf16, fp8 e4m3, ...), got {self.data.dtype}")
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
        q, s = fp8_quantize(entries, self.scale_mode, self.scale)
        if s is not None:
            self.scale[bidx, pos] = s.to(self.scale.dtype)
        self.data[bidx, pos] = q

    def read(self, dtype: torch.dtype) -> torch.Tensor:
        """The whole cache dequantized to `dtype`."""
        if not self.is_fp8:
            return self.data.to(dtype)
        s = self.scale if self.scale_mode == "tensor" else self.scale.unsqueeze(-1)
        return (self.data.to(dtype) * s.to(dtype))

    def nbytes(self) -> int:
        n = self.data.numel() * self.data.element_size()
        return n + (0 if self.scale is None else self.scale.numel() * self.scale.element_size())

    @property
    def batch(self) -> int:
        return self.data.shape[0]

    @property
    def width(self) -> int:
        return self.data.shape[2]

    @property
    def dtype(self) -> torch.dtype:
        return self.data.dtype

    @property
    def device(self) -> torch.device:
        return self.data.device

    def clone(self) -> MLACache:
        return MLACache(self.data.clone(), None if self.scale is None else self.scale.clone())


@dataclass
class PagedMLACache:
    """Paged latent cache (module docstring): pool [n_pages, page_size, C+Dr] (bf16, fp8 e4m3 or any float
    dtype for the oracle), block_table [B, max_pages] int32 (page ids into the pool; entries past a
    sequence's pages may hold any valid id), and for fp8 its scale: 0-d per-tensor, or [n_pages, page_size]
    per-token float32. Capacity per sequence = max_pages * page_size."""

    pool: torch.Tensor
    block_table: torch.Tensor
    scale: torch.Tensor | None = None

    def __post_init__(self) -> None:
        if self.pool.dim() != 3:
            raise ValueError(f"PagedMLACache.pool must be [n_pages, page_size, width], got {tuple(self.pool.shape)}")
        if not self.pool.is_floating_point():
            raise ValueError(f"PagedMLACache.pool must be a floating tensor (bf16, fp8 e4m3, ...), got "
                             f"{self.pool.dtype}")
        if self.block_table.dim() != 2 or self.block_table.dtype != torch.int32:
            raise ValueError(f"PagedMLACache.block_table must be [B, max_pages] int32, got "
                             f"{tuple(self.block_table.shape)} {self.block_table.dtype}")
        if self.is_fp8 and self.scale is None:
            raise ValueError("PagedMLACache: an fp8 cache needs a scale (0-d per-tensor or [n_pages, page_size])")
        if self.scale is not None and self.scale.dim() not in (0, 2):
            raise ValueError(f"PagedMLACache.scale must be 0-d or [n_pages, page_size], got {tuple(self.scale.shape)}")

    @property
    def is_fp8(self) -> bool:
        return self.pool.dtype == torch.float8_e4m3fn

    @property
    def scale_mode(self) -> str | None:
        if not self.is_fp8:
            return None
        return "tensor" if self.scale.dim() == 0 else "token"

    @property
    def page_size(self) -> int:
        return self.pool.shape[1]

    @property
    def capacity(self) -> int:
        return self.block_table.shape[1] * self.page_size

    @property
    def batch(self) -> int:
        return self.block_table.shape[0]

    @property
    def width(self) -> int:
        return self.pool.shape[2]

    @property
    def dtype(self) -> torch.dtype:
        return self.pool.dtype

    @property
    def device(self) -> torch.device:
        return self.pool.device

    @classmethod
    def empty(cls, batch: int, capacity: int, width: int, page_size: int, *, dtype=torch.bfloat16, device="cpu",
              kv_dtype: str | None = None, fp8_scale: str = "tensor", tensor_scale: float = 1.0,
              spare_pages: int = 0, seed: int = 0) -> PagedMLACache:
        """ceil(capacity / page_size) pages per sequence plus `spare_pages` unused ones, handed out in a
        shuffled order (seeded)."""
        if page_size < 1:
            raise ValueError(f"PagedMLACache.empty: page_size must be >= 1, got {page_size}")
        per_seq = -(-capacity // page_size)
        n_pages = batch * per_seq + spare_pages
        perm = torch.randperm(n_pages, generator=torch.Generator().manual_seed(seed))[: batch * per_seq]
        table = perm.view(batch, per_seq).to(device=device, dtype=torch.int32)
        c = MLACache.empty(n_pages, page_size, width, dtype=dtype, device=device, kv_dtype=kv_dtype,
                           fp8_scale=fp8_scale, tensor_scale=tensor_scale)
        return cls(c.data, table, c.scale)

    @classmethod
    def from_contiguous(cls, cache: MLACache, page_size: int, *, spare_pages: int = 0, seed: int = 0,
                        fill: float | None = None) -> PagedMLACache:
        """The same entries (and scales) paged: page j of sequence b holds positions j*page_size.. of
        cache.data[b]. `fill` (e.g. NaN) fills the spare pages (by default zeros)."""
        B, S, W = cache.data.shape
        pc = cls.empty(B, S, W, page_size, dtype=cache.data.dtype, device=cache.data.device,
                       kv_dtype="fp8" if cache.is_fp8 else None, fp8_scale=cache.scale_mode or "tensor",
                       spare_pages=spare_pages, seed=seed)
        if fill is not None:
            pc.pool.copy_(torch.full(pc.pool.shape, fill, dtype=torch.float32, device=pc.pool.device).to(pc.pool.dtype))
        per_seq = pc.block_table.shape[1]
        pad = per_seq * page_size - S
        src = cache.data if pad == 0 else torch.cat(
            [cache.data, torch.zeros(B, pad, W, dtype=cache.data.dtype, device=cache.data.device)], 1)
        idx = pc.block_table.long()
        pc.pool[idx] = src.view(B, per_seq, page_size, W)
        if cache.scale_mode == "token":
            ssrc = torch.cat([cache.scale, cache.scale.new_ones(B, pad)], 1) if pad else cache.scale
            pc.scale[idx] = ssrc.view(B, per_seq, page_size)
        elif cache.scale_mode == "tensor":
            pc.scale.copy_(cache.scale)
        return pc

    def rows(self, pos: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(page, slot) of positions pos [B, ...] (long)."""
        b = torch.arange(pos.shape[0], device=pos.device).view(-1, *([1] * (pos.dim() - 1)))
        page = self.block_table.to(pos.device).long()[b, pos // self.page_size]
        return page, pos % self.page_size

    def write(self, lengths: torch.Tensor, entries: torch.Tensor) -> None:
        """In place: entries [B, T, W] go to positions lengths[b] .. lengths[b]+T-1 (through the table)."""
        B, T, W = entries.shape
        if W != self.width or B != self.batch:
            raise ValueError(f"PagedMLACache.write: entries {tuple(entries.shape)} do not fit cache of batch "
                             f"{self.batch}, width {self.width}")
        if int(lengths.max()) + T > self.capacity:
            raise ValueError(f"PagedMLACache.write: writing {T} positions after length {int(lengths.max())} "
                             f"exceeds the capacity {self.capacity}")
        pos = lengths.to(device=entries.device, dtype=torch.long)[:, None] + torch.arange(T, device=entries.device)
        page, slot = self.rows(pos)
        if not self.is_fp8:
            self.pool[page, slot] = entries.to(self.pool.dtype)
            return
        q, s = fp8_quantize(entries, self.scale_mode, self.scale)
        if s is not None:
            self.scale[page, slot] = s.to(self.scale.dtype)
        self.pool[page, slot] = q

    def read(self, dtype: torch.dtype) -> torch.Tensor:
        """The whole cache gathered through the block table, [B, capacity, W], dequantized to `dtype`."""
        idx = self.block_table.long()
        B, n = idx.shape
        x = self.pool[idx].reshape(B, n * self.page_size, self.width).to(dtype)
        if self.scale_mode == "tensor":
            x = x * self.scale.to(dtype)
        elif self.scale_mode == "token":
            x = x * self.scale[idx].reshape(B, n * self.page_size, 1).to(dtype)
        return x

    def nbytes(self) -> int:
        n = self.pool.numel() * self.pool.element_size() + self.block_table.numel() * 4
        return n + (0 if self.scale is None else self.scale.numel() * self.scale.element_size())

    def clone(self) -> PagedMLACache:
        return PagedMLACache(self.pool.clone(), self.block_table.clone(),
                             None if self.scale is None else self.scale.clone())


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


def mla_query(cq: torch.Tensor, q_norm: torch.Tensor, w_uq: torch.Tensor, w_uk: torch.Tensor,
              eps: float = 1e-6) -> tuple[torch.Tensor, torch.Tensor]:
    """The absorbed query step after the q down-projection: cq [..., Q] -> (q_lat [..., H, C], q_rope [..., H, Dr])
    = absorb_q of the nope part of Wuq rms(cq; q_norm), and its rope part (mla_q's last two steps, then absorb_q).
    Each step in the inputs' dtype (fp64 for the oracle): the unfused path rounds rms(cq) and q_nope."""
    H, Dn, _ = w_uk.shape
    q = linear(rms_norm(cq, q_norm, eps), w_uq).unflatten(-1, (H, -1))
    q_lat = torch.einsum("...hn,hnc->...hc", q[..., :Dn], w_uk.to(q.dtype))
    return q_lat, q[..., Dn:]


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
    seen = pos.view(1, -1) <= limit.amax(1, keepdim=True)  # [B,S]: rows some query of the sequence sees
    kv = torch.where(seen[..., None], kv.to(dt), torch.zeros((), dtype=dt, device=kv.device))
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
    if layout == "interleave":  # a rank past the history (n_positions < n_ranks) holds nothing
        return [torch.arange(min(r, n_positions), n_positions, n_ranks) for r in range(n_ranks)]
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
    o, lse = mla_attend_partials(q_lat, q_rope, kv, lengths, scale=scale, partitions=partitions, dcp=dcp,
                                 dcp_layout=dcp_layout, pad_heads=pad_heads, pad_fill=pad_fill,
                                 n_positions=n_positions)
    if o.shape[1] == 1:
        return o[:, 0], lse[:, 0]
    return merge_stacked(o, lse)


def mla_attend_partials(q_lat: torch.Tensor, q_rope: torch.Tensor, kv: torch.Tensor, lengths: torch.Tensor, *,
                        scale: float, partitions: int = 1, dcp: int = 1, dcp_layout: str = "interleave",
                        pad_heads: int = 0, pad_fill: str = "zeros", n_positions: int | None = None
                        ) -> tuple[torch.Tensor, torch.Tensor]:
    """`mla_attend` before its merge: the partials stacked, (o [B,K,T,H,C], lse [B,K,T,H]) with
    K = dcp * partitions, k = rank * partitions + piece. Each DCP rank attends all heads over its own
    positions (as one GPU of DCP-N would), cut into `partitions` contiguous pieces; an empty piece or
    rank (a history shorter than the ranks) is an empty partial: o = 0, lse = -inf."""
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
    o = torch.stack([p[0][..., :H, :] for p in parts], 1)
    lse = torch.stack([p[1][..., :H] for p in parts], 1)
    return o, lse


def merge_stacked(o: torch.Tensor, lse: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """`merge` of stacked partials: o [B,K,...,C], lse [B,K,...] -> (o [B,...,C], lse [B,...])."""
    out = lse.logsumexp(1)
    safe = torch.where(torch.isfinite(out), out, torch.zeros_like(out))
    wts = torch.exp(lse - safe.unsqueeze(1))  # empty partials (lse = -inf) weigh 0
    return (wts.unsqueeze(-1) * o).sum(1), out


def mla_combine(o_parts: torch.Tensor, lse_parts: torch.Tensor, w_uv: torch.Tensor,
                gate_logits: torch.Tensor) -> torch.Tensor:
    """The combine: partials (o [B,K,T,H,C], lse [B,K,T,H]) merged by log-sum-exp, then per head
    o[h] @ Wuv[h] (C -> Dv) times sigmoid(gate_logits) ([B,T,H*Dv]): what the output projection reads,
    [B,T,H*Dv], in the compute dtype (the math of `mla_out` before Wo, without its bf16 cast of o_lat)."""
    dt = compute_dtype(o_parts, gate_logits)
    o, _ = merge_stacked(o_parts.to(dt), lse_parts.to(dt))
    y = torch.einsum("bthc,hcv->bthv", o, w_uv.to(dt)).flatten(-2)
    return y * torch.sigmoid(gate_logits.to(dt))


def mla_cache_entry(kv: torch.Tensor, kv_norm: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """The kv down-projection's output [..., C+Dr] -> the cache entry [rms(c; kv_norm) | k_rope] in the
    compute dtype (fp64 stays fp64, else fp32): what the cache write stores before its rounding."""
    C = kv_norm.shape[0]
    dt = compute_dtype(kv, kv_norm)
    return torch.cat([rms_norm(kv[..., :C].to(dt), kv_norm.to(dt), eps), kv[..., C:].to(dt)], dim=-1)


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
