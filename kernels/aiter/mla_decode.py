"""AITER (ROCm) adapter for the gated-MLA decode attention: AITER's `aiter.mla.mla_decode_fwd` over our latent
cache, with the query heads padded to 16 and DCP shards merged by log-sum-exp, sharing k3lab's padding
(`k3lab.ref.mla.pad_query_heads`), shard layout (`dcp_shard_positions`) and merge (`merge`).

What it hands AITER, per DCP shard r (one call each; dcp = 1 is one call):
  q          [B*T, 16, C+Dr] bf16: q_lat | q_rope, heads H..15 zero (padded rows are cropped, never used)
  kv_buffer  the cache rows viewed as [rows, 1, 1, C+Dr] (page size 1): a contiguous cache [B, S, W] is
             B*S rows, a paged pool [n_pages, PAGE, W] is n_pages*PAGE rows. With page size 1 every position
             list is expressible, so paged caches of any page size and both DCP layouts go through one path.
  kv_indices the row of each visible position the shard holds (sequence by sequence), kv_indptr its CSR
             offsets, kv_last_page_lens all ones, qo_indptr = T per sequence, max_seqlen_q = T
  o          [B*T, 16, C] bf16 (AITER's output dtype), return_lse=True for the merge.
The adapter returns o_lat [B,T,H,C] fp32 and lse [B,T,H] fp32, like the Triton kernel.

Limits, refused by name before any call: bf16 caches only (AITER's fp8 MLA takes its own scale layout: not
mapped); T > 1 only without DCP (AITER's multi-token decode masks causally over the LAST T entries of a
sequence's list, which a DCP shard does not end with). A sequence with no positions in a shard (a history
shorter than the shards) is an empty partial (o = 0, lse = -inf) and is not handed to AITER.

Not graph-capturable: the index lists are built on the host side of torch (their total length is data). It
cannot run on this project's machines (CUDA): `k3lab.components.mla` refuses backend "aiter" there with a
message; the tests run everything around the call against a stand-in with AITER's documented contract.

Floor: the cache bytes of the visible positions (as the Triton kernel), read once per shard.
"""
from __future__ import annotations

import importlib
from typing import Any

import torch

from k3lab.ref import mla as ref

AITER_HEADS = 16


def load_aiter() -> Any:
    """The `aiter` package (ROCm only). ImportError with the reason when absent."""
    try:
        return importlib.import_module("aiter.mla")
    except Exception as e:  # noqa: BLE001 - ImportError, or a ROCm build failing at import
        raise ImportError(f"AITER is not importable here ({type(e).__name__}: {e}); it runs on AMD ROCm GPUs") from e


def _store(cache) -> torch.Tensor:
    """The tensor holding the rows: the page pool of a paged cache, the [B, S, W] tensor of a contiguous one."""
    return cache.pool if isinstance(cache, ref.PagedMLACache) else cache.data


def _rows_view(cache) -> torch.Tensor:
    """The cache rows as AITER's page-size-1 buffer [rows, 1, 1, W]."""
    W = cache.width
    return _store(cache).reshape(-1, W).view(-1, 1, 1, W)


def _row_index(cache, b: int, pos: torch.Tensor) -> torch.Tensor:
    """Rows of positions `pos` of sequence b in `_rows_view(cache)`."""
    if isinstance(cache, ref.PagedMLACache):
        page, slot = cache.rows(pos.view(1, -1).expand(cache.batch, -1).contiguous())
        return (page[b] * cache.page_size + slot[b]).long()
    return (b * cache.capacity + pos).long()


def shard_metadata(cache, lengths: list[int], T: int, shard: int, dcp: int, layout: str):
    """(qo_indptr, kv_indptr, kv_indices, kv_last_page_lens, counts) for one DCP shard: the rows of the
    visible positions (< lengths[b] + T) the shard holds, sequence by sequence; counts[b] = how many."""
    idx, counts = [], []
    for b, n in enumerate(lengths):
        pos = ref.dcp_shard_positions(n + T, dcp, layout)[shard].to(_store(cache).device)
        idx.append(_row_index(cache, b, pos))
        counts.append(int(pos.numel()))
    dev = _store(cache).device
    kv_indices = torch.cat(idx).to(torch.int32) if idx else torch.zeros(0, dtype=torch.int32, device=dev)
    kv_indptr = torch.tensor([0] + counts, dtype=torch.int64).cumsum(0).to(torch.int32).to(dev)
    qo_indptr = torch.arange(0, (len(lengths) + 1) * T, T, dtype=torch.int32, device=dev)
    last = torch.ones(len(lengths), dtype=torch.int32, device=dev)
    return qo_indptr, kv_indptr, kv_indices, last, counts


