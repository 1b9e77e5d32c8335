"""KDA decode step (T = 1) as one CuTe DSL kernel, and the device helpers every CuTe KDA kernel shares.

Fuses, per (sequence b, head h), what `k3lab.ref.kda.kda_decode` computes: the depthwise causal conv
update (kernel 4) of the head's 384 q|k|v channels + silu (conv_state [B, 3HD, 3] bf16 shifted in place),
l2norm of q and k, the decay g = lb * sigmoid(exp(A_log[h]) * (f + dt_bias)) and beta = sigmoid(b), the
delta rule S = exp(g)[:, None] * S;  S += beta * outer(k, v - S^T k) on the fp32 state [B, H, 128, 128] in
place, and o = S^T q / sqrt(128) through the gated RMSNorm rms(o; o_norm_w) * sigmoid(gate) into out
[B, H*D] bf16.

Layout ("rows"). 256 threads a CTA, tile_v (TILES) value columns a CTA: 128 is one CTA per head; 64 / 32
/ 16 a cluster of 2 / 4 / 8 CTAs per head, each recomputing the head's small prologue, rank 0 writing
conv_state after the cluster barrier, the output norm's sum of o^2 joined through distributed shared
memory. Warp w owns key rows w, w + 8, ... (a warp instruction covers R = 32 / G rows, G = tile_v / 4
lanes a row, 4 value columns a lane: 16-byte state loads and stores). Prologue: threads 0..127 run the q
and k channels of key row tid, threads 128..255 the v channel and the decay of row tid - 128. Both key
reductions (k^T diag(d) S and q^T diag(d) S) are one pass over the old state, with
o = q^T diag(d) S + (q.k) beta (v - k^T diag(d) S); the warps' partial sums meet in shared memory and
warp 0 alone finishes the output. What the shape decides (each measured: docs/NOTES_kda.md):
  fold   tiles 128 and 64: the prologue hands the pass (q d, k d, d, k) per row, v apart;
  early  tile 128: warp 0 stores the output before its state update, so the CTA ends with state stores;
  rs     tile 128: the warps' partial sums are combined as a reduce-scatter;
  pro_first  tile 128 without pdl: the prologue's loads (a channel's conv weights as one vector) are issued
         before the state's, so the activations do not queue behind 64 KiB of state;
  fast   while the whole grid is resident (_resident_grid): exp, sigmoid and rsqrt as single MUFU ops.

Floor (k3lab.ops.kda.kda_bytes, the one formula): per (b, h) the state 65,536 B read + written,
conv_state 2,304 B read +
written, qkv 768 B, f, gate and out 256 B each, b 2 B (137,218 B), plus the parameters once. 12 heads:
B = 1 1.69 MB (0.39 us at 4.275 TB/s, so launch latency is the bound), B = 64 105.4 MB (24.7 us).

Contract (torch tensors on one CUDA device, torch's current stream, CUDA-graph safe once a shape has
compiled):

    kda_decode(qkv, f, b, gate, params, state, conv_state, out, tile_v=128, pdl=False) -> out

D = 128, conv kernel 4; qkv, f, b, gate, conv_state and out bf16, state fp32, params fp32 / bf16 / fp16;
contiguous, the state 16-byte and gate / out / conv_w / o_norm_w 8-byte aligned. pdl=True (programmatic
dependent launch): each CTA loads its state, conv window and parameters, then waits for the previous
kernel on the stream (griddepcontrol.wait), lets the next one launch, then reads the activations and
writes. The caller's precondition: the kernel directly before does not write this call's state or
conv_state.
"""
import math
from typing import Any

import torch

_D = 128
_W = 4
_THREADS = 256
_L2_EPS = 1e-6  # k3lab.ref.kda.l2norm's fixed eps
# CTAs an H100 / H200 holds at once at two a SM (132 SMs)
_RESIDENT = 2 * 132
# value columns per CTA; 128 // tile_v CTAs of a head form a cluster (at most 8, the portable size)
TILES = (128, 64, 32, 16)

__all__ = ["TILES", "cute_available", "kda_decode"]


def _resident_grid(ctas: int) -> bool:
    """Whether a grid of `ctas` CTAs is resident at once (two on each SM): such a grid is latency-bound, and
    the latency choices (decode `fast`, verify's batched prologue) are on only there; larger grids lose
    with them (docs/NOTES_kda.md, kda_cute_exp_thr.json)."""
    return ctas <= _RESIDENT


def cute_available() -> bool:
    try:
        import cutlass
        import cutlass.cute  # noqa: F401
        return True
    except Exception:  # noqa: BLE001  # pragma: no cover - depends on the machine
        return False






# ---------------------------------------------------------------------------------------------
# The kernel (built lazily so importing this module never needs cutlass)
# ---------------------------------------------------------------------------------------------

_KERNEL_CLS = None
_DSL = None


