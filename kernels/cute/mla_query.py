"""The gated-MLA absorbed query step as one CuTe DSL kernel: q_norm, the up-projection Wuq and the absorption
through Wuk, from the q down-projection's output cq to what the attention reads (issue 12, item 5).

    r[b]            = rsqrt(mean_k cq[b, k]^2 + eps)                                     (fp32)
    q[b, h, d]      = r[b] * sum_k (cq[b, k] q_norm[k]) Wuq[h (Dn + Dr) + d, k]        (fp32, d < Dn + Dr)
    q_rope[b, h, :] = q[b, h, Dn:]                                                      (stored bf16)
    q_lat[b, h, c]  = sum_{d < Dn} q[b, h, d] Wuk[h, d, c]                               (fp32, stored bf16)

i.e. k3lab.ref.mla.mla_q's last two steps and absorb_q, with the RMSNorm folded into the projection's rows (the
normed input is never rounded to bf16, nor q_nope before the absorption: the unfused path rounds both).

Layout. Eight warps a CTA, two adjacent rows of Wuq [H (Dn + Dr), Q] a warp over all of Q (lane l reads columns
256 s + 8 l .. + 7 of step s of both rows, cq's step loaded once for the two, the first PRE steps of the rows loaded
first: before the wait under pdl), so a CTA holds 16 rows. The grid's first H NP CTAs (NP = Dn / 16) are the heads'
nope rows, one cluster of NP CTAs a head; the rest hold the rope rows (Dr / 16 CTAs a head, the grid padded to whole
clusters). Each warp sums its cq^2 beside the two dot products from the same loads. A rope warp stores its rows. A
nope warp has loaded its two Wuk rows [C] before the wait (lane l: columns C/32 l .. + C/32 - 1) and multiplies them
by its two q values; the CTA sums its eight warps' products in shared memory (warp order), and each sum of columns
C/NP s .. of the CTA of rank r is stored into shared slot r of the cluster's CTA s (distributed shared memory); after
the cluster barrier CTA s adds its NP slots in rank order into q_lat's columns C/NP s ... The sums run in a fixed
order (no atomics): the same bits on every call; no global workspace.

Floor (k3lab.ops.mla.query_bytes, the one formula; read bandwidth): Wuq H (Dn + Dr) Q 2 + Wuk H Dn C 2 + q_norm Q 2
+ cq B Q 2 + outputs B H (C + Dr) 2: 6.3 MB at TP8 (12 heads, Q 1536, C 512), ~1.4 us at 4.6 TB/s.

Contract (torch tensors on one CUDA device, torch's current stream, CUDA-graph safe once a shape has compiled):
mla_query(cq, q_norm, w_uq, w_uk, q_lat, q_rope, *, eps, pdl=None). cq [B, Q] bf16 (unit stride along Q, a row
stride of 8 elements), B = 1..MAX_BATCH, Q a multiple of 8; q_norm [Q], w_uq [H (Dn + Dr), Q], w_uk [H, Dn, C] bf16
contiguous, Dn one of DN_ALLOWED (clusters of 1..8 CTAs), Dr a multiple of 16, C = 32 2^i up to 512; q_lat [B, H, C]
and q_rope [B, H, Dr] bf16 with unit inner stride (any other strides: views of wider buffers). pdl=True: each warp
loads its first PRE steps of Wuq and (nope rows) its Wuk rows, then waits for the kernel before
(griddepcontrol.wait) and reads cq and q_norm after it; the caller's precondition: the kernel before writes neither
weight. None: the enclosing k3lab_kernels.triton.pdl.pdl_chain's setting.
"""
from typing import Any

import torch

MAX_BATCH = 4
K_STEP = 256      # columns a warp reads a step (32 lanes x 8 bf16)
UNROLL = 4        # steps a warp keeps in flight
PRE = 4           # steps of Wuq a warp loads before anything else (before griddepcontrol.wait under pdl)
_WARPS = 8
_THREADS = 32 * _WARPS
_ROWS = 2         # rows a warp
_CTA_ROWS = _ROWS * _WARPS
DN_ALLOWED = (16, 32, 64, 128)   # nope rows a head: 1..8 CTAs of 16 rows, one cluster
C_ALLOWED = (32, 64, 128, 256, 512)

__all__ = ["DN_ALLOWED", "MAX_BATCH", "mla_query"]

_KERNEL_CLS = None


