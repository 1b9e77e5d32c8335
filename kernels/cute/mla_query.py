"""The gated-MLA absorbed query step as one CuTe DSL kernel: q_norm, the up-projection Wuq and the absorption
through Wuk, from the q down-projection's output cq to what the attention reads (issue 12, item 5).

    r[b]            = rsqrt(mean_k cq[b, k]^2 + eps)                                     (fp32)
    q[b, h, d]      = r[b] * sum_k (cq[b, k] q_norm[k]) Wuq[h (Dn + Dr) + d, k]        (fp32, d < Dn + Dr)
    q_rope[b, h, :] = q[b, h, Dn:]                                                      (stored bf16)
    q_lat[b, h, c]  = sum_{d < Dn} q[b, h, d] Wuk[h, d, c]                               (fp32, stored bf16)

i.e. k3lab.ref.mla.mla_q's last two steps and absorb_q, with the RMSNorm folded into the projection's rows (the
normed input is never rounded to bf16, nor q_nope before the absorption: the unfused path rounds both).

Layout. One warp per row n of Wuq [H (Dn + Dr), Q] over all of Q (the GEMV of kernels/cute/proj_gemv.py: lane l
reads columns 256 s + 8 l .. + 7 of step s, the first PRE steps of the row loaded first, before the wait under pdl),
eight warps a CTA, so a CTA's rows are all nope or all rope rows of one head (Dn and Dr multiples of 8): head h owns
CTAs (Dn + Dr) / 8 h .. and the first NP = Dn / 8 of them are its nope CTAs. Each warp sums its cq^2 beside the dot
product from the same loads (cq is read from L1 / L2 by every warp of a CTA; Q is short). A rope warp stores its
row. A nope warp (row d) has loaded its Wuk row [C] before the wait (lane l: columns C/32 l .. + C/32 - 1) and
multiplies it by q[b, h, d]: the CTA sums its eight warps' products in shared memory (warp order) and stores the
partial [B, C] (fp32) into a workspace [H, NP, B, C]; then it counts itself on the head's arrival counter
(fence.acq_rel.gpu, atom.add.acq_rel.gpu), and the head's last nope CTA to arrive resets the counter and sums the NP
partials in CTA order into q_lat. The sums run in a fixed order (no atomics on values): the results are the same
bits on every call. No CTA waits for another (no co-residency needed).

Floor (k3lab.ops.mla.query_bytes, the one formula; read bandwidth): Wuq H (Dn + Dr) Q 2 + Wuk H Dn C 2 + q_norm Q 2
+ cq B Q 2 + outputs B H (C + Dr) 2: 6.3 MB at TP8 (12 heads, Q 1536, C 512), ~1.4 us at 4.6 TB/s. The partials
(H NP B C 4 bytes written and read once, 393 KB at TP8 and batch 1) stay in L2.

Contract (torch tensors on one CUDA device, torch's current stream, CUDA-graph safe once a shape has compiled):
mla_query(cq, q_norm, w_uq, w_uk, q_lat, q_rope, *, eps, pdl=None). cq [B, Q] bf16 (unit stride along Q, a row
stride of 8 elements), B = 1..MAX_BATCH, Q a multiple of 8; q_norm [Q], w_uq [H (Dn + Dr), Q], w_uk [H, Dn, C] bf16
contiguous; q_lat [B, H, C] and q_rope [B, H, Dr] bf16 with unit inner stride (any other strides: views of wider
buffers). C = 32 2^i up to 512. pdl=True: each warp loads its first PRE steps of Wuq and (a nope row) its Wuk row, then
waits for the kernel before (griddepcontrol.wait) and reads cq and q_norm after it; the caller's precondition: the
kernel before writes neither weight. None: the enclosing k3lab_kernels.triton.pdl.pdl_chain's setting. The arrival
counters and the workspace are one per device and shape: calls must not run concurrently on two streams.
"""
from typing import Any

import torch

MAX_BATCH = 4
K_STEP = 256      # columns a warp reads a step (32 lanes x 8 bf16)
UNROLL = 4        # steps a warp keeps in flight
PRE = 4           # steps of Wuq a warp loads before anything else (before griddepcontrol.wait under pdl)
_WARPS = 8
_THREADS = 32 * _WARPS
C_ALLOWED = (32, 64, 128, 256, 512)

__all__ = ["MAX_BATCH", "mla_query"]

_KERNEL_CLS = None