def _dsl():
    """The CuTe DSL modules and the small device helpers the CuTe KDA kernels share (built once)."""
    global _DSL
    if _DSL is not None:
        return _DSL
    from types import SimpleNamespace

    import cuda.bindings.driver as cuda
    import cutlass
    from cutlass import Float32, Int32, cute
    from cutlass._mlir.dialects import llvm as _llvm
    from cutlass._mlir.dialects import nvvm as _nvvm
    from cutlass.cutlass_dsl import dsl_user_op

    log2e = 1.4426950408889634

    def expf(x, fast=False):
        """exp(x); fast: ex2.approx.ftz (MUFU.EX2 alone, relative error ~2e-7) instead of the accurate
        range-reduced exp."""
        if fast:
            return cute.math.exp2(x * log2e, approx=True, ftz=True)
        return cute.math.exp(x)

    def sigmoid(x, fast=False):
        """1 / (1 + exp(-x)); fast: ex2.approx and rcp.approx (two MUFU ops) instead of the accurate exp and
        the IEEE division (whose slow path is a called subroutine)."""
        if fast:
            return cute.arch.rcp_approx(1.0 + expf(-x, True))
        return 1.0 / (1.0 + cute.math.exp(-x))

    def rsqrtf(x, fast=False):
        if fast:
            return cute.math.rsqrt(x, approx=True, ftz=True)
        return cute.math.rsqrt(x)

    def vec(ptr, off, n):
        """A 1-D view of n contiguous elements at element offset `off` of pointer `ptr`."""
        return cute.make_tensor(ptr + off, cute.make_layout(n))

    @dsl_user_op
    def st_cluster_f32(smem_ptr, cta_rank, val, *, loc=None, ip=None):
        """st.shared::cluster of one fp32 into CTA `cta_rank`'s copy of the local smem address."""
        local = smem_ptr.to_llvm_ptr(loc=loc, ip=ip)
        remote = _nvvm.mapa(_llvm.PointerType.get(7), local, Int32(cta_rank).ir_value(loc=loc, ip=ip),
                            loc=loc, ip=ip)
        _llvm.store(Float32(val).ir_value(loc=loc, ip=ip), remote, loc=loc, ip=ip)

    def position_norms(s_red, base, fast=False):
        """One position's l2norm factors from the lower warps' partial sums s_red[base + w * 4 + 0..2]
        (|q|^2, |k|^2, q.k; see prologue_position): returns (1/|q|, 1/|k|, q.k) with the reference eps."""
        ssq = Float32(0.0)
        ssk = Float32(0.0)
        dot = Float32(0.0)
        for w in range(4):
            ssq = ssq + s_red[base + w * 4 + 0]
            ssk = ssk + s_red[base + w * 4 + 1]
            dot = dot + s_red[base + w * 4 + 2]
        return rsqrtf(ssq + _L2_EPS, fast), rsqrtf(ssk + _L2_EPS, fast), dot

    def warp_sum(x):
        for sh in (16, 8, 4, 2, 1):
            x = x + cute.arch.shuffle_sync_bfly(x, offset=sh)
        return x

    @cute.jit
    def prologue_position(x1t, x2t, f_t, win1: cute.Tensor, win2: cute.Tensor, w1: cute.Tensor, w2: cute.Tensor,
                          a_exp, dtb, lb: cutlass.Constexpr, lower, lane, warp, c, s_info: cute.Tensor, info_base,
                          s_red: cute.Tensor, red_base, fold: cutlass.Constexpr = False, s_v=None, v_base=0,
                          fast: cutlass.Constexpr = False):
        """One position's state-independent work, shared by the decode and verify generators. Threads 0..127 (`lower`):
        conv + silu of the q and k channels of key row c into s_info[info_base + 0, 1] and the warp
        sums |q|^2, |k|^2, q.k into s_red[red_base + warp * 4 + 0..2]; threads 128..255: conv + silu
        of the v channel c into s_info[info_base + 3] and the decay exp(g) of row c into
        s_info[info_base + 2]. Then the conv windows shift by one (win[3] took x_t first).
        fold=True (the decode): the lower thread of row c also forms the decay d and writes
        (q d, k d, d, k) into s_info[info_base + 0..3], so the state passes multiply nothing per row; the
        upper thread writes v_c alone, into s_v[v_base + c] (the value columns read it 4 at a time)."""
        win1[3] = x1t
        y1 = Float32(0.0)
        for i in cutlass.range_constexpr(4):
            y1 = y1 + win1[i].to(Float32) * w1[i]
        y1 = y1 * sigmoid(y1, fast)
        if lower:
            win2[3] = x2t
            y2 = Float32(0.0)
            for i in cutlass.range_constexpr(4):
                y2 = y2 + win2[i].to(Float32) * w2[i]
            y2 = y2 * sigmoid(y2, fast)
            if cutlass.const_expr(fold):
                dd = expf(lb * sigmoid(a_exp * (f_t.to(Float32) + dtb), fast), fast)
                s_info[info_base + 0] = y1 * dd
                s_info[info_base + 1] = y2 * dd
                s_info[info_base + 2] = dd
                s_info[info_base + 3] = y2
            else:
                s_info[info_base + 0] = y1
                s_info[info_base + 1] = y2
            sq = warp_sum(y1 * y1)
            sk = warp_sum(y2 * y2)
            dqk = warp_sum(y1 * y2)
            if lane == 0:
                s_red[red_base + warp * 4 + 0] = sq
                s_red[red_base + warp * 4 + 1] = sk
                s_red[red_base + warp * 4 + 2] = dqk
        else:
            if cutlass.const_expr(fold):
                s_v[v_base + c] = y1
            else:
                fv = f_t.to(Float32)
                g = lb * sigmoid(a_exp * (fv + dtb), fast)
                s_info[info_base + 2] = expf(g, fast)
                s_info[info_base + 3] = y1
        # the conv window after this position (pre-conv inputs, exact bf16 copies)
        for i in cutlass.range_constexpr(3):
            win1[i] = win1[i + 1]
        if lower:
            for i in cutlass.range_constexpr(3):
                win2[i] = win2[i + 1]

    @dsl_user_op
    def bulk_load(dst_smem, src_gmem, mbar, nbytes, *, loc=None, ip=None):
        """cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes of nbytes contiguous bytes (global ->
        this CTA's shared memory, completing on `mbar`; the MLA decode's and the few-token projection's)."""
        _nvvm.cp_async_bulk_shared_cluster_global(
            dst_smem.to_llvm_ptr(loc=loc, ip=ip), src_gmem.to_llvm_ptr(loc=loc, ip=ip),
            mbar.to_llvm_ptr(loc=loc, ip=ip), Int32(nbytes).ir_value(loc=loc, ip=ip), loc=loc, ip=ip)

    @dsl_user_op
    def prefetch_l2(ptr, nbytes, *, loc=None, ip=None):
        """cp.async.bulk.prefetch.L2 of `nbytes` (a multiple of 16) from a 16-byte aligned global address (the
        `prefetch` switch's CuTe kernel, kernels/cute/l2_prefetch.py)."""
        _llvm.inline_asm(None, [ptr.toint(loc=loc, ip=ip).ir_value(loc=loc, ip=ip),
                                Int32(nbytes).ir_value(loc=loc, ip=ip)],
                         "cp.async.bulk.prefetch.L2.global [$0], $1;", "l,r", has_side_effects=True,
                         is_align_stack=False, asm_dialect=_llvm.AsmDialect.AD_ATT, loc=loc, ip=ip)

    _DSL = SimpleNamespace(cuda=cuda, cutlass=cutlass, Float32=Float32, Int32=Int32, cute=cute,
                           sigmoid=sigmoid, expf=expf, rsqrtf=rsqrtf, vec=vec, st_cluster_f32=st_cluster_f32,
                           bulk_load=bulk_load, prefetch_l2=prefetch_l2,
                           warp_sum=warp_sum,
                           prologue_position=prologue_position, position_norms=position_norms)
    return _DSL


