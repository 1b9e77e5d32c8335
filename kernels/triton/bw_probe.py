"""Read-bandwidth probe: a streaming sum, the ceiling of ops that mostly read (weights, caches).

Fuses: nothing; each program reads BLOCK x ITERS contiguous bf16 values (16-byte vector loads, evict-first,
the data is touched once) and writes one fp32 partial sum. Layout: x flat [N] bf16, N a multiple of
BLOCK * ITERS; part [N / (BLOCK * ITERS)] fp32. Bytes: N * 2 read, N / (BLOCK * ITERS) * 4 written (nothing).
Floor: N * 2 / read bandwidth; on the H200 K3_SPEC section 6 quotes ~4.6 TB/s for such a read.
Used by k3lab.harness.timing.measure_read_bandwidth only.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK = 4096
ITERS = 8


@triton.jit
def _stream_sum_kernel(x_ptr, part_ptr, BLOCK: tl.constexpr, ITERS: tl.constexpr):
    pid = tl.program_id(0).to(tl.int64)
    base = pid * BLOCK * ITERS
    offs = tl.arange(0, BLOCK)
    acc = tl.zeros([BLOCK], dtype=tl.float32)
    for i in range(ITERS):
        acc += tl.load(x_ptr + base + i * BLOCK + offs, eviction_policy="evict_first").to(tl.float32)
    tl.store(part_ptr + pid, tl.sum(acc, axis=0))


def stream_sum(x: torch.Tensor, part: torch.Tensor | None = None) -> torch.Tensor:
    """Partial sums of a flat bf16 tensor whose size is a multiple of BLOCK * ITERS (one per program)."""
    if x.dtype != torch.bfloat16 or x.dim() != 1 or not x.is_contiguous():
        raise ValueError(f"stream_sum: x must be a contiguous 1-D bf16 tensor, got {x.dtype} {tuple(x.shape)}")
    chunk = BLOCK * ITERS
    if x.numel() % chunk:
        raise ValueError(f"stream_sum: x.numel() must be a multiple of {chunk}, got {x.numel()}")
    n_prog = x.numel() // chunk
    if part is None:
        part = torch.empty(n_prog, dtype=torch.float32, device=x.device)
    elif part.shape != (n_prog,) or part.dtype != torch.float32:
        raise ValueError(f"stream_sum: part must be fp32 [{n_prog}], got {part.dtype} {tuple(part.shape)}")
    _stream_sum_kernel[(n_prog,)](x, part, BLOCK=BLOCK, ITERS=ITERS, num_warps=8)
    return part