def _kernel_class():
    """The kernel generator (built once; importing this module never needs cutlass)."""
    global _KERNEL_CLS
    if _KERNEL_CLS is not None:
        return _KERNEL_CLS
    import cuda.bindings.driver as cuda
    import cutlass
    from cutlass import Float32, Int32, cute

    def vec(ptr, off, n):
        return cute.make_tensor(ptr + off, cute.make_layout(n))

    def put(ptr, off, v):
        """ptr[off] = v (a call, not a subscript store: the DSL would take every name in the offset as written)."""
        cute.make_tensor(ptr + off, cute.make_layout(1))[0] = v

    class MLAQueryKernel:
        """One warp per row of Wuq; each head's nope CTAs reduce through Wuk, the last one into q_lat."""

        def __init__(self, B: int, H: int, Q: int, Dn: int, Dr: int, C: int, pdl: bool):
            assert 1 <= B <= MAX_BATCH and Q % 8 == 0 and Dn % _WARPS == 0 and Dr % _WARPS == 0 and C in C_ALLOWED
            self.B, self.H, self.Q, self.Dn, self.Dr, self.C = B, H, Q, Dn, Dr, C
            self.R = Dn + Dr                  # rows of a head
            self.CPH = self.R // _WARPS       # CTAs a head
            self.NP = Dn // _WARPS            # nope CTAs a head: the partials q_lat sums
            self.VC = C // 32                 # Wuk columns a lane holds
            self.VW = min(self.VC, 8)         # their vector width (16 bytes at most)
            self.pdl = bool(pdl)

        @cute.jit
        def __call__(self, p_x: cute.Pointer, p_g: cute.Pointer, p_wq: cute.Pointer, p_wk: cute.Pointer,
                     p_lat: cute.Pointer, p_rope: cute.Pointer, p_part: cute.Pointer, p_cnt: cute.Pointer,
                     s_x: Int32, s_lb: Int32, s_lh: Int32, s_rb: Int32, s_rh: Int32, eps: Float32,
                     stream: cuda.CUstream):
            self.kernel(p_x, p_g, p_wq, p_wk, p_lat, p_rope, p_part, p_cnt, s_x, s_lb, s_lh, s_rb, s_rh, eps).launch(
                grid=[self.H * self.CPH, 1, 1], block=[_THREADS, 1, 1], stream=stream, use_pdl=self.pdl)

        @cute.kernel
        def kernel(self, p_x: cute.Pointer, p_g: cute.Pointer, p_wq: cute.Pointer, p_wk: cute.Pointer,
                   p_lat: cute.Pointer, p_rope: cute.Pointer, p_part: cute.Pointer, p_cnt: cute.Pointer,
                   s_x: Int32, s_lb: Int32, s_lh: Int32, s_rb: Int32, s_rh: Int32, eps: Float32):
            B, Q, Dn, C, R, NP, VC, VW = self.B, self.Q, self.Dn, self.C, self.R, self.NP, self.VC, self.VW
            S = Q // K_STEP
            tid, _, _ = cute.arch.thread_idx()
            c, _, _ = cute.arch.block_idx()
            warp = cute.arch.make_warp_uniform(cute.arch.warp_idx())
            lane = tid % 32
            h = c // self.CPH
            j = c - h * self.CPH          # the CTA within its head: nope CTAs first (CTA-uniform)
            d = j * _WARPS + warp         # the warp's row within the head
            n = h * R + d
            alloc = cutlass.utils.SmemAllocator()
            s_part = alloc.allocate_tensor(Float32, cute.make_layout(_WARPS * B * C), byte_alignment=16)
            s_flag = alloc.allocate_tensor(Int32, cute.make_layout(4), byte_alignment=16)

            acc = cute.make_rmem_tensor((B,), Float32)
            ss = cute.make_rmem_tensor((B,), Float32)
            acc.fill(0.0)
            ss.fill(0.0)
            wv = cute.make_rmem_tensor((8,), p_wq.dtype)
            xv = cute.make_rmem_tensor((8,), p_x.dtype)
            gv = cute.make_rmem_tensor((8,), p_g.dtype)
            wrow = n * Q + 8 * lane
            pre = min(PRE, S)
            wpre = cute.make_rmem_tensor((max(pre, 1) * 8,), p_wq.dtype)
            for s in cutlass.range_constexpr(pre):
                cute.autovec_copy(vec(p_wq, cute.assume(wrow + s * K_STEP, divby=8), 8),
                                  cute.make_tensor(wpre.iterator + s * 8, cute.make_layout(8)))
            uk = cute.make_rmem_tensor((VC,), p_wk.dtype)
            if j < NP:  # a nope row: its Wuk row (a weight) streams before the wait too
                for v in cutlass.range_constexpr(VC // VW):
                    cute.autovec_copy(vec(p_wk, cute.assume((h * Dn + d) * C + VC * lane + VW * v, divby=VW), VW),
                                      cute.make_tensor(uk.iterator + VW * v, cute.make_layout(VW)))
            if cutlass.const_expr(self.pdl):
                cute.arch.griddepcontrol_wait()  # cq comes from the kernel before
                cute.arch.griddepcontrol_launch_dependents()
            for s in cutlass.range_constexpr(pre):
                cute.autovec_copy(vec(p_g, cute.assume(s * K_STEP + 8 * lane, divby=8), 8), gv)
                for b in cutlass.range_constexpr(B):
                    cute.autovec_copy(vec(p_x, cute.assume(b * s_x + s * K_STEP + 8 * lane, divby=8), 8), xv)
                    for e in cutlass.range_constexpr(8):
                        xf = xv[e].to(Float32)
                        ss[b] = ss[b] + xf * xf
                        acc[b] = acc[b] + wpre[s * 8 + e].to(Float32) * (xf * gv[e].to(Float32))
            for s in cutlass.range(pre, S, unroll=UNROLL):
                cute.autovec_copy(vec(p_wq, cute.assume(wrow + s * K_STEP, divby=8), 8), wv)
                cute.autovec_copy(vec(p_g, cute.assume(s * K_STEP + 8 * lane, divby=8), 8), gv)
                for b in cutlass.range_constexpr(B):
                    cute.autovec_copy(vec(p_x, cute.assume(b * s_x + s * K_STEP + 8 * lane, divby=8), 8), xv)
                    for e in cutlass.range_constexpr(8):
                        xf = xv[e].to(Float32)
                        ss[b] = ss[b] + xf * xf
                        acc[b] = acc[b] + wv[e].to(Float32) * (xf * gv[e].to(Float32))
            if cutlass.const_expr(Q % K_STEP != 0):  # the last, partial step: lanes past Q load nothing
                if S * K_STEP + 8 * lane < Q:
                    cute.autovec_copy(vec(p_wq, cute.assume(wrow + S * K_STEP, divby=8), 8), wv)
                    cute.autovec_copy(vec(p_g, cute.assume(S * K_STEP + 8 * lane, divby=8), 8), gv)
                    for b in cutlass.range_constexpr(B):
                        cute.autovec_copy(vec(p_x, cute.assume(b * s_x + S * K_STEP + 8 * lane, divby=8), 8), xv)
                        for e in cutlass.range_constexpr(8):
                            xf = xv[e].to(Float32)
                            ss[b] = ss[b] + xf * xf
                            acc[b] = acc[b] + wv[e].to(Float32) * (xf * gv[e].to(Float32))
            for b in cutlass.range_constexpr(B):  # butterflies: every lane holds the sums
                for sh in cutlass.range_constexpr(5):
                    acc[b] = acc[b] + cute.arch.shuffle_sync_bfly(acc[b], offset=16 >> sh)
                    ss[b] = ss[b] + cute.arch.shuffle_sync_bfly(ss[b], offset=16 >> sh)
                acc[b] = acc[b] * cute.math.rsqrt(ss[b] * (1.0 / Q) + eps)
            if j >= NP:  # rope rows: stored as they are
                for b in cutlass.range_constexpr(B):
                    if lane == b:
                        put(p_rope, b * s_rb + h * s_rh + d - Dn, acc[b].to(p_rope.dtype))
            if j < NP:
                # this warp's row times its Wuk row, into shared memory; the CTA's eight rows summed in warp order
                for b2 in cutlass.range_constexpr(B):
                    for v2 in cutlass.range_constexpr(VC):
                        s_part[(warp * B + b2) * C + VC * lane + v2] = acc[b2] * uk[v2].to(Float32)
                cute.arch.sync_threads()
                for i in cutlass.range_constexpr((B * C + _THREADS - 1) // _THREADS):
                    t = i * _THREADS + tid
                    if t < B * C:
                        y = s_part[t]
                        for w in cutlass.range_constexpr(1, _WARPS):
                            y = y + s_part[w * B * C + t]
                        put(p_part, (h * NP + j) * B * C + t, y)
                cute.arch.sync_threads()  # the CTA's partial is stored
                if tid == 0:
                    cute.arch.fence_acq_rel_gpu()
                    old = cute.arch.atomic_add(p_cnt + h, Int32(1), sem="acq_rel", scope="gpu")
                    last = Int32(0)
                    if old == NP - 1:
                        last = Int32(1)
                        cute.arch.atomic_add(p_cnt + h, Int32(-NP), sem="relaxed", scope="gpu")  # zero again
                    cute.arch.fence_acq_rel_gpu()
                    s_flag[0] = last
                cute.arch.sync_threads()
                if s_flag[0] == 1:  # every partial of the head is visible: q_lat, partials in CTA order
                    for i2 in cutlass.range_constexpr((B * C + _THREADS - 1) // _THREADS):
                        t2 = i2 * _THREADS + tid
                        if t2 < B * C:
                            z = vec(p_part, h * NP * B * C + t2, 1)[0]
                            for q in cutlass.range_constexpr(1, NP):
                                z = z + vec(p_part, (h * NP + q) * B * C + t2, 1)[0]
                            bt = t2 // C
                            put(p_lat, bt * s_lb + h * s_lh + t2 - bt * C, z.to(p_lat.dtype))

    _KERNEL_CLS = MLAQueryKernel
    return MLAQueryKernel


# ---------------------------------------------------------------------------------------------
# Host wrapper
# ---------------------------------------------------------------------------------------------

_COMPILED: dict[tuple, Any] = {}
_COUNTERS: dict[str, torch.Tensor] = {}   # per device: the heads' arrival counters, zero between calls
_PARTS: dict[tuple, torch.Tensor] = {}    # per device and shape: the nope CTAs' partials


class MLAQueryError(ValueError):
    """An argument of the CuTe MLA query step has the wrong type, shape, dtype, layout or device."""


def _fail(name: str, msg: str):
    raise MLAQueryError(f"mla_query cute: {name!r} {msg}")


def _ptr(t: torch.Tensor, align: int):
    import cutlass
    from cutlass import cute
    from cutlass.cute.runtime import make_ptr
    dt = {torch.float32: cutlass.Float32, torch.bfloat16: cutlass.BFloat16, torch.int32: cutlass.Int32}[t.dtype]
    return make_ptr(dt, t.data_ptr(), cute.AddressSpace.gmem, assumed_align=align)


def mla_query(cq: torch.Tensor, q_norm: torch.Tensor, w_uq: torch.Tensor, w_uk: torch.Tensor, q_lat: torch.Tensor,
              q_rope: torch.Tensor, *, eps: float = 1e-6, pdl: bool | None = None) -> tuple:
    """q_lat [B, H, C], q_rope [B, H, Dr] from cq [B, Q] (module doc). Returns (q_lat, q_rope)."""
    from k3lab_kernels.triton.mla_query import check_args, scratch
    from k3lab_kernels.triton.pdl import chain_pdl

    if pdl is None:
        pdl = chain_pdl(None)
    if not isinstance(pdl, bool):
        _fail("pdl", f"must be None or a bool, got {pdl!r}")
    B, Q, H, Dn, Dr, C = check_args(cq, q_norm, w_uq, w_uk, q_lat, q_rope, eps, fail=_fail, max_batch=MAX_BATCH,
                                    cuda=True)
    dev = cq.device
    cnt, part = scratch(dev, H, Dn // _WARPS, B, C, _COUNTERS, _PARTS, torch)
    import cutlass

    args = [_ptr(cq, 16), _ptr(q_norm, 16), _ptr(w_uq, 16), _ptr(w_uk, 16), _ptr(q_lat, 2), _ptr(q_rope, 2),
            _ptr(part, 16), _ptr(cnt, 4), cq.stride(0), q_lat.stride(0), q_lat.stride(1), q_rope.stride(0),
            q_rope.stride(1), cutlass.Float32(float(eps))]
    key = (B, H, Q, Dn, Dr, C, pdl, dev.index)
    with torch.cuda.device(dev):
        import cuda.bindings.driver as cuda

        stream = cuda.CUstream(torch.cuda.current_stream(dev).cuda_stream)
        fn = _COMPILED.get(key)
        if fn is None:
            from cutlass import cute

            fn = cute.compile(_kernel_class()(B, H, Q, Dn, Dr, C, pdl), *args, stream)
            _COMPILED[key] = fn
        fn(*args, stream)
    return q_lat, q_rope