def _kernel_class():
    """The decode generator (built once)."""
    global _KERNEL_CLS
    if _KERNEL_CLS is not None:
        return _KERNEL_CLS
    d = _dsl()
    cuda, cutlass, Float32, Int32, cute = d.cuda, d.cutlass, d.Float32, d.Int32, d.cute
    sigmoid, vec, st_cluster_f32, warp_sum = d.sigmoid, d.vec, d.st_cluster_f32, d.warp_sum
    prologue_position, position_norms = d.prologue_position, d.position_norms
    rsqrtf = d.rsqrtf

    class KDADecodeKernel:
        """One CTA (or a cluster of 128 / tile_v CTAs) per (b, h); state and conv_state updated in place."""

        def __init__(self, B: int, H: int, eps: float, lower_bound: float, tile_v: int = 128, pdl: bool = False):
            assert tile_v in TILES, tile_v
            self.B, self.H = B, H
            self.eps, self.lb = float(eps), float(lower_bound)
            self.TV = tile_v            # value columns per CTA
            self.NC = 128 // tile_v     # CTAs per head (a cluster; they share the output RMSNorm)
            self.G = tile_v // 4        # lanes across one row of the tile (4 columns each)
            self.R = 32 // self.G       # rows one warp instruction covers
            self.S = 128 // (8 * self.R)  # row steps per thread
            offs, o_ = [], self.G
            while o_ < 32:
                offs.append(o_)
                o_ *= 2
            self.red_offs = tuple(offs)   # shuffle offsets joining lanes that share columns
            # the shape's choices (module doc): approximate transcendentals while the grid is resident;
            # reduce-scatter combine and the output before the update at tile 128; the prologue folds the
            # decay into the pass's row factors at tiles 128 and 64 (the narrow tiles' B = 1 latency chain,
            # which fold lengthens on the q/k threads, keeps the plain split)
            self.fast = _resident_grid(B * H * self.NC)
            self.rs = tile_v == 128
            self.early = tile_v == 128
            self.fold = tile_v >= 64
            # pdl's state loads precede its wait for the previous kernel, so it keeps the state-first order
            self.pro_first = tile_v == 128 and not pdl
            # pdl: the state, conv window and parameter loads before griddepcontrol.wait, the activations after
            self.pdl = bool(pdl)

        @cute.jit
        def __call__(self, p_qkv: cute.Pointer, p_f: cute.Pointer, p_b: cute.Pointer,
                     p_gate: cute.Pointer, p_convw: cute.Pointer, p_alog: cute.Pointer,
                     p_dtb: cute.Pointer, p_onw: cute.Pointer, p_state: cute.Pointer,
                     p_conv: cute.Pointer, p_out: cute.Pointer, p_shist: cute.Pointer,
                     p_chist: cute.Pointer, p_len: cute.Pointer, stream: cuda.CUstream):
            if cutlass.const_expr(self.NC == 1):
                self.kernel(p_qkv, p_f, p_b, p_gate, p_convw, p_alog, p_dtb, p_onw, p_state, p_conv,
                            p_out, p_shist, p_chist, p_len).launch(
                    grid=[self.H, self.B, 1], block=[_THREADS, 1, 1], stream=stream, use_pdl=self.pdl)
            else:
                self.kernel(p_qkv, p_f, p_b, p_gate, p_convw, p_alog, p_dtb, p_onw, p_state, p_conv,
                            p_out, p_shist, p_chist, p_len).launch(
                    grid=[self.H * self.NC, self.B, 1], block=[_THREADS, 1, 1],
                    cluster=[self.NC, 1, 1], stream=stream, use_pdl=self.pdl)

        @cute.kernel
        def kernel(self, p_qkv: cute.Pointer, p_f: cute.Pointer, p_b: cute.Pointer,
                   p_gate: cute.Pointer, p_convw: cute.Pointer, p_alog: cute.Pointer,
                   p_dtb: cute.Pointer, p_onw: cute.Pointer, p_state: cute.Pointer,
                   p_conv: cute.Pointer, p_out: cute.Pointer, p_shist: cute.Pointer,
                   p_chist: cute.Pointer, p_len: cute.Pointer):
            # (p_shist, p_chist, p_len: verify's history and lengths pointers, unused at T = 1)
            D = _D
            H = self.H
            HD = H * D
            C = 3 * HD
            scale = 1.0 / math.sqrt(D)

            TV, NC, G, R, S = self.TV, self.NC, self.G, self.R, self.S
            tid, _, _ = cute.arch.thread_idx()
            hx, bb, _ = cute.arch.block_idx()
            h = hx
            rank = Int32(0)
            if cutlass.const_expr(NC > 1):
                h = hx // NC
                rank = hx % NC
            warp = cute.arch.make_warp_uniform(cute.arch.warp_idx())
            lane = tid % 32
            rsub = lane // G   # which of the R rows of a warp instruction
            cg = lane % G      # which 4-column group of the tile
            col0 = rank * TV + cg * 4  # first of this thread's 4 value columns (head-local)
            lower = tid < 128
            half = tid // 128  # 0: q/k channels of row c; 1: v channel and decay gate of row c
            c = tid % 128  # key row (lower half) / value channel + gate row (upper half)

            smem = cutlass.memory.SmemAllocator()
            # per key row r: (q_raw, k_raw, decay d, v_raw[r]); fold: (q d, k d, d, k)
            s_info = smem.allocate_tensor(Float32, cute.make_layout(128 * 4), byte_alignment=16)
            s_tot = None
            if cutlass.const_expr(self.rs):
                s_tot = smem.allocate_tensor(Float32, cute.make_layout(256), byte_alignment=16)
            s_v = None
            if cutlass.const_expr(self.fold):
                s_v = smem.allocate_tensor(Float32, cute.make_layout(128), byte_alignment=16)
            # lower warps 0..3: (|q|^2, |k|^2, q.k, pad)
            s_red = smem.allocate_tensor(Float32, cute.make_layout(16), byte_alignment=16)
            # per warp partial column sums: [warp][k^T d S (128) | q^T d S (128)]
            s_part = smem.allocate_tensor(Float32, cute.make_layout(8 * 256), byte_alignment=16)
            # cluster: every CTA's partial sum of o^2, written by the peers
            s_ss = smem.allocate_tensor(Float32, cute.make_layout(NC), byte_alignment=16)

            # ---- the state loads first (pro_first: after the prologue's loads): S x 16 B per thread -----
            # thread's rows: (i * 8 + warp) * R + rsub, i < S; columns col0 .. col0 + 3
            s_off = cute.assume(((bb * H + h) * D + warp * R + rsub) * D + col0, divby=4)
            g_state = cute.make_tensor(p_state + s_off, cute.make_layout((4, S), stride=(1, 8 * R * D)))
            r_s = cute.make_rmem_tensor((4, S), Float32)
            if cutlass.const_expr(not self.pro_first):
                cute.autovec_copy(g_state, r_s)
                if cutlass.const_expr(NC > 1):
                    cute.arch.cluster_arrive_relaxed()  # peers' smem must exist before remote stores

            # ---- per-thread prologue constants --------------------------------------------------
            # channel 1: q (lower) or v (upper); channel 2: k (lower only)
            ch1 = half * (2 * HD) + h * D + c
            ch2 = HD + h * D + c
            win1 = cute.make_rmem_tensor((4,), p_qkv.dtype)
            win2 = cute.make_rmem_tensor((4,), p_qkv.dtype)
            w1 = cute.make_rmem_tensor((4,), Float32)
            w2 = cute.make_rmem_tensor((4,), Float32)
            conv_g = cute.make_tensor(p_conv, cute.make_layout(self.B * C * 3))
            convw_g = cute.make_tensor(p_convw, cute.make_layout(C * 4))
            for i in cutlass.range_constexpr(3):
                win1[i] = conv_g[(bb * C + ch1) * 3 + i]
            if cutlass.const_expr(self.pro_first):  # a channel's 4 weights as one vector load
                w1_raw = cute.make_rmem_tensor((4,), p_convw.dtype)
                cute.autovec_copy(vec(p_convw, cute.assume(ch1 * 4, divby=4), 4), w1_raw)
                for i in cutlass.range_constexpr(4):
                    w1[i] = w1_raw[i].to(Float32)
            else:
                for i in cutlass.range_constexpr(4):
                    w1[i] = convw_g[ch1 * 4 + i].to(Float32)
            # the gate constants (upper) / k channel (lower) share registers by role
            a_exp = cute.math.exp(cute.make_tensor(p_alog, cute.make_layout(H))[h].to(Float32))
            dtb = cute.make_tensor(p_dtb, cute.make_layout(HD))[h * D + c].to(Float32)
            if lower:
                for i in cutlass.range_constexpr(3):
                    win2[i] = conv_g[(bb * C + ch2) * 3 + i]
                if cutlass.const_expr(self.pro_first):
                    w2_raw = cute.make_rmem_tensor((4,), p_convw.dtype)
                    cute.autovec_copy(vec(p_convw, cute.assume(ch2 * 4, divby=4), 4), w2_raw)
                    for i in cutlass.range_constexpr(4):
                        w2[i] = w2_raw[i].to(Float32)
                else:
                    for i in cutlass.range_constexpr(4):
                        w2[i] = convw_g[ch2 * 4 + i].to(Float32)

            # output-norm weights for warp 0's 4 value columns
            r_onw_raw = cute.make_rmem_tensor((4,), p_onw.dtype)
            cute.autovec_copy(vec(p_onw, cute.assume(col0, divby=4), 4), r_onw_raw)

            if cutlass.const_expr(self.pdl):
                # the previous kernel on the stream produced the activations (and may read `out`): wait
                # for it here, then let the next kernel launch (it overlaps only this one: it waits for
                # us before its own activations, and we waited for our predecessor)
                cute.arch.griddepcontrol_wait()
                cute.arch.griddepcontrol_launch_dependents()

            # the activations now (no global load waits behind a barrier)
            qkv_g = cute.make_tensor(p_qkv, cute.make_layout(self.B * C))
            f_g = cute.make_tensor(p_f, cute.make_layout(self.B * HD))
            b_g = cute.make_tensor(p_b, cute.make_layout(self.B * H))
            x1 = cute.make_rmem_tensor((1,), p_qkv.dtype)
            x2 = cute.make_rmem_tensor((1,), p_qkv.dtype)
            f_r = cute.make_rmem_tensor((1,), p_f.dtype)
            b_r = cute.make_rmem_tensor((1,), p_b.dtype)
            gate_r = cute.make_rmem_tensor((4,), p_gate.dtype)
            x1[0] = qkv_g[bb * C + ch1]
            f_r[0] = f_g[bb * HD + h * D + c]
            b_r[0] = b_g[bb * H + h]
            cute.autovec_copy(vec(p_gate, cute.assume(bb * HD + h * D + col0, divby=4), 4), gate_r)
            if lower:
                x2[0] = qkv_g[bb * C + ch2]
            if cutlass.const_expr(self.pro_first):
                cute.arch.sync_warp()  # keeps the compiler from hoisting the state loads above the prologue's
                cute.autovec_copy(g_state, r_s)

            # ---------------- prologue: conv + silu, gate, norms; windows shift -----------------
            prologue_position(x1[0], x2[0], f_r[0], win1, win2, w1, w2, a_exp, dtb, self.lb, lower, lane,
                              warp, c, s_info, c * 4, s_red, 0, self.fold, s_v, 0, self.fast)
            # one CTA a head writes conv_state now; with a cluster the peers read it too, so rank 0
            # writes it after the cluster barrier of the output norm (below)
            if cutlass.const_expr(NC == 1):
                for i in cutlass.range_constexpr(3):
                    conv_g[(bb * C + ch1) * 3 + i] = win1[i]
                if lower:
                    for i in cutlass.range_constexpr(3):
                        conv_g[(bb * C + ch2) * 3 + i] = win2[i]

            cute.arch.sync_threads()

            # ---------------- pass 1: k^T diag(d) S and q^T diag(d) S over the old state --------
            rq, rk, dot = position_norms(s_red, 0, self.fast)
            qk = dot * rq * rk
            beta = sigmoid(b_r[0].to(Float32), self.fast)

            acc_k = cute.make_rmem_tensor((4,), Float32)
            acc_q = cute.make_rmem_tensor((4,), Float32)
            acc_k.fill(0.0)
            acc_q.fill(0.0)
            r_info = cute.make_rmem_tensor((4,), Float32)
            r_i2 = cute.make_rmem_tensor((2,), Float32)
            for i in cutlass.range_constexpr(S):
                r = (i * 8 + warp) * R + rsub
                if cutlass.const_expr(self.fold):
                    cute.autovec_copy(vec(s_info.iterator, cute.assume(r * 4, divby=4), 2), r_i2)
                    qd = r_i2[0]
                    kd = r_i2[1]
                else:
                    cute.autovec_copy(vec(s_info.iterator, cute.assume(r * 4, divby=4), 4), r_info)
                    qd = r_info[0] * r_info[2]
                    kd = r_info[1] * r_info[2]
                for j in cutlass.range_constexpr(4):
                    acc_k[j] = acc_k[j] + kd * r_s[j, i]
                    acc_q[j] = acc_q[j] + qd * r_s[j, i]
            # lanes holding the same columns (different rows) combine by shuffles
            for si in cutlass.range_constexpr(len(self.red_offs)):
                for j in cutlass.range_constexpr(4):
                    acc_k[j] = acc_k[j] + cute.arch.shuffle_sync_bfly(acc_k[j], offset=self.red_offs[si])
                    acc_q[j] = acc_q[j] + cute.arch.shuffle_sync_bfly(acc_q[j], offset=self.red_offs[si])
            p_off = cute.assume(warp * 256 + cg * 4, divby=4)
            if cutlass.const_expr(R == 1):
                cute.autovec_copy(acc_k, vec(s_part.iterator, p_off, 4))
                cute.autovec_copy(acc_q, vec(s_part.iterator, p_off + 128, 4))
            else:
                if rsub == 0:
                    cute.autovec_copy(acc_k, vec(s_part.iterator, p_off, 4))
                    cute.autovec_copy(acc_q, vec(s_part.iterator, p_off + 128, 4))

            cute.arch.sync_threads()

            # ---------------- combine partials, delta-rule update ---------------------------------
            tot_k = cute.make_rmem_tensor((4,), Float32)
            tot_q = cute.make_rmem_tensor((4,), Float32)
            tot_k.fill(0.0)
            tot_q.fill(0.0)
            r_p = cute.make_rmem_tensor((4,), Float32)
            if cutlass.const_expr(self.rs):
                # thread tid: column tid of k^T diag(d) S (tid < 128) or of q^T diag(d) S, over the 8 warps
                # (the same summation order as below: fp32 on the GPU gives the same sums)
                tsum = Float32(0.0)
                for w in cutlass.range_constexpr(8):
                    tsum = tsum + s_part[w * 256 + tid]
                s_tot[tid] = tsum
                cute.arch.sync_threads()
                cute.autovec_copy(vec(s_tot.iterator, cute.assume(col0, divby=4), 4), tot_k)
                if warp == 0:
                    cute.autovec_copy(vec(s_tot.iterator, cute.assume(128 + col0, divby=4), 4), tot_q)
            else:
                for w in cutlass.range_constexpr(8):
                    o_w = cute.assume(w * 256 + cg * 4, divby=4)
                    cute.autovec_copy(vec(s_part.iterator, o_w, 4), r_p)
                    for j in cutlass.range_constexpr(4):
                        tot_k[j] = tot_k[j] + r_p[j]
                # q^T diag(d) S feeds the output only, which warp 0 alone forms
                if warp == 0:
                    for w in cutlass.range_constexpr(8):
                        o_w = cute.assume(w * 256 + cg * 4 + 128, divby=4)
                        cute.autovec_copy(vec(s_part.iterator, o_w, 4), r_p)
                        for j in cutlass.range_constexpr(4):
                            tot_q[j] = tot_q[j] + r_p[j]
            u = cute.make_rmem_tensor((4,), Float32)
            uk = cute.make_rmem_tensor((4,), Float32)  # fold: u / |k| (the update's k is unnormalised)
            if cutlass.const_expr(self.fold):
                r_v = cute.make_rmem_tensor((4,), Float32)
                cute.autovec_copy(vec(s_v.iterator, cute.assume(col0, divby=4), 4), r_v)
                for j in cutlass.range_constexpr(4):
                    u[j] = beta * (r_v[j] - rk * tot_k[j])
                    uk[j] = rk * u[j]
            else:
                for j in cutlass.range_constexpr(4):
                    vj = s_info[(col0 + j) * 4 + 3]
                    u[j] = beta * (vj - rk * tot_k[j])
            # early: the output (phase 0) before the state update (phase 1); otherwise after it
            for ph in cutlass.range_constexpr(2):
                if cutlass.const_expr(ph == 1):
                    for i in cutlass.range_constexpr(S):
                        r = (i * 8 + warp) * R + rsub
                        if cutlass.const_expr(self.fold):
                            cute.autovec_copy(vec(s_info.iterator, cute.assume(r * 4 + 2, divby=2), 2), r_i2)
                            for j in cutlass.range_constexpr(4):
                                r_s[j, i] = r_i2[0] * r_s[j, i] + r_i2[1] * uk[j]
                        else:
                            cute.autovec_copy(vec(s_info.iterator, cute.assume(r * 4, divby=4), 4), r_info)
                            dr = r_info[2]
                            kr = r_info[1] * rk
                            for j in cutlass.range_constexpr(4):
                                r_s[j, i] = dr * r_s[j, i] + kr * u[j]
                    cute.autovec_copy(r_s, g_state)

                if cutlass.const_expr(ph == (0 if self.early else 1)):
                    # ---------------- output: o = S^T q / sqrt(D), gated RMSNorm ---------------------
                    # warp 0 lanes 0..G-1 own the tile's columns; the sum of o^2 over the head's 128
                    # columns is completed across the cluster through distributed shared memory.
                    o = cute.make_rmem_tensor((4,), Float32)
                    ss = Float32(0.0)
                    if warp == 0:
                        for j in cutlass.range_constexpr(4):
                            o[j] = (rq * tot_q[j] + qk * u[j]) * scale
                            ss = ss + o[j] * o[j]
                    if cutlass.const_expr(NC == 1):
                        if warp == 0:
                            ss = warp_sum(ss)
                    else:
                        if warp == 0:
                            if rsub != 0:
                                ss = Float32(0.0)
                            ss = warp_sum(ss)
                            cute.arch.cluster_wait()  # matches the arrive after the state loads
                            if lane < NC:
                                st_cluster_f32(s_ss.iterator + rank, lane, ss)
                        else:
                            cute.arch.cluster_wait()
                        cute.arch.cluster_arrive()
                        cute.arch.cluster_wait()
                        if rank == 0:  # every peer has read the conv window by now
                            for i in cutlass.range_constexpr(3):
                                conv_g[(bb * C + ch1) * 3 + i] = win1[i]
                            if lower:
                                for i in cutlass.range_constexpr(3):
                                    conv_g[(bb * C + ch2) * 3 + i] = win2[i]
                        ss = Float32(0.0)
                        for rr in cutlass.range_constexpr(NC):
                            ss = ss + s_ss[rr]
                    if warp == 0:
                        o_off = cute.assume(bb * HD + h * D + col0, divby=4)
                        inv = rsqrtf(ss * (1.0 / D) + self.eps, self.fast)
                        r_out = cute.make_rmem_tensor((4,), p_out.dtype)
                        for j in cutlass.range_constexpr(4):
                            val = o[j] * inv * r_onw_raw[j].to(Float32) * sigmoid(gate_r[j].to(Float32), self.fast)
                            r_out[j] = val.to(p_out.dtype)
                        if cutlass.const_expr(NC == 1):
                            cute.autovec_copy(r_out, vec(p_out, o_off, 4))
                        else:
                            if lane < G:
                                cute.autovec_copy(r_out, vec(p_out, o_off, 4))

    _KERNEL_CLS = KDADecodeKernel
    return KDADecodeKernel