def mla_decode(q_lat: torch.Tensor, q_rope: torch.Tensor, cache, lengths: torch.Tensor, *, scale: float,
               dcp: int = 1, dcp_layout: str = "interleave", num_kv_splits: int | None = None,
               aiter_mla: Any = None) -> tuple[torch.Tensor, torch.Tensor]:
    """o_lat [B,T,H,C] fp32, lse [B,T,H] fp32 of q_lat [B,T,H,C] / q_rope [B,T,H,Dr] over `cache`
    (k3lab.ref.mla.MLACache or PagedMLACache, bf16, the T new entries already written), query t of sequence b
    seeing positions <= lengths[b] + t. `aiter_mla` = the aiter.mla module (default: imported). The caller
    (k3lab.components.mla) validates the arguments; this function checks what only AITER imposes."""
    mod = aiter_mla if aiter_mla is not None else load_aiter()
    B, T, H, C = q_lat.shape
    if H > AITER_HEADS:
        raise ValueError(f"aiter mla_decode: q_lat has {H} heads; AITER's kernel takes at most {AITER_HEADS}")
    if cache.dtype != torch.bfloat16:
        raise ValueError(f"aiter mla_decode: 'cache' must be bf16 (AITER's fp8 MLA scale layout is not mapped), "
                         f"got {cache.dtype}")
    if T > 1 and dcp > 1:
        raise ValueError("aiter mla_decode: T > 1 with dcp > 1 is not supported (AITER masks causally over the "
                         "last T entries of each list; a DCP shard does not end with the new positions)")
    ql, qr = ref.pad_query_heads(q_lat, q_rope, AITER_HEADS)  # the shared padding: zero query heads
    q = torch.cat([ql, qr], dim=-1).to(torch.bfloat16).reshape(B * T, AITER_HEADS, -1).contiguous()
    kv = _rows_view(cache)
    lens = [int(x) for x in lengths.tolist()]
    parts = []
    for r in range(dcp):
        qo, kvp, kvi, last, counts = shard_metadata(cache, lens, T, r, dcp, dcp_layout)
        o = torch.zeros(B * T, AITER_HEADS, C, dtype=torch.bfloat16, device=q.device)
        if sum(counts):
            res = mod.mla_decode_fwd(q, kv, o, qo, kvp, kvi, last, T, page_size=1, sm_scale=float(scale),
                                     num_kv_splits=num_kv_splits, return_lse=True)
            lse = _lse_of(res, B * T)
        else:
            lse = torch.full((B * T, AITER_HEADS), float("-inf"), device=q.device)
        o = o.float().view(B, T, AITER_HEADS, C)[:, :, :H]
        lse = lse.float().view(B, T, AITER_HEADS)[:, :, :H]
        empty = torch.tensor([c == 0 for c in counts], device=q.device).view(B, 1, 1)
        o = torch.where(empty[..., None], torch.zeros_like(o), o)  # a sequence the shard holds nothing of
        lse = torch.where(empty, torch.full_like(lse, float("-inf")), lse)
        parts.append((o, lse))
    o, lse = parts[0] if dcp == 1 else ref.merge(parts)  # the shared log-sum-exp merge
    return o.contiguous(), lse.contiguous()


def _lse_of(res: Any, rows: int) -> torch.Tensor:
    """AITER returns (logits, lse) with return_lse=True; lse [rows, 16] (or with a trailing 1)."""
    if not isinstance(res, (tuple, list)) or len(res) < 2 or not isinstance(res[-1], torch.Tensor):
        raise RuntimeError(f"aiter mla_decode_fwd(return_lse=True) returned {type(res).__name__}; expected "
                           "(logits, lse): this AITER version's contract differs from the adapter's")
    lse = res[-1]
    if lse.numel() != rows * AITER_HEADS:
        raise RuntimeError(f"aiter mla_decode_fwd returned lse of shape {tuple(lse.shape)}; expected "
                           f"{rows} x {AITER_HEADS} values")
    return lse.reshape(rows, AITER_HEADS)