def _kernel_class():
    """The kernel generator (built once; importing this module never needs cutlass)."""
    global _KERNEL_CLS
    if _KERNEL_CLS is not None:
        return _KERNEL_CLS
    from .kda_decode import _dsl

    d_ = _dsl()
    cuda, cutlass, cute, Float32, Int32 = d_.cuda, d_.cutlass, d_.cute, d_.Float32, d_.Int32
    st_cluster_f32 = d_.st_cluster_f32

    def vec(ptr, off, n):
        return cute.make_tensor(ptr + off, cute.make_layout(n))

    def put(ptr, off, v):
        """ptr[off] = v (a call, not a subscript store: the DSL would take every name in the offset as written)."""
        cute.make_tensor(ptr + off, cute.make_layout(1))[0] = v

    class MLAQueryKernel:
        """Two rows of Wuq a warp; each head's nope CTAs, one cluster, reduce through Wuk by distributed shared
        memory."""

        def __init__(self, B: int, H: int, Q: int, Dn: int, Dr: int, C: int, pdl: bool):
            assert 1 <= B <= MAX_BATCH and Q % 8 == 0 and Dn in DN_ALLOWED and Dr % _CTA_ROWS == 0
            assert C in C_ALLOWED
            self.B, self.H, self.Q, self.Dn, self.Dr, self.C = B, H, Q, Dn, Dr, C
            self.NP = Dn // _CTA_ROWS          # nope CTAs a head: the cluster
            self.RP = Dr // _CTA_ROWS          # rope CTAs a head
            self.NOPE = H * self.NP            # the grid's nope CTAs (first)
            self.GRID = self.NOPE + -(-H * self.RP // self.NP) * self.NP   # rope CTAs padded to whole clusters
            self.VC = C // 32                  # Wuk columns a lane holds
            self.VW = min(self.VC, 8)          # their vector width (16 bytes at most)
            self.CS = C // self.NP             # q_lat columns a CTA of the cluster sums
            self.pdl = bool(pdl)

        @cute.jit
        def __call__(self, p_x: cute.Pointer, p_g: cute.Pointer, p_wq: cute.Pointer, p_wk: cute.Pointer,
                     p_lat: cute.Pointer, p_rope: cute.Pointer, s_x: Int32, s_lb: Int32, s_lh: Int32, s_rb: Int32,
                     s_rh: Int32, eps: Float32, stream: cuda.CUstream):
            self.kernel(p_x, p_g, p_wq, p_wk, p_lat, p_rope, s_x, s_lb, s_lh, s_rb, s_rh, eps).launch(
                grid=[self.GRID, 1, 1], block=[_THREADS, 1, 1], cluster=[self.NP, 1, 1], stream=stream,
                use_pdl=self.pdl)

        @cute.kernel
        def kernel(self, p_x: cute.Pointer, p_g: cute.Pointer, p_wq: cute.Pointer, p_wk: cute.Pointer,
                   p_lat: cute.Pointer, p_rope: cute.Pointer, s_x: Int32, s_lb: Int32, s_lh: Int32, s_rb: Int32,
                   s_rh: Int32, eps: Float32):
            B = self.B
            Q = self.Q
            Dn = self.Dn
            C = self.C
            NP = self.NP
            VC = self.VC
            VW = self.VW
            CS = self.CS
            R = Dn + self.Dr
            S = Q // K_STEP
            tid, _, _ = cute.arch.thread_idx()
            c, _, _ = cute.arch.block_idx()
            warp = cute.arch.make_warp_uniform(cute.arch.warp_idx())
            lane = tid % 32
            nope = c < self.NOPE                                  # CTA-uniform
            rank = c % NP                                         # the CTA's rank in its cluster (nope CTAs)
            h = c // NP
            d = rank * _CTA_ROWS + _ROWS * warp                   # nope: the warp's first row within the head
            if c >= self.NOPE:
                rc = c - self.NOPE
                h = rc // self.RP
                d = Dn + (rc - h * self.RP) * _CTA_ROWS + _ROWS * warp
            live = h < self.H                                     # padding CTAs of the last cluster: nothing
            n = h * R + d
            alloc = cutlass.memory.SmemAllocator()
            s_part = alloc.allocate_tensor(Float32, cute.make_layout(_WARPS * B * C), byte_alignment=16)
            s_slot = alloc.allocate_tensor(Float32, cute.make_layout(NP * B * CS), byte_alignment=16)
            if cutlass.const_expr(NP > 1):
                if nope:
                    cute.arch.cluster_arrive_relaxed()  # the peers' shared memory exists before any remote store
            if live:
                acc = cute.make_rmem_tensor((_ROWS * B,), Float32)
                ss = cute.make_rmem_tensor((B,), Float32)
                acc.fill(0.0)
                ss.fill(0.0)
                wv = cute.make_rmem_tensor((_ROWS * 8,), p_wq.dtype)
                xv = cute.make_rmem_tensor((8,), p_x.dtype)
                gv = cute.make_rmem_tensor((8,), p_g.dtype)
                wrow = n * Q + 8 * lane                           # row n + r at wrow + r Q
                pre = min(PRE, S)
                wpre = cute.make_rmem_tensor((max(pre, 1) * 8 * _ROWS,), p_wq.dtype)
                for s in cutlass.range_constexpr(pre):
                    for r in cutlass.range_constexpr(_ROWS):
                        cute.autovec_copy(vec(p_wq, cute.assume(wrow + r * Q + s * K_STEP, divby=8), 8),
                                          cute.make_tensor(wpre.iterator + (s * _ROWS + r) * 8, cute.make_layout(8)))
                uk = cute.make_rmem_tensor((_ROWS * VC,), p_wk.dtype)
                if nope:  # the two Wuk rows (weights) stream before the wait too
                    for r in cutlass.range_constexpr(_ROWS):
                        for v in cutlass.range_constexpr(VC // VW):
                            cute.autovec_copy(
                                vec(p_wk, cute.assume((h * Dn + d + r) * C + VC * lane + VW * v, divby=VW), VW),
                                cute.make_tensor(uk.iterator + r * VC + VW * v, cute.make_layout(VW)))
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
                            xg = xf * gv[e].to(Float32)
                            for r in cutlass.range_constexpr(_ROWS):
                                acc[r * B + b] = acc[r * B + b] + wpre[(s * _ROWS + r) * 8 + e].to(Float32) * xg
                for s in cutlass.range(pre, S, unroll=UNROLL):
                    for r in cutlass.range_constexpr(_ROWS):
                        cute.autovec_copy(vec(p_wq, cute.assume(wrow + r * Q + s * K_STEP, divby=8), 8),
                                          cute.make_tensor(wv.iterator + r * 8, cute.make_layout(8)))
                    cute.autovec_copy(vec(p_g, cute.assume(s * K_STEP + 8 * lane, divby=8), 8), gv)
                    for b in cutlass.range_constexpr(B):
                        cute.autovec_copy(vec(p_x, cute.assume(b * s_x + s * K_STEP + 8 * lane, divby=8), 8), xv)
                        for e in cutlass.range_constexpr(8):
                            xf = xv[e].to(Float32)
                            ss[b] = ss[b] + xf * xf
                            xg = xf * gv[e].to(Float32)
                            for r in cutlass.range_constexpr(_ROWS):
                                acc[r * B + b] = acc[r * B + b] + wv[r * 8 + e].to(Float32) * xg
                if cutlass.const_expr(Q % K_STEP != 0):  # the last, partial step: lanes past Q load nothing
                    if S * K_STEP + 8 * lane < Q:
                        for r in cutlass.range_constexpr(_ROWS):
                            cute.autovec_copy(vec(p_wq, cute.assume(wrow + r * Q + S * K_STEP, divby=8), 8),
                                              cute.make_tensor(wv.iterator + r * 8, cute.make_layout(8)))
                        cute.autovec_copy(vec(p_g, cute.assume(S * K_STEP + 8 * lane, divby=8), 8), gv)
                        for b in cutlass.range_constexpr(B):
                            cute.autovec_copy(vec(p_x, cute.assume(b * s_x + S * K_STEP + 8 * lane, divby=8), 8),
                                              xv)
                            for e in cutlass.range_constexpr(8):
                                xf = xv[e].to(Float32)
                                ss[b] = ss[b] + xf * xf
                                xg = xf * gv[e].to(Float32)
                                for r in cutlass.range_constexpr(_ROWS):
                                    acc[r * B + b] = acc[r * B + b] + wv[r * 8 + e].to(Float32) * xg
                for b in cutlass.range_constexpr(B):  # butterflies: every lane holds the sums
                    for sh in cutlass.range_constexpr(5):
                        ss[b] = ss[b] + cute.arch.shuffle_sync_bfly(ss[b], offset=16 >> sh)
                        for r in cutlass.range_constexpr(_ROWS):
                            acc[r * B + b] = acc[r * B + b] + cute.arch.shuffle_sync_bfly(acc[r * B + b],
                                                                                          offset=16 >> sh)
                    inv = cute.math.rsqrt(ss[b] * (1.0 / Q) + eps)
                    for r in cutlass.range_constexpr(_ROWS):
                        acc[r * B + b] = acc[r * B + b] * inv
                if c >= self.NOPE:  # rope rows: stored as they are
                    for r in cutlass.range_constexpr(_ROWS):
                        for b in cutlass.range_constexpr(B):
                            if lane == b:
                                put(p_rope, b * s_rb + h * s_rh + d + r - Dn, acc[r * B + b].to(p_rope.dtype))
                if nope:  # the warp's two rows times their Wuk rows, into shared memory
                    for b in cutlass.range_constexpr(B):
                        for v in cutlass.range_constexpr(VC):
                            y = acc[b] * uk[v].to(Float32)
                            for r in cutlass.range_constexpr(1, _ROWS):
                                y = y + acc[r * B + b] * uk[r * VC + v].to(Float32)
                            s_part[(warp * B + b) * C + VC * lane + v] = y
            if cutlass.const_expr(self.pdl):
                if not live:
                    cute.arch.griddepcontrol_wait()  # a padding CTA waits too (every CTA of a PDL launch does)
            if nope:
                cute.arch.sync_threads()
                if cutlass.const_expr(NP > 1):
                    cute.arch.cluster_wait()  # matches the arrive at the top: every peer's shared memory is there
                # the CTA's eight warps summed in warp order, each column sent to the slot `rank` of the cluster's CTA
                # that owns it
                for i in cutlass.range_constexpr((B * C + _THREADS - 1) // _THREADS):
                    t = i * _THREADS + tid
                    if t < B * C:
                        y2 = s_part[t]
                        for w in cutlass.range_constexpr(1, _WARPS):
                            y2 = y2 + s_part[w * B * C + t]
                        bt = t // C
                        col = t - bt * C
                        own = col // CS
                        slot = (rank * B + bt) * CS + col - own * CS
                        if cutlass.const_expr(NP > 1):
                            st_cluster_f32(s_slot.iterator + slot, own, y2)
                        else:
                            s_slot[slot] = y2
                if cutlass.const_expr(NP > 1):
                    cute.arch.cluster_arrive()  # release: the slots are written
                    cute.arch.cluster_wait()
                else:
                    cute.arch.sync_threads()
                for i in cutlass.range_constexpr((B * CS + _THREADS - 1) // _THREADS):
                    t2 = i * _THREADS + tid
                    if t2 < B * CS:  # q_lat[b, h, rank CS + col], the ranks' slots in order
                        bq = t2 // CS
                        cq_ = t2 - bq * CS
                        z = s_slot[bq * CS + cq_]
                        for q in cutlass.range_constexpr(1, NP):
                            z = z + s_slot[(q * B + bq) * CS + cq_]
                        put(p_lat, bq * s_lb + h * s_lh + rank * CS + cq_, z.to(p_lat.dtype))

    _KERNEL_CLS = MLAQueryKernel
    return MLAQueryKernel


# ---------------------------------------------------------------------------------------------
# Host wrapper
# ---------------------------------------------------------------------------------------------

_COMPILED: dict[tuple, Any] = {}


class MLAQueryError(ValueError):
    """An argument of the CuTe MLA query step has the wrong type, shape, dtype, layout or device."""


def _fail(name: str, msg: str):
    raise MLAQueryError(f"mla_query cute: {name!r} {msg}")


def _ptr(t: torch.Tensor, align: int):
    import cutlass
    from cutlass import cute
    from cutlass.cute.runtime import make_ptr
    dt = {torch.float32: cutlass.Float32, torch.bfloat16: cutlass.BFloat16}[t.dtype]
    return make_ptr(dt, t.data_ptr(), cute.AddressSpace.gmem, assumed_align=align)


def mla_query(cq: torch.Tensor, q_norm: torch.Tensor, w_uq: torch.Tensor, w_uk: torch.Tensor, q_lat: torch.Tensor,
              q_rope: torch.Tensor, *, eps: float = 1e-6, pdl: bool | None = None) -> tuple:
    """q_lat [B, H, C], q_rope [B, H, Dr] from cq [B, Q] (module doc). Returns (q_lat, q_rope)."""
    from k3lab_kernels.triton.mla_query import check_args
    from k3lab_kernels.triton.pdl import chain_pdl

    if pdl is None:
        pdl = chain_pdl(None)
    if not isinstance(pdl, bool):
        _fail("pdl", f"must be None or a bool, got {pdl!r}")
    B, Q, H, Dn, Dr, C = check_args(cq, q_norm, w_uq, w_uk, q_lat, q_rope, eps, fail=_fail, max_batch=MAX_BATCH,
                                    cuda=True)
    if Dn not in DN_ALLOWED:
        _fail("w_uk", f"must have Dn in {DN_ALLOWED} (one cluster of Dn / 16 CTAs a head), got {Dn}")
    if Dr % _CTA_ROWS:
        _fail("w_uq", f"must hold Dr rope rows a head, a multiple of {_CTA_ROWS}, got {Dr}")
    dev = cq.device
    import cutlass

    args = [_ptr(cq, 16), _ptr(q_norm, 16), _ptr(w_uq, 16), _ptr(w_uk, 16), _ptr(q_lat, 2), _ptr(q_rope, 2),
            cq.stride(0), q_lat.stride(0), q_lat.stride(1), q_rope.stride(0), q_rope.stride(1),
            cutlass.Float32(float(eps))]
    key = (B, H, Q, Dn, Dr, C, pdl, UNROLL, PRE, dev.index)  # module settings in the key: an A/B recompiles
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