# ---------------------------------------------------------------------------------------------
# Host wrappers
# ---------------------------------------------------------------------------------------------

_COMPILED: dict[tuple, Any] = {}


def _cutlass_dtype(dt: torch.dtype):
    import cutlass
    m = {torch.float32: cutlass.Float32, torch.bfloat16: cutlass.BFloat16,
         torch.float16: cutlass.Float16, torch.int32: cutlass.Int32}
    if dt not in m:
        raise TypeError(f"kda cute: unsupported dtype {dt}")
    return m[dt]


def gmem_ptr(t: torch.Tensor, dtype, align: int):
    """A global-memory pointer of cutlass `dtype` at t's data, `align` bytes assumed (the host side of every CuTe
    kernel that names the element type itself; the caller checks the alignment)."""
    from cutlass import cute
    from cutlass.cute.runtime import make_ptr
    return make_ptr(dtype, t.data_ptr(), cute.AddressSpace.gmem, assumed_align=align)


def _ptr(t: torch.Tensor, align: int = 16):
    p = t.data_ptr()
    if p % align:
        raise ValueError(f"kda cute: tensor base pointer must be {align}-byte aligned (got 0x{p:x})")
    return gmem_ptr(t, _cutlass_dtype(t.dtype), align)


def _check(name: str, t: torch.Tensor, shape: tuple, dtypes: tuple, device):
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"kda cute: {name} must be a torch.Tensor")
    if t.device.type != "cuda":
        raise ValueError(f"kda cute: {name} must be on a CUDA device (got {t.device})")
    if t.device != device:
        raise ValueError(f"kda cute: {name} is on {t.device}, expected {device}")
    if tuple(t.shape) != tuple(shape):
        raise ValueError(f"kda cute: {name} has shape {tuple(t.shape)}, expected {tuple(shape)}")
    if t.dtype not in dtypes:
        raise TypeError(f"kda cute: {name} has dtype {t.dtype}, expected one of {dtypes}")
    if not t.is_contiguous():
        raise ValueError(f"kda cute: {name} must be contiguous")


