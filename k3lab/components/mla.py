"""Gated MLA component API (absorbed decode over the latent cache; k3lab.ref.mla has the maths).

    decode(h, weights, cache, lengths, out=None, *, backend="reference", partitions=1, pad_heads=0,
           dcp=1, dcp_layout="interleave") -> out [B, D]
        h [B, D] = the normed layer input. Writes h's cache entry at position lengths[b] of `cache`
        (in place); does NOT advance `lengths` (the caller owns it). Attends positions <= lengths[b].
    verify(h, weights, cache, lengths, out=None, *, ...) -> out [B, T, D]
        T positions per sequence: entries written at lengths .. lengths+T-1, causal among the new.
    attend(q_lat, q_rope, cache, lengths, *, scale, backend, partitions, pad_heads, dcp, dcp_layout)
        -> (o_lat [B, T, H, C], lse [B, T, H]) over an already written cache.

partitions = split-KV pieces merged by log-sum-exp; dcp = simulated decode context parallelism over
`dcp` ranks; pad_heads = pad the query heads to this count (0 = none) and drop the padded outputs.
Backends here: "reference", "torch_compile"; others are refused with BackendUnavailable.
"""
from __future__ import annotations

import torch

from k3lab.components.dispatch import resolve_backend, write_out
from k3lab.ref import mla as ref
from k3lab.ref.mla import MLACache, MLAWeights
from k3lab.ref.rmsnorm import compute_dtype

COMPONENT = "mla"


def _check_lengths(lengths, batch: int, T: int, cache: MLACache) -> torch.Tensor:
    if isinstance(lengths, int):
        lengths = torch.full((batch,), lengths, dtype=torch.long, device=cache.data.device)
    if not isinstance(lengths, torch.Tensor) or lengths.shape != (batch,) or lengths.is_floating_point():
        raise ValueError(f"{COMPONENT}: 'lengths' must be an int tensor of shape [{batch}], got "
                         f"{getattr(lengths, 'shape', type(lengths).__name__)}")
    if bool((lengths < 0).any()) or int(lengths.max()) + T > cache.capacity:
        raise ValueError(f"{COMPONENT}: 'lengths' + {T} new positions must lie in 0..{cache.capacity} "
                         f"(the cache capacity), got lengths {lengths.tolist()}")
    return lengths


def _check_opts(weights: MLAWeights, partitions: int, pad_heads: int, dcp: int) -> None:
    if not isinstance(partitions, int) or partitions < 1:
        raise ValueError(f"{COMPONENT}: 'partitions' must be an int >= 1, got {partitions!r}")
    if not isinstance(dcp, int) or dcp < 1:
        raise ValueError(f"{COMPONENT}: 'dcp' must be an int >= 1, got {dcp!r}")
    if not isinstance(pad_heads, int) or (pad_heads and pad_heads < weights.heads):
        raise ValueError(f"{COMPONENT}: 'pad_heads' must be 0 or >= the {weights.heads} query heads, "
                         f"got {pad_heads!r}")


def _check(h, weights, cache, T_axis: bool):
    if not isinstance(weights, MLAWeights):
        raise TypeError(f"{COMPONENT}: 'weights' must be k3lab.ref.mla.MLAWeights, got {type(weights).__name__}")
    D = weights.w_dq.shape[1]
    want = "[B, T, D]" if T_axis else "[B, D]"
    if not isinstance(h, torch.Tensor) or h.dim() != (3 if T_axis else 2) or h.shape[-1] != D:
        raise ValueError(f"{COMPONENT}: 'h' must be {want} with D={D}, got {tuple(getattr(h, 'shape', ()))}")
    if not isinstance(cache, MLACache):
        raise TypeError(f"{COMPONENT}: 'cache' must be k3lab.ref.mla.MLACache, got {type(cache).__name__}")
    if cache.data.shape[0] != h.shape[0] or cache.data.shape[2] != weights.entry_width:
        raise ValueError(f"{COMPONENT}: 'cache' must be [{h.shape[0]}, S, {weights.entry_width}], got "
                         f"{tuple(cache.data.shape)}")


def verify(h: torch.Tensor, weights: MLAWeights, cache: MLACache, lengths, out: torch.Tensor | None = None, *,
           backend: str = "reference", partitions: int = 1, pad_heads: int = 0, dcp: int = 1,
           dcp_layout: str = "interleave") -> torch.Tensor:
    _check(h, weights, cache, True)
    lengths = _check_lengths(lengths, h.shape[0], h.shape[1], cache)
    _check_opts(weights, partitions, pad_heads, dcp)
    # projections and the cache write stay eager (the write is in place); the attention core and
    # output path go through the backend
    q_nope, q_rope = ref.mla_q(h, weights)
    q_lat = ref.absorb_q(q_nope, weights)
    cache.write(lengths, ref.mla_kv_entry(h, weights))
    o_lat, _ = attend(q_lat, q_rope, cache, lengths, scale=weights.scale, backend=backend, partitions=partitions,
                      pad_heads=pad_heads, dcp=dcp, dcp_layout=dcp_layout)
    y = resolve_backend(COMPONENT, backend, ref.mla_out, "out")(o_lat, h, weights)
    return write_out(COMPONENT, y, out)


def decode(h: torch.Tensor, weights: MLAWeights, cache: MLACache, lengths, out: torch.Tensor | None = None, *,
           backend: str = "reference", partitions: int = 1, pad_heads: int = 0, dcp: int = 1,
           dcp_layout: str = "interleave") -> torch.Tensor:
    _check(h, weights, cache, False)
    y = verify(h.unsqueeze(1), weights, cache, lengths, None, backend=backend, partitions=partitions,
               pad_heads=pad_heads, dcp=dcp, dcp_layout=dcp_layout).squeeze(1)
    return write_out(COMPONENT, y, out)


def attend(q_lat: torch.Tensor, q_rope: torch.Tensor, cache: MLACache, lengths, *, scale: float,
           backend: str = "reference", partitions: int = 1, pad_heads: int = 0, dcp: int = 1,
           dcp_layout: str = "interleave") -> tuple[torch.Tensor, torch.Tensor]:
    if q_lat.dim() != 4 or q_rope.dim() != 4 or q_lat.shape[:3] != q_rope.shape[:3]:
        raise ValueError(f"{COMPONENT}: 'q_lat' [B,T,H,C] and 'q_rope' [B,T,H,Dr] must agree on B,T,H, got "
                         f"{tuple(q_lat.shape)} and {tuple(q_rope.shape)}")
    if q_lat.shape[-1] + q_rope.shape[-1] != cache.data.shape[-1]:
        raise ValueError(f"{COMPONENT}: C + Dr = {q_lat.shape[-1] + q_rope.shape[-1]} does not match the cache "
                         f"width {cache.data.shape[-1]}")
    B, T, H, _ = q_lat.shape
    lengths = _check_lengths(lengths, B, T, cache)
    if not isinstance(pad_heads, int) or (pad_heads and pad_heads < H):
        raise ValueError(f"{COMPONENT}: 'pad_heads' must be 0 or >= the {H} query heads, got {pad_heads!r}")
    kv = cache.read(compute_dtype(q_lat))
    fn = resolve_backend(COMPONENT, backend, ref.mla_attend, "attend")
    return fn(q_lat, q_rope, kv, lengths, scale=scale, partitions=partitions, dcp=dcp, dcp_layout=dcp_layout,
              pad_heads=pad_heads, n_positions=int(lengths.max()) + T)
