"""L2 prefetch of an upcoming projection's weight (the `prefetch` switch, issue 13 item 6): launched on a side
stream while a phase that moves few bytes runs (AttnRes + RMSNorm before the input projections), so the DRAM
bandwidth that phase leaves idle pulls in the bytes the projection will read first.

What is prefetched: the projection kernel (`proj_gemv`) runs one wave of programs, each owning BN rows of W
over one K range of KSPLIT columns (split-K), and a program's time is what it streams from DRAM. Pulling in a
prefix of the weight would let some programs finish early and leave the slowest as they were; so the prefetch
takes, for every row n and every split s, the first SPAN columns of that split's range:

    W[n, s * KSPLIT : s * KSPLIT + SPAN]      for n < N, s < S (S = cdiv(K, KSPLIT)), SPAN <= KSPLIT

which is the first chunks every program reads. SPAN is chosen by the caller from a byte budget (at most the
L2 share it may fill; `span_for`). One `prefetch.global.L2::evict_last` per 128-byte line, no data returned to
registers: the kernel issues and exits (the lines land while the other stream runs).

Layout: W [N, K] contiguous (bf16 or fp8: the element size gives the line's width in elements). Grid:
cdiv(lines, BLOCK) programs over the flattened (n, s, line) index space.

Record mode (RECORD, the tests' path, also under TRITON_INTERPRET=1, which has no inline PTX): instead of
prefetching, each line's first element index is written to `rec`, so a test can check which lines a prefetch
covers. Floor: none (it moves bytes into L2 that the projection's floor already counts).
"""
from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

LINE = 128  # bytes of one L2 line request
BLOCK = 1024  # lines per program


@triton.jit
def _l2_prefetch_kernel(w, rec, lines, K, KSPLIT, S, LPS, EL: tl.constexpr, BLOCK: tl.constexpr,
                        RECORD: tl.constexpr):
    """Line i of the index space: row n = i // (S * LPS), split s = (i // LPS) % S, line j = i % LPS of the span;
    its first element W[n, s * KSPLIT + j * EL]."""
    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    n = i // (S * LPS)
    s = (i // LPS) % S
    j = i % LPS
    ok = (i < lines) & (s * KSPLIT + j * EL < K)  # the last split's range may be shorter than the span
    off = n.to(tl.int64) * K + s * KSPLIT + j * EL
    if RECORD:
        tl.store(rec + i, tl.where(ok, off, -1), mask=i < lines)
    else:
        r = tl.inline_asm_elementwise("prefetch.global.L2::evict_last [$1];\n\tmov.u32 $0, 0;", "=r,l",
                                      [w + tl.where(ok, off, 0)], dtype=tl.int32, is_pure=False, pack=1)
        t = tl.sum(r, 0)
        tl.store(rec + tl.program_id(0), t.to(tl.int64), mask=t != 0)  # never true: keeps the asm alive


def span_for(N: int, K: int, ksplit: int, esize: int, budget: int) -> int:
    """The largest SPAN (columns, whole 128-byte lines, <= KSPLIT) whose prefetch moves at most `budget` bytes."""
    S = triton.cdiv(K, ksplit)
    el = LINE // esize
    lines = min(budget // (N * S * LINE), triton.cdiv(ksplit, el))
    return min(max(0, lines) * el, ksplit)


def prefetch(w: torch.Tensor, ksplit: int, span: int, *, record: torch.Tensor | None = None) -> int:
    """Prefetch W[n, s*ksplit : s*ksplit + span] for every row n and split s into L2 (module docstring); with
    `record` (int64, at least `lines` entries) write each line's first element index instead (-1: a line past
    the row's end, skipped). Returns the number of lines. The caller validates (k3lab.components.trunk.prefetch_l2)."""
    N, K = w.shape
    el = LINE // w.element_size()
    S = triton.cdiv(K, ksplit)
    lps = triton.cdiv(min(span, ksplit), el)
    lines = N * S * lps
    if lines == 0:
        return 0
    interp = os.environ.get("TRITON_INTERPRET", "0") == "1"
    if record is None and interp:
        return lines  # a hint with no effect on any value: nothing to emulate
    rec = record if record is not None else torch.empty(triton.cdiv(lines, BLOCK), dtype=torch.int64,
                                                        device=w.device)
    _l2_prefetch_kernel[(triton.cdiv(lines, BLOCK),)](w, rec, lines, K, ksplit, S, lps, EL=el, BLOCK=BLOCK,
                                                       RECORD=record is not None, num_warps=4)
    return lines