_BF16 = (torch.bfloat16,)
_F32 = (torch.float32,)
_PARAM = (torch.float32, torch.bfloat16, torch.float16)


def _validate(qkv, f, b, gate, params, state, conv_state, out, tile_v, T):
    if tile_v not in TILES:
        raise NotImplementedError(f"kda cute: tile_v must be one of {TILES} (got {tile_v})")
    if not isinstance(qkv, torch.Tensor) or qkv.device.type != "cuda":
        raise ValueError("kda cute: qkv must be a CUDA tensor")
    H, D, W = params.heads, params.head_dim, params.conv_kernel
    if D != _D:
        raise NotImplementedError(f"kda cute: head_dim must be 128 (got {D})")
    if W != _W:
        raise NotImplementedError(f"kda cute: conv kernel must be 4 (got {W})")
    B = qkv.shape[0]
    if B < 1:
        raise ValueError("kda cute: empty batch")
    dev = qkv.device
    lead = (B,) if T is None else (B, T)
    C = 3 * H * D
    _check("qkv", qkv, lead + (C,), _BF16, dev)
    _check("f", f, lead + (H * D,), _BF16, dev)
    _check("b", b, lead + (H,), _BF16, dev)
    _check("gate", gate, lead + (H * D,), _BF16, dev)
    _check("state", state, (B, H, D, D), _F32, dev)
    _check("conv_state", conv_state, (B, C, W - 1), _BF16, dev)
    _check("out", out, lead + (H * D,), _BF16, dev)
    _check("params.conv_w", params.conv_w, (C, W), _PARAM, dev)
    _check("params.A_log", params.A_log, (H,), _PARAM, dev)
    _check("params.dt_bias", params.dt_bias, (H * D,), _PARAM, dev)
    _check("params.o_norm_w", params.o_norm_w, (D,), _PARAM, dev)
    return B, H


