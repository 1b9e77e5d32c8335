"""L2 prefetch of an upcoming projection's weight in CuTe DSL: the `prefetch` switch's kernel (issue 13 item 6), the
twin of kernels/triton/l2_prefetch.py over the same plan (k3lab.components.trunk.prefetch_plan), with one
`cp.async.bulk.prefetch.L2` per contiguous range where the Triton kernel issues one `prefetch.global.L2` per 128-byte
line:

    range r = (n, s):  W[n, s KSPLIT : s KSPLIT + SPAN]  (cut at the row's end)      n < N, s < S = cdiv(K, KSPLIT)

Thread r of the grid (128 threads a CTA) takes range r: its byte range widened to 16-byte bounds (the instruction's
rule; the start rounded down, the end up but never past the weight's last whole 16 bytes), one instruction, nothing
returned to registers: the CTA issues and exits while the lines land. Record mode (`record`, the tests' path): each
range's lines' first element indices are written instead, in the Triton kernel's order (rec[r LPS + j] = n K + s KSPLIT
+ j EL, -1 for a line that starts past the row's end; EL elements a 128-byte line, LPS lines a range), so the same
checker covers both twins. Not yet timed on a GPU (thirty-fourth session).

Layout: W [N, K] contiguous, bf16 or fp8, 16-byte aligned; record int64 [>= N S LPS]. Floor: none (it moves bytes into
L2 that the projection's floor already counts).
"""
from typing import Any

import torch

LINE = 128        # bytes of one line of the plan (kernels/triton/l2_prefetch.py's)
_THREADS = 128

__all__ = ["prefetch"]

_KERNEL_CLS = None


def _kernel_class():
    """The kernel's generator (built once; importing this module never needs cutlass)."""
    global _KERNEL_CLS
    if _KERNEL_CLS is not None:
        return _KERNEL_CLS
    import cuda.bindings.driver as cuda
    import cutlass
    from cutlass import Int32, cute

    from . import kda_decode

    prefetch_l2 = kda_decode._dsl().prefetch_l2

    class L2Prefetch:
        """One thread a range (module doc)."""

        def __init__(self, N: int, K: int, ksplit: int, span: int, esize: int, record: bool):
            self.N, self.K, self.KS, self.esize, self.record = N, K, ksplit, esize, bool(record)
            self.S = -(-K // ksplit)
            self.EL = LINE // esize
            self.LPS = -(-min(span, ksplit) // self.EL)
            self.SPAN = min(span, ksplit)
            self.R = N * self.S
            self.END = N * K * esize // 16 * 16  # the last whole 16 bytes of the weight end here

        @cute.jit
        def __call__(self, p_w: cute.Pointer, p_rec: cute.Pointer, stream: cuda.CUstream):
            self.kernel(p_w, p_rec).launch(grid=[(self.R + _THREADS - 1) // _THREADS, 1, 1], block=[_THREADS, 1, 1],
                                           stream=stream)

        @cute.kernel
        def kernel(self, p_w: cute.Pointer, p_rec: cute.Pointer):
            K, KS, S, EL, LPS = self.K, self.KS, self.S, self.EL, self.LPS
            tid, _, _ = cute.arch.thread_idx()
            c, _, _ = cute.arch.block_idx()
            r = c * _THREADS + tid
            if r < self.R:
                n = r // S
                s = r - n * S
                col = s * KS
                if cutlass.const_expr(self.record):  # rec as int32 words: the low word, then the sign's
                    for j in range(self.LPS):  # (inside a dynamic `if`: constants read off self)
                        v = cutlass.select_(col + j * EL < K, n * K + col + j * EL, Int32(-1))
                        cute.make_tensor(p_rec + 2 * (r * LPS + j), cute.make_layout(2))[0] = v
                        cute.make_tensor(p_rec + 2 * (r * LPS + j), cute.make_layout(2))[1] = v >> 31
                else:
                    a = (n * K + col) * self.esize                    # bytes from W's start
                    b = a + cutlass.select_(K - col < self.SPAN, K - col, Int32(self.SPAN)) * self.esize
                    a16 = a // 16 * 16
                    b16 = (b + 15) // 16 * 16
                    b16 = cutlass.select_(b16 > self.END, Int32(self.END), b16)
                    if b16 > a16:
                        prefetch_l2(p_w + a16 // 4, b16 - a16)   # p_w: W's int32 words

    _KERNEL_CLS = L2Prefetch
    return _KERNEL_CLS


class L2PrefetchError(ValueError):
    """An argument of the CuTe L2 prefetch has the wrong type, shape, dtype, layout or device."""


def _fail(name: str, msg: str):
    raise L2PrefetchError(f"l2_prefetch cute: {name!r} {msg}")


_COMPILED: dict[tuple, Any] = {}


def prefetch(w: torch.Tensor, ksplit: int, span: int, *, record: torch.Tensor | None = None) -> int:
    """Prefetch W[n, s*ksplit : s*ksplit + span] for every row n and split s into L2 (module doc); with `record`
    (int64, at least `lines` entries) write each line's first element index instead (-1: a line past the row's end).
    Returns the number of lines (the Triton twin's count). The caller plans (k3lab.components.trunk.prefetch_l2)."""
    import cutlass

    from .kda_decode import gmem_ptr

    if not isinstance(w, torch.Tensor) or w.dim() != 2 or w.device.type != "cuda":
        _fail("w", f"must be a [N, K] CUDA tensor, got {getattr(w, 'shape', type(w).__name__)}")
    if w.dtype not in (torch.bfloat16, torch.float8_e4m3fn) or not w.is_contiguous() or w.data_ptr() % 16:
        _fail("w", f"must be a contiguous 16-byte aligned bf16 or fp8 weight, got {w.dtype}")
    N, K = w.shape
    for name, v in (("ksplit", ksplit), ("span", span)):
        if isinstance(v, bool) or not isinstance(v, int) or v < (1 if name == "ksplit" else 0):
            _fail(name, f"must be an int >= {1 if name == 'ksplit' else 0}, got {v!r}")
    esize = w.element_size()
    el = LINE // esize
    S, lps = -(-K // ksplit), -(-min(span, ksplit) // el)
    lines = N * S * lps
    if lines == 0:
        return 0
    if record is not None:
        if (not isinstance(record, torch.Tensor) or record.dtype != torch.int64 or record.device != w.device
                or not record.is_contiguous() or record.numel() < lines):
            _fail("record", f"must be a contiguous int64 tensor on w's device with at least {lines} entries")
    if N * K * esize % 4:
        _fail("w", f"must span a whole number of 4-byte words (read as int32 words), got {N} x {K} x {esize} bytes")
    p_w = gmem_ptr(w.view(-1).view(torch.int32), cutlass.Int32, 16)
    p_rec = gmem_ptr(record.view(torch.int32), cutlass.Int32, 8) if record is not None else p_w  # p_w: never written
    key = (N, K, ksplit, min(span, ksplit), esize, record is not None, w.device.index)
    with torch.cuda.device(w.device):
        import cuda.bindings.driver as cuda

        stream = cuda.CUstream(torch.cuda.current_stream(w.device).cuda_stream)
        fn = _COMPILED.get(key)
        if fn is None:
            from cutlass import cute

            fn = _COMPILED[key] = cute.compile(_kernel_class()(N, K, ksplit, span, esize, record is not None), p_w,
                                               p_rec, stream)
        fn(p_w, p_rec, stream)
    return lines

