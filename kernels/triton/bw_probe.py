"""Read-bandwidth probe: a streaming sum, the ceiling of ops that mostly read (weights, caches).

Fuses: nothing. Each program loads one ROWS x COLS tile of contiguous bf16 values in a single load (every
thread has ROWS * COLS / (32 * num_warps) values, 16-byte vectors, in flight at once), evict-first since
the data is touched once, and writes one fp32 partial sum. Layout: x flat [N] bf16, N a multiple of
ROWS * COLS; part [N / (ROWS * COLS)] fp32. Bytes: N * 2 read, the partial sums written (nothing).
Floor: N * 2 / read bandwidth; docs/MODEL.md, Switches quotes ~4.6 TB/s for such a read on the H200.
`CONFIGS` are the tile shapes k3lab.harness.timing.measure_read_bandwidth tries; it keeps the fastest.

`stream_grid` reads the same way from a grid sized to the GPU (PER_SM programs an SM, each walking tiles
pid, pid + P, ... with UNROLL tiles' loads in flight, any N: the last tiles masked): no partial last wave,
which a program a tile leaves at sizes of a few tens of MB (the projections' weights). The projections' peers
(k3lab.ops.trunk): `stream` reads with stream_sum at `fit_config`'s tile, `stream_grid` with stream_grid.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

CONFIGS = ((8, 4096, 8), (16, 2048, 8), (32, 1024, 4), (8, 2048, 4), (4, 8192, 16))  # (ROWS, COLS, num_warps)
# the tiles a read of any size takes (the largest that divides it; the last reads 16 values a program)
FIT_CONFIGS = ((8, 4096, 8), (4, 4096, 8), (1, 4096, 4), (1, 1024, 4), (1, 256, 2), (1, 64, 2), (1, 16, 1))


def fit_config(n: int) -> tuple[int, int, int] | None:
    """The first of FIT_CONFIGS whose ROWS x COLS divides n values (None: n is not a multiple of 16)."""
    return next((c for c in FIT_CONFIGS if n % (c[0] * c[1]) == 0), None)


@triton.jit
def _stream_sum_kernel(x_ptr, part_ptr, ROWS: tl.constexpr, COLS: tl.constexpr):
    pid = tl.program_id(0).to(tl.int64)
    offs = pid * ROWS * COLS + tl.arange(0, ROWS)[:, None] * COLS + tl.arange(0, COLS)[None, :]
    v = tl.load(x_ptr + offs, eviction_policy="evict_first").to(tl.float32)
    tl.store(part_ptr + pid, tl.sum(tl.sum(v, axis=1), axis=0))


def stream_sum(x: torch.Tensor, part: torch.Tensor | None = None, config: tuple[int, int, int] = CONFIGS[0]):
    """Partial sums of a flat bf16 tensor whose size is a multiple of ROWS * COLS (one per program)."""
    rows, cols, warps = config
    if x.dtype != torch.bfloat16 or x.dim() != 1 or not x.is_contiguous():
        raise ValueError(f"stream_sum: x must be a contiguous 1-D bf16 tensor, got {x.dtype} {tuple(x.shape)}")
    chunk = rows * cols
    if x.numel() % chunk:
        raise ValueError(f"stream_sum: x.numel() must be a multiple of {chunk}, got {x.numel()}")
    n_prog = x.numel() // chunk
    if part is None:
        part = torch.empty(n_prog, dtype=torch.float32, device=x.device)
    elif part.shape != (n_prog,) or part.dtype != torch.float32:
        raise ValueError(f"stream_sum: part must be fp32 [{n_prog}], got {part.dtype} {tuple(part.shape)}")
    _stream_sum_kernel[(n_prog,)](x, part, ROWS=rows, COLS=cols, num_warps=warps)
    return part


# (TILE bf16 values a program an iteration, UNROLL tiles in flight, PER_SM, num_warps): the fastest of five
# configurations at most of the projection and group sizes of 1.8-90 MB on an H100 (profiles/h100-80gb-hbm3/
# stream_peer61.json.gz, git history at `e88bf4d`; figures in docs/NOTES_trunk.md)
GRID_CONFIG = (1024, 4, 16, 4)


@triton.jit
def _stream_grid_kernel(x_ptr, part_ptr, N, TILE: tl.constexpr, UNROLL: tl.constexpr):
    pid = tl.program_id(0)
    nprog = tl.num_programs(0)
    cols = tl.arange(0, TILE)
    acc = tl.zeros([TILE], dtype=tl.float32)
    n_tiles = tl.cdiv(N, TILE)
    for t0 in range(pid, n_tiles, nprog * UNROLL):
        for k in tl.static_range(UNROLL):  # UNROLL independent loads, then their sums
            offs = (t0 + k * nprog).to(tl.int64) * TILE + cols
            acc += tl.load(x_ptr + offs, mask=offs < N, other=0.0, eviction_policy="evict_first").to(tl.float32)
    tl.store(part_ptr + pid, tl.sum(acc, axis=0))


def grid_programs(n: int, sms: int, config: tuple[int, int, int, int] = GRID_CONFIG) -> int:
    """Programs of stream_grid over n values: PER_SM an SM, at most one a tile."""
    tile, _, per_sm, _ = config
    return max(1, min(sms * per_sm, -(-n // tile)))


def stream_grid(x: torch.Tensor, part: torch.Tensor, config: tuple[int, int, int, int] = GRID_CONFIG):
    """Partial sums of a flat bf16 tensor of any size, one per program (part: fp32 [grid_programs(...)])."""
    tile, unroll, _, warps = config
    if x.dtype != torch.bfloat16 or x.dim() != 1 or not x.is_contiguous():
        raise ValueError(f"stream_grid: x must be a contiguous 1-D bf16 tensor, got {x.dtype} {tuple(x.shape)}")
    if part.dim() != 1 or part.dtype != torch.float32 or part.numel() < 1:
        raise ValueError(f"stream_grid: part must be a non-empty fp32 vector (one sum a program), got {part.dtype} "
                         f"{tuple(part.shape)}")
    _stream_grid_kernel[(part.numel(),)](x, part, x.numel(), TILE=tile, UNROLL=unroll, num_warps=warps)
    return part