def _get_compiled(key, build, args):
    """The compiled kernel of `key`: `build()` (a kernel object) compiled for `args` on first use."""
    fn = _COMPILED.get(key)
    if fn is None:
        from cutlass import cute
        fn = cute.compile(build(), *args)
        _COMPILED[key] = fn
    return fn


def _stream(dev):
    import cuda.bindings.driver as cuda
    return cuda.CUstream(torch.cuda.current_stream(dev).cuda_stream)


def _kernel_args(qkv, f, b, gate, params, state, conv_state, out, state_hist, conv_hist, lengths):
    """The 14 pointers the decode and verify generators take, in their order. lengths=None (uniform T): an Int32 pointer
    the kernel never reads."""
    if lengths is None:
        import cutlass
        from cutlass import cute
        from cutlass.cute.runtime import make_ptr
        p_len = make_ptr(cutlass.Int32, state.data_ptr(), cute.AddressSpace.gmem, assumed_align=4)
    else:
        p_len = _ptr(lengths, 4)
    return [_ptr(qkv, 2), _ptr(f, 2), _ptr(b, 2), _ptr(gate, 8), _ptr(params.conv_w, 8),
            _ptr(params.A_log, params.A_log.element_size()),
            _ptr(params.dt_bias, params.dt_bias.element_size()),
            _ptr(params.o_norm_w, 8), _ptr(state), _ptr(conv_state, 2), _ptr(out, 8),
            _ptr(state_hist), _ptr(conv_hist, 2), p_len]


def _params_key(params) -> tuple:
    """What of the parameters a compiled kernel depends on (constants and dtypes)."""
    return (float(params.eps), float(params.lower_bound), params.conv_w.dtype, params.A_log.dtype,
            params.dt_bias.dtype, params.o_norm_w.dtype)


def kda_decode(qkv, f, b, gate, params, state, conv_state, out, tile_v: int = 128, pdl: bool = False):
    """Fused KDA decode step. Updates `state` [B,H,128,128] fp32 and `conv_state` [B,3HD,3] bf16 in
    place and writes `out` [B,H*128] bf16. Returns `out`. tile_v: value columns a CTA (TILES).
    pdl=True: programmatic dependent launch (module doc); the kernel directly before this one on the
    stream must not write this call's `state` or `conv_state` (true in a model, where the layer's input
    projection precedes it; false for two decode steps of the same state back to back)."""
    if not isinstance(pdl, bool):
        raise TypeError(f"kda cute: pdl must be a bool (got {pdl!r})")
    B, H = _validate(qkv, f, b, gate, params, state, conv_state, out, tile_v, None)
    dev = qkv.device
    # no history at T = 1: state/conv_state stand in for the (never written) history pointers
    args = _kernel_args(qkv, f, b, gate, params, state, conv_state, out, state, conv_state, None)
    key = ("decode", B, H, tile_v, pdl, dev.index) + _params_key(params)
    with torch.cuda.device(dev):
        stream = _stream(dev)
        fn = _get_compiled(key, lambda: _kernel_class()(B, H, params.eps, params.lower_bound, tile_v, pdl),
                           args + [stream])
        fn(*args, stream)
    return out
