"""KDA chunked prefill in CuTe DSL, following `kda_prefill_chunked` in k3lab.ref.kda and the launch
structure of kernels/triton/kda_prefill.py (same host signature and semantics).

Launches (SIMT fp32 maths throughout; correctness over speed: this path fills states and serves the
numerics study of the intra-chunk inverse):
  1. prep   (chunk, b*h), 128 threads (one per channel d): causal conv over [conv_state, x] + silu of
            the head's q|k|v channels, the decay gate g = lb*sigmoid(exp(A_log)*(f+dt_bias)) and its
            in-chunk cumulative sum G, beta = sigmoid(b); then (through shared memory) the per-position
            l2norm of q and k. Positions past L get q=k=v=g=beta=0 (exactly neutral). Writes fp32
            q, k, v, G [B*H, Lp, 128] and beta [B*H, Lp] (Lp = L rounded up to the chunk).
  2. intra  (chunk, b*h), 256 threads: A_ts = beta_t sum_d k_t k_s exp(G_t-G_s) (s < t) and
            Aqk_ts = sum_d q_t k_s exp(G_t-G_s) (s <= t), exp arguments clamped <= 0 (never exp(-G));
            a thread owns rows t and CH-1-t (balanced triangle) and a strided set of columns s. The
            unit lower-triangular inverse X = (I+A)^-1 by forward substitution in fp32, one thread a
            column (inverse="bf16": A rounded to bf16 first, round-to-nearest-even as torch does);
            W = X diag(beta)(k e^G), U0 = X diag(beta) v. Writes W, U0 [B*H, Lp, 128], Aqk [B*H, NC, CH, CH].
  3a. grouped=False, chunks (value tile, b*h), 256 threads: chunks in order with the state tile
            S [128, tile_v] in shared memory: u = U0 - W S; o = scale ((q e^G) S + Aqk u);
            S = e^{G_C} S + (k e^{G_C-G})^T u. Reads/writes `state` (fp32 or bf16) in place.
  3b. grouped=True: summary (value tile, b*h, chunk): M = diag(e^{G_C}) - (k e^{G_C-G})^T W and
            N = (k e^{G_C-G})^T U0 ([128, 128] per chunk, tile_v columns a CTA); scan (value tile, b*h):
            S_{c+1} = M_c S_c + N_c in order, saving every chunk's start state; out (value tile, b*h,
            chunk): launch 3a's code for one chunk from its saved start state, all chunks in parallel.
  4. norm   (rows/8 + channels/256): gated RMSNorm rms(o; o_norm_w) * sigmoid(gate), a warp per
            (b, l, h) row -> out [B, L, H*128] bf16; the trailing CTAs write the conv tail:
            conv_state <- the last 3 entries of [conv_state, x] (prep read the old one, same stream).
So 4 launches (grouped=False) or 6 (grouped=True).

Floor (k3lab.ops.kda.kda_bytes(..., prefill=True); B=1, L=4096, H=12, D=128): qkv 37.7 MB + f 12.6 MB +
gate 12.6 MB + out 12.6 MB + b 0.1 MB + fp32 state read and written 1.6 MB + conv state and params
0.1 MB = 77.3 MB -> 18.1 us at 4.275 TB/s.
What this design moves instead (estimate, same shape): the fp32 intermediates q, k, v, G, W, U0 and o
(25 MB each) are written once and read once or twice, Aqk (12.6 MB) once, and the value tiles of a
head re-read its chunk's q, k, G, W (mostly from L2): about 500 MB, ~7x the floor; grouped=True adds
M, N and the start states (50 MB each, written and read: ~300 MB). The SIMT fp32 maths (~8 GFLOP
and ~0.2 G exponentials) and the sequential chunk chain (B*H*128/tile_v CTAs, 48 at this shape) are
the larger cost: expect hundreds of microseconds, not the floor. It is a correctness-first kernel for
the numerics study and for filling states, not a tuned one (tensor-core MMA would be the next step;
the H200 figures are in docs/NOTES_kda.md).

Supported: D = 128, conv kernel 4, chunk in {16, 32, 64}, inverse in {"fp32", "bf16"}, grouped
bool, tile_v in {16, 32, 64, 128} (value columns a CTA in the state passes), qkv/f/b/gate/conv_state/out
bf16 contiguous, state fp32 or bf16 (updated in place; bf16 is read into fp32 and rounded once at the
end), params fp32/bf16/fp16; any B, H and L >= 1 (runtime arguments: one compile per chunk, tile_v,
inverse, form and dtypes) while the scratch buffers fit 32-bit indexing (else NotImplementedError).
Anything else raises ValueError / TypeError / NotImplementedError naming the argument; there is no
fallback.

Host API (torch tensors on one CUDA device, launched on torch's current stream; the fp32 scratch
buffers are torch allocations made per call, from the graph's pool under torch.cuda.graph capture):

    kda_prefill(qkv, f, b, gate, params, state, conv_state, out, chunk=64, inverse="fp32",
                grouped=False, tile_v=32) -> out
    qkv [B, L, 3*H*128], f/gate [B, L, H*128], b [B, L, H]; out [B, L, H*128];
    state [B, H, 128, 128] and conv_state [B, 3*H*128, 3] updated in place to the end of the sequence.
"""
import functools
import math
from types import SimpleNamespace
from typing import Any

import torch

from .kda_decode import _BF16, _D, _L2_EPS, _PARAM, _W, _check, _dsl, _ptr, _stream

__all__ = ["PREFILL_CHUNKS", "PREFILL_INVERSES", "PREFILL_TILES", "kda_prefill"]

PREFILL_CHUNKS = (16, 32, 64)
PREFILL_INVERSES = ("fp32", "bf16")
PREFILL_TILES = (16, 32, 64, 128)
_STATE = (torch.float32, torch.bfloat16)
_DP = _D + 4  # shared-memory row pitch of [CH, D] fp32 tiles: 16-byte aligned, rows 4 banks apart
_INT32_MAX = 2**31 - 1




# ---------------------------------------------------------------------------------------------
# The kernels (built lazily so importing this module never needs cutlass)
# ---------------------------------------------------------------------------------------------

@functools.cache
def _classes():
    """The prefill kernel classes (prep, intra, chunks, summary, scan, norm), built once."""
    d = _dsl()
    cuda, cutlass, Float32, Int32, cute = d.cuda, d.cutlass, d.Float32, d.Int32, d.cute
    sigmoid, vec, warp_sum = d.sigmoid, d.vec, d.warp_sum
    D, DP = _D, _DP

    def flat(ptr, n):
        """A 1-D tensor over n elements at `ptr` (gmem)."""
        return cute.make_tensor(ptr, cute.make_layout(n))

    def ld4(src, off, dst):
        """dst (4 registers) <- 4 contiguous elements at element offset `off` (divisible by 4)."""
        cute.autovec_copy(vec(src, cute.assume(off, divby=4), 4), dst)

    def st4(src, dst, off):
        cute.autovec_copy(src, vec(dst, cute.assume(off, divby=4), 4))

    def smem_f32(smem, n):
        return smem.allocate_tensor(Float32, cute.make_layout(n), byte_alignment=16)

    def chunk_count(L, CH):
        """(chunks, padded length Lp) of a sequence of L positions."""
        nc = (L + (CH - 1)) // CH
        return nc, nc * CH

    def kdecay_fill(p_k, p_G, base, tid, CH, s_k, r4, g4, gc4):
        """s_k <- k e^{G_C - G} of the chunk at element offset `base` ([CH, D] rows, pitch DP), the
        exp argument clamped <= 0; G_C = the chunk's last row of G. Every thread takes CH/8 float4s."""
        gcb = base + (CH - 1) * D
        # a plain Python helper (not preprocessed by the DSL): its loops unroll at trace time
        for i in range(CH // 8):
            idx = tid + 256 * i
            t = idx // 32
            dq = (idx % 32) * 4
            ld4(p_G, base + t * D + dq, g4)
            ld4(p_G, gcb + dq, gc4)
            ld4(p_k, base + t * D + dq, r4)
            for e in range(4):
                r4[e] = r4[e] * cute.math.exp(cute.arch.fmin(gc4[e] - g4[e], Float32(0.0)))
            st4(r4, s_k.iterator, t * DP + dq)

    class Prep:
        """(chunk, b*h): conv + silu, gate, cumulative G, beta, l2norm of q and k."""

        def __init__(self, CH: int, lower_bound: float):
            self.CH, self.lb = CH, float(lower_bound)

        @cute.jit
        def __call__(self, p_qkv: cute.Pointer, p_f: cute.Pointer, p_b: cute.Pointer, p_convw: cute.Pointer,
                     p_alog: cute.Pointer, p_dtb: cute.Pointer, p_conv: cute.Pointer, p_q: cute.Pointer,
                     p_k: cute.Pointer, p_v: cute.Pointer, p_G: cute.Pointer, p_beta: cute.Pointer,
                     B: Int32, H: Int32, L: Int32, stream: cuda.CUstream):
            nc, _ = chunk_count(L, self.CH)
            self.kernel(p_qkv, p_f, p_b, p_convw, p_alog, p_dtb, p_conv, p_q, p_k, p_v, p_G, p_beta, B, H, L).launch(
                grid=[nc, B * H, 1], block=[D, 1, 1], stream=stream)

        @cute.kernel
        def kernel(self, p_qkv: cute.Pointer, p_f: cute.Pointer, p_b: cute.Pointer, p_convw: cute.Pointer,
                   p_alog: cute.Pointer, p_dtb: cute.Pointer, p_conv: cute.Pointer, p_q: cute.Pointer,
                   p_k: cute.Pointer, p_v: cute.Pointer, p_G: cute.Pointer, p_beta: cute.Pointer,
                   B: Int32, H: Int32, L: Int32):
            CH = self.CH
            HD = H * D
            C = 3 * HD
            tid, _, _ = cute.arch.thread_idx()
            c, bh, _ = cute.arch.block_idx()
            h = bh % H
            bi = bh // H
            nc, Lp = chunk_count(L, CH)
            p0 = c * CH
            warp = cute.arch.make_warp_uniform(cute.arch.warp_idx())
            lane = tid % 32

            smem = cutlass.memory.SmemAllocator()
            s_q = smem_f32(smem, CH * D)  # unnormalized q, k of the chunk, [t][d]
            s_k = smem_f32(smem, CH * D)

            qkv_g = flat(p_qkv, B * L * C)
            conv_g = flat(p_conv, B * C * 3)
            convw_g = flat(p_convw, C * 4)
            f_g = flat(p_f, B * L * HD)
            b_g = flat(p_b, B * L * H)
            v_g = flat(p_v, B * H * Lp * D)
            G_g = flat(p_G, B * H * Lp * D)
            beta_g = flat(p_beta, B * H * Lp)

            # this thread's channels: q, k, v of head dim `tid`
            chs = (h * D + tid, HD + h * D + tid, 2 * HD + h * D + tid)
            w = cute.make_rmem_tensor((3, 4), Float32)   # conv weights [channel][tap]
            win = cute.make_rmem_tensor((3, 3), Float32)  # the 3 inputs before the current position
            for a in cutlass.range_constexpr(3):
                for i in cutlass.range_constexpr(4):
                    w[a, i] = convw_g[chs[a] * 4 + i].to(Float32)
            # seq = [conv_state (3), x_0 .. x_{L-1}]; position p reads seq[p .. p + 3]
            for i in cutlass.range_constexpr(3):
                si = p0 + i
                for a in cutlass.range_constexpr(3):
                    if si < 3:
                        win[a, i] = conv_g[(bi * C + chs[a]) * 3 + si].to(Float32)
                    else:
                        win[a, i] = qkv_g[(bi * L + si - 3) * C + chs[a]].to(Float32)
            a_exp = cute.math.exp(flat(p_alog, H)[h].to(Float32))
            dtb = flat(p_dtb, HD)[h * D + tid].to(Float32)

            x = cute.make_rmem_tensor((3,), Float32)
            y = cute.make_rmem_tensor((3,), Float32)
            G = cute.make_rmem_tensor((1,), Float32)
            G[0] = Float32(0.0)
            for t in range(CH):
                p = p0 + t
                x.fill(0.0)
                fv = Float32(0.0)
                valid = Float32(0.0)
                if p < L:
                    for a in cutlass.range_constexpr(3):
                        x[a] = qkv_g[(bi * L + p) * C + chs[a]].to(Float32)
                    fv = f_g[(bi * L + p) * HD + h * D + tid].to(Float32)
                    valid = Float32(1.0)
                for a in cutlass.range_constexpr(3):
                    ya = w[a, 0] * win[a, 0] + w[a, 1] * win[a, 1] + w[a, 2] * win[a, 2] + w[a, 3] * x[a]
                    y[a] = ya * sigmoid(ya) * valid
                    win[a, 0] = win[a, 1]
                    win[a, 1] = win[a, 2]
                    win[a, 2] = x[a]
                G[0] = G[0] + self.lb * sigmoid(a_exp * (fv + dtb)) * valid
                s_q[t * D + tid] = y[0]
                s_k[t * D + tid] = y[1]
                o = (bh * Lp + p) * D + tid
                v_g[o] = y[2]
                G_g[o] = G[0]
            if tid < CH:
                p = p0 + tid
                bv = Float32(0.0)
                if p < L:
                    bv = sigmoid(b_g[(bi * L + p) * H + h].to(Float32))
                beta_g[bh * Lp + p] = bv

            cute.arch.sync_threads()
            # l2norm over the head dim: warp w takes rows w, w + 4, ...; a lane 4 dims
            r4 = cute.make_rmem_tensor((4,), Float32)
            for i in range(CH // 4):
                t = warp + 4 * i
                for which in cutlass.range_constexpr(2):
                    src = s_q if which == 0 else s_k
                    dst = p_q if which == 0 else p_k
                    ld4(src.iterator, t * D + lane * 4, r4)
                    ss = r4[0] * r4[0] + r4[1] * r4[1] + r4[2] * r4[2] + r4[3] * r4[3]
                    rn = cute.math.rsqrt(warp_sum(ss) + _L2_EPS)
                    for e in cutlass.range_constexpr(4):
                        r4[e] = r4[e] * rn
                    st4(r4, dst, (bh * Lp + p0 + t) * D + lane * 4)

    class Intra:
        """(chunk, b*h): A, Aqk, the inverse X = (I + A)^-1, W = X diag(beta) k e^G, U0 = X diag(beta) v."""

        def __init__(self, CH: int, bf16_inverse: bool):
            self.CH, self.bf16 = CH, bool(bf16_inverse)
            self.TP = CH // 2                        # row pairs (t, CH-1-t)
            self.NSG = min(CH, 256 // self.TP)       # column groups
            self.SPT = CH // self.NSG                # columns a thread
            self.NACT = self.TP * self.NSG           # threads in the pair phase

        @cute.jit
        def __call__(self, p_q: cute.Pointer, p_k: cute.Pointer, p_v: cute.Pointer, p_G: cute.Pointer,
                     p_beta: cute.Pointer, p_W: cute.Pointer, p_U0: cute.Pointer, p_aqk: cute.Pointer,
                     B: Int32, H: Int32, L: Int32, stream: cuda.CUstream):
            nc, _ = chunk_count(L, self.CH)
            self.kernel(p_q, p_k, p_v, p_G, p_beta, p_W, p_U0, p_aqk, L).launch(
                grid=[nc, B * H, 1], block=[256, 1, 1], stream=stream)

        @cute.kernel
        def kernel(self, p_q: cute.Pointer, p_k: cute.Pointer, p_v: cute.Pointer, p_G: cute.Pointer,
                   p_beta: cute.Pointer, p_W: cute.Pointer, p_U0: cute.Pointer, p_aqk: cute.Pointer, L: Int32):
            CH, NSG, SPT = self.CH, self.NSG, self.SPT
            tid, _, _ = cute.arch.thread_idx()
            c, bh, _ = cute.arch.block_idx()
            nc, Lp = chunk_count(L, CH)
            base = (bh * Lp + c * CH) * D

            smem = cutlass.memory.SmemAllocator()
            s_q = smem_f32(smem, CH * DP)   # q, later v
            s_k = smem_f32(smem, CH * DP)
            s_g = smem_f32(smem, CH * DP)   # G
            s_a = smem_f32(smem, CH * CH)   # A [t][s]
            s_x = smem_f32(smem, CH * CH)   # X = (I + A)^-1 [t][s]
            s_b = smem_f32(smem, CH)        # beta

            r4 = cute.make_rmem_tensor((4,), Float32)
            for i in cutlass.range_constexpr(CH // 8):
                idx = tid + 256 * i
                t = idx // 32
                dq = (idx % 32) * 4
                for which in cutlass.range_constexpr(3):
                    src = (p_q, p_k, p_G)[which]
                    dst = (s_q, s_k, s_g)[which]
                    ld4(src, base + t * D + dq, r4)
                    st4(r4, dst.iterator, t * DP + dq)
            if tid < CH:
                s_b[tid] = flat(p_beta, Lp * (bh + 1))[bh * Lp + c * CH + tid]
            cute.arch.sync_threads()

            # ---- A and Aqk: rows t1 = tp and t2 = CH-1-tp, columns s = sg + NSG*i -----------------
            if tid < self.NACT:
                sg = tid % NSG
                tp = tid // NSG
                t1 = tp
                t2 = (CH - 1) - tp
                acc = cute.make_rmem_tensor((4, SPT), Float32)  # [a1, q1, a2, q2][i]
                acc.fill(0.0)
                rows = cute.make_rmem_tensor((4, 6), Float32)   # 4 dims of q1 k1 g1 q2 k2 g2
                col = cute.make_rmem_tensor((4, 2), Float32)    # 4 dims of k_s, G_s
                for d0 in range(0, D, 4):
                    for e in cutlass.range_constexpr(3):
                        sm = (s_q, s_k, s_g)[e]
                        ld4(sm.iterator, t1 * DP + d0, rows[None, e])
                        ld4(sm.iterator, t2 * DP + d0, rows[None, 3 + e])
                    for i in cutlass.range_constexpr(SPT):
                        s = sg + NSG * i
                        ld4(s_k.iterator, s * DP + d0, col[None, 0])
                        ld4(s_g.iterator, s * DP + d0, col[None, 1])
                        for half in cutlass.range_constexpr(2):
                            tt = t1 if half == 0 else t2
                            if s <= tt:
                                for e in cutlass.range_constexpr(4):
                                    ke = cute.math.exp(cute.arch.fmin(rows[e, 3 * half + 2] - col[e, 1],
                                                                      Float32(0.0))) * col[e, 0]
                                    acc[2 * half, i] = acc[2 * half, i] + rows[e, 3 * half + 1] * ke
                                    acc[2 * half + 1, i] = acc[2 * half + 1, i] + rows[e, 3 * half] * ke
                aqk_g = flat(p_aqk, (bh + 1) * nc * CH * CH)
                for half in cutlass.range_constexpr(2):
                    tt = t1 if half == 0 else t2
                    bt = s_b[tt]
                    for i in cutlass.range_constexpr(SPT):
                        s = sg + NSG * i
                        a = Float32(0.0)
                        if s < tt:
                            a = bt * acc[2 * half, i]
                            if cutlass.const_expr(self.bf16):
                                a = a.to(cutlass.BFloat16).to(Float32)
                        s_a[tt * CH + s] = a
                        qv = Float32(0.0)
                        if s <= tt:
                            qv = acc[2 * half + 1, i]
                        aqk_g[((bh * nc + c) * CH + tt) * CH + s] = qv
            cute.arch.sync_threads()

            # ---- v into s_q (q is dead); the inverse, one thread a column --------------------------
            for i in cutlass.range_constexpr(CH // 8):
                idx = tid + 256 * i
                t = idx // 32
                dq = (idx % 32) * 4
                ld4(p_v, base + t * D + dq, r4)
                st4(r4, s_q.iterator, t * DP + dq)
            if tid < CH:
                xc = cute.make_rmem_tensor((CH,), Float32)
                a4 = cute.make_rmem_tensor((4,), Float32)
                for i in cutlass.range_constexpr(CH):
                    xi = Float32(0.0)
                    if tid == i:
                        xi = Float32(1.0)
                    for s4 in cutlass.range_constexpr(i // 4):
                        ld4(s_a.iterator, i * CH + 4 * s4, a4)
                        for e in cutlass.range_constexpr(4):
                            xi = xi - a4[e] * xc[4 * s4 + e]
                    for s in cutlass.range_constexpr(4 * (i // 4), i):
                        xi = xi - s_a[i * CH + s] * xc[s]
                    xc[i] = xi
                for i in cutlass.range_constexpr(CH):
                    s_x[i * CH + tid] = xc[i]
            cute.arch.sync_threads()

            # ---- W = X (beta k e^G), U0 = X (beta v): thread = (dim d, rows half + 2m) ----------
            dd = tid % D
            hf = tid // D
            NRW = CH // 2
            aw = cute.make_rmem_tensor((NRW,), Float32)
            au = cute.make_rmem_tensor((NRW,), Float32)
            aw.fill(0.0)
            au.fill(0.0)
            kb = cute.make_rmem_tensor((4,), Float32)
            vb = cute.make_rmem_tensor((4,), Float32)
            x4 = cute.make_rmem_tensor((4,), Float32)
            for s0 in range(0, CH, 4):
                for e in cutlass.range_constexpr(4):
                    bs = s_b[s0 + e]
                    o = (s0 + e) * DP + dd
                    kb[e] = bs * s_k[o] * cute.math.exp(s_g[o])
                    vb[e] = bs * s_q[o]
                for m in cutlass.range_constexpr(NRW):
                    ld4(s_x.iterator, (hf + 2 * m) * CH + s0, x4)
                    for e in cutlass.range_constexpr(4):
                        aw[m] = aw[m] + x4[e] * kb[e]
                        au[m] = au[m] + x4[e] * vb[e]
            W_g = flat(p_W, base + CH * D)
            U_g = flat(p_U0, base + CH * D)
            for m in cutlass.range_constexpr(NRW):
                o = base + (hf + 2 * m) * D + dd
                W_g[o] = aw[m]
                U_g[o] = au[m]

    class Chunks:
        """(value tile, b*h[, chunk]): the chunk outputs and, for the sequential form, the state carry.
        grouped_out=False: every chunk in order from `state` (updated in place);
        grouped_out=True: one chunk a CTA from its saved start state (p_state = the starts buffer)."""

        def __init__(self, CH: int, TV: int, grouped_out: bool):
            self.CH, self.TV, self.gout = CH, TV, bool(grouped_out)
            self.R = 256 // TV       # row groups
            self.NR = CH // self.R   # chunk rows a thread
            self.NK = D // self.R    # key rows a thread (contiguous)
            assert self.NR >= 1 and self.NK % 4 == 0

        @cute.jit
        def __call__(self, p_q: cute.Pointer, p_k: cute.Pointer, p_G: cute.Pointer, p_W: cute.Pointer,
                     p_U0: cute.Pointer, p_aqk: cute.Pointer, p_obuf: cute.Pointer, p_state: cute.Pointer,
                     B: Int32, H: Int32, L: Int32, stream: cuda.CUstream):
            nz = Int32(1)
            if cutlass.const_expr(self.gout):
                nz, _ = chunk_count(L, self.CH)
            self.kernel(p_q, p_k, p_G, p_W, p_U0, p_aqk, p_obuf, p_state, B, H, L).launch(
                grid=[D // self.TV, B * H, nz], block=[256, 1, 1], stream=stream)

        @cute.kernel
        def kernel(self, p_q: cute.Pointer, p_k: cute.Pointer, p_G: cute.Pointer, p_W: cute.Pointer,
                   p_U0: cute.Pointer, p_aqk: cute.Pointer, p_obuf: cute.Pointer, p_state: cute.Pointer,
                   B: Int32, H: Int32, L: Int32):
            CH, TV, R, NR, NK = self.CH, self.TV, self.R, self.NR, self.NK
            scale = 1.0 / math.sqrt(D)
            tid, _, _ = cute.arch.thread_idx()
            vt, bh, cz = cute.arch.block_idx()
            h = bh % H
            bi = bh // H
            nc, Lp = chunk_count(L, CH)
            j = tid % TV
            r = tid // TV
            col = vt * TV + j   # head-local value column
            k0 = r * NK          # first of this thread's NK key rows

            smem = cutlass.memory.SmemAllocator()
            s_q = smem_f32(smem, CH * DP)   # q e^G
            s_k = smem_f32(smem, CH * DP)   # k e^{G_C - G}
            s_w = smem_f32(smem, CH * DP)   # W
            s_a = smem_f32(smem, CH * CH)   # Aqk
            s_u = smem_f32(smem, CH * TV)   # u = U0 - W S (tile columns)
            s_s = smem_f32(smem, D * TV)    # state tile [key][column]
            s_e = smem_f32(smem, D)         # e^{G_C}

            # start state: this thread's key rows k0 .. k0 + NK - 1 of column `col`
            c_lo = Int32(0)
            c_hi = nc
            if cutlass.const_expr(self.gout):
                c_lo = cz
                c_hi = cz + 1
                st_g = flat(p_state, (bh + 1) * nc * D * D)
                for k in cutlass.range_constexpr(NK):
                    s_s[(k0 + k) * TV + j] = st_g[((bh * nc + cz) * D + k0 + k) * D + col]
            else:
                st_g = flat(p_state, (bh + 1) * D * D)
                for k in cutlass.range_constexpr(NK):
                    s_s[(k0 + k) * TV + j] = st_g[(bh * D + k0 + k) * D + col].to(Float32)

            r4 = cute.make_rmem_tensor((4,), Float32)
            g4 = cute.make_rmem_tensor((4,), Float32)
            gc4 = cute.make_rmem_tensor((4,), Float32)
            u = cute.make_rmem_tensor((NR,), Float32)
            op = cute.make_rmem_tensor((NR,), Float32)
            s4 = cute.make_rmem_tensor((4,), Float32)
            w4 = cute.make_rmem_tensor((4,), Float32)
            acc = cute.make_rmem_tensor((NK,), Float32)
            o_g = flat(p_obuf, B * L * H * D)
            U_g = flat(p_U0, B * H * Lp * D)
            G_g = flat(p_G, B * H * Lp * D)
            for c in range(c_lo, c_hi):
                cute.arch.sync_threads()  # the previous chunk's readers are done; s_s is complete
                base = (bh * Lp + c * CH) * D
                gcb = base + (CH - 1) * D
                if cutlass.const_expr(not self.gout):  # k e^{G_C - G}: the state update only
                    kdecay_fill(p_k, p_G, base, tid, CH, s_k, r4, g4, gc4)
                for i in cutlass.range_constexpr(CH // 8):
                    idx = tid + 256 * i
                    t = idx // 32
                    dq = (idx % 32) * 4
                    ld4(p_G, base + t * D + dq, g4)
                    ld4(p_q, base + t * D + dq, r4)
                    for e in cutlass.range_constexpr(4):
                        r4[e] = r4[e] * cute.math.exp(g4[e])
                    st4(r4, s_q.iterator, t * DP + dq)
                    ld4(p_W, base + t * D + dq, r4)
                    st4(r4, s_w.iterator, t * DP + dq)
                NA4 = CH * CH // 4
                for i in cutlass.range_constexpr((NA4 + 255) // 256):
                    idx = tid + 256 * i
                    if idx < NA4:
                        ld4(p_aqk, (bh * nc + c) * CH * CH + idx * 4, r4)
                        st4(r4, s_a.iterator, idx * 4)
                if cutlass.const_expr(not self.gout):
                    if tid < D:
                        s_e[tid] = cute.math.exp(G_g[gcb + tid])
                cute.arch.sync_threads()

                # u = U0 - W S;  op = (q e^G) S   (rows t = r + R m of column col)
                for m in cutlass.range_constexpr(NR):
                    u[m] = U_g[base + (r + R * m) * D + col]
                op.fill(0.0)
                for d0 in range(0, D, 4):
                    for e in cutlass.range_constexpr(4):
                        s4[e] = s_s[(d0 + e) * TV + j]
                    for m in cutlass.range_constexpr(NR):
                        t = r + R * m
                        ld4(s_w.iterator, t * DP + d0, w4)
                        ld4(s_q.iterator, t * DP + d0, r4)
                        for e in cutlass.range_constexpr(4):
                            u[m] = u[m] - w4[e] * s4[e]
                            op[m] = op[m] + r4[e] * s4[e]
                for m in cutlass.range_constexpr(NR):
                    s_u[(r + R * m) * TV + j] = u[m]
                cute.arch.sync_threads()

                # o = scale (op + Aqk u)
                for s0 in range(0, CH, 4):
                    for e in cutlass.range_constexpr(4):
                        s4[e] = s_u[(s0 + e) * TV + j]
                    for m in cutlass.range_constexpr(NR):
                        ld4(s_a.iterator, (r + R * m) * CH + s0, w4)
                        for e in cutlass.range_constexpr(4):
                            op[m] = op[m] + w4[e] * s4[e]
                for m in cutlass.range_constexpr(NR):
                    p = c * CH + r + R * m
                    if p < L:
                        o_g[((bi * L + p) * H + h) * D + col] = op[m] * scale

                if cutlass.const_expr(not self.gout):
                    # S = e^{G_C} S + (k e^{G_C - G})^T u   (this thread's own entries only)
                    for k in cutlass.range_constexpr(NK):
                        acc[k] = s_e[k0 + k] * s_s[(k0 + k) * TV + j]
                    for t in range(CH):
                        ut = s_u[t * TV + j]
                        for k4 in cutlass.range_constexpr(NK // 4):
                            ld4(s_k.iterator, t * DP + k0 + 4 * k4, w4)
                            for e in cutlass.range_constexpr(4):
                                acc[4 * k4 + e] = acc[4 * k4 + e] + w4[e] * ut
                    for k in cutlass.range_constexpr(NK):
                        s_s[(k0 + k) * TV + j] = acc[k]

            if cutlass.const_expr(not self.gout):
                st_o = flat(p_state, (bh + 1) * D * D)
                for k in cutlass.range_constexpr(NK):
                    st_o[(bh * D + k0 + k) * D + col] = s_s[(k0 + k) * TV + j].to(p_state.dtype)

    class Summary:
        """(value tile, b*h, chunk): M = diag(e^{G_C}) - (k e^{G_C-G})^T W, N = (k e^{G_C-G})^T U0."""

        def __init__(self, CH: int, TV: int):
            self.CH, self.TV = CH, TV
            self.R = 256 // TV
            self.NR = CH // self.R
            self.NK = D // self.R

        @cute.jit
        def __call__(self, p_k: cute.Pointer, p_G: cute.Pointer, p_W: cute.Pointer, p_U0: cute.Pointer,
                     p_M: cute.Pointer, p_N: cute.Pointer, B: Int32, H: Int32, L: Int32, stream: cuda.CUstream):
            nc, _ = chunk_count(L, self.CH)
            self.kernel(p_k, p_G, p_W, p_U0, p_M, p_N, L).launch(
                grid=[D // self.TV, B * H, nc], block=[256, 1, 1], stream=stream)

        @cute.kernel
        def kernel(self, p_k: cute.Pointer, p_G: cute.Pointer, p_W: cute.Pointer, p_U0: cute.Pointer,
                   p_M: cute.Pointer, p_N: cute.Pointer, L: Int32):
            CH, TV, R, NR, NK = self.CH, self.TV, self.R, self.NR, self.NK
            tid, _, _ = cute.arch.thread_idx()
            vt, bh, c = cute.arch.block_idx()
            nc, Lp = chunk_count(L, CH)
            j = tid % TV
            r = tid // TV
            col = vt * TV + j
            k0 = r * NK
            base = (bh * Lp + c * CH) * D
            gcb = base + (CH - 1) * D

            smem = cutlass.memory.SmemAllocator()
            s_k = smem_f32(smem, CH * DP)   # k e^{G_C - G}
            s_w = smem_f32(smem, CH * TV)   # W tile
            s_u = smem_f32(smem, CH * TV)   # U0 tile

            r4 = cute.make_rmem_tensor((4,), Float32)
            g4 = cute.make_rmem_tensor((4,), Float32)
            gc4 = cute.make_rmem_tensor((4,), Float32)
            kdecay_fill(p_k, p_G, base, tid, CH, s_k, r4, g4, gc4)
            W_g = flat(p_W, base + CH * D)
            U_g = flat(p_U0, base + CH * D)
            for m in cutlass.range_constexpr(NR):
                t = r + R * m
                s_w[t * TV + j] = W_g[base + t * D + col]
                s_u[t * TV + j] = U_g[base + t * D + col]
            cute.arch.sync_threads()

            am = cute.make_rmem_tensor((NK,), Float32)
            an = cute.make_rmem_tensor((NK,), Float32)
            am.fill(0.0)
            an.fill(0.0)
            k4 = cute.make_rmem_tensor((4,), Float32)
            for t in range(CH):
                wt = s_w[t * TV + j]
                ut = s_u[t * TV + j]
                for q4 in cutlass.range_constexpr(NK // 4):
                    ld4(s_k.iterator, t * DP + k0 + 4 * q4, k4)
                    for e in cutlass.range_constexpr(4):
                        am[4 * q4 + e] = am[4 * q4 + e] + k4[e] * wt
                        an[4 * q4 + e] = an[4 * q4 + e] + k4[e] * ut
            mo = (bh * nc + c) * D * D
            M_g = flat(p_M, mo + D * D)
            N_g = flat(p_N, mo + D * D)
            G_g = flat(p_G, gcb + D)
            for k in cutlass.range_constexpr(NK):
                diag = Float32(0.0)
                if k0 + k == col:
                    diag = cute.math.exp(G_g[gcb + k0 + k])
                M_g[mo + (k0 + k) * D + col] = diag - am[k]
                N_g[mo + (k0 + k) * D + col] = an[k]

    class Scan:
        """(value tile, b*h): S_{c+1} = M_c S_c + N_c in chunk order; writes every start state and
        the final state (in place, the state's dtype)."""

        def __init__(self, TV: int):
            self.TV = TV
            self.R = 256 // TV
            self.NK = D // self.R

        @cute.jit
        def __call__(self, p_M: cute.Pointer, p_N: cute.Pointer, p_starts: cute.Pointer, p_state: cute.Pointer,
                     B: Int32, H: Int32, nc: Int32, stream: cuda.CUstream):
            self.kernel(p_M, p_N, p_starts, p_state, nc).launch(
                grid=[D // self.TV, B * H, 1], block=[256, 1, 1], stream=stream)

        @cute.kernel
        def kernel(self, p_M: cute.Pointer, p_N: cute.Pointer, p_starts: cute.Pointer, p_state: cute.Pointer,
                   nc: Int32):
            TV, NK = self.TV, self.NK
            MP = D + 4
            tid, _, _ = cute.arch.thread_idx()
            vt, bh, _ = cute.arch.block_idx()
            j = tid % TV
            r = tid // TV
            col = vt * TV + j
            k0 = r * NK

            smem = cutlass.memory.SmemAllocator()
            s_m = smem_f32(smem, D * MP)   # M_c [row][col], pitch MP
            s_s = smem_f32(smem, D * TV)   # state tile [key][column]

            st_g = flat(p_state, (bh + 1) * D * D)
            for k in cutlass.range_constexpr(NK):
                s_s[(k0 + k) * TV + j] = st_g[(bh * D + k0 + k) * D + col].to(Float32)
            N_g = flat(p_N, (bh + 1) * nc * D * D)
            S_g = flat(p_starts, (bh + 1) * nc * D * D)
            acc = cute.make_rmem_tensor((NK,), Float32)
            r4 = cute.make_rmem_tensor((4,), Float32)
            s4 = cute.make_rmem_tensor((4,), Float32)
            for c in range(nc):
                mo = (bh * nc + c) * D * D
                for k in cutlass.range_constexpr(NK):
                    S_g[mo + (k0 + k) * D + col] = s_s[(k0 + k) * TV + j]
                for i in cutlass.range_constexpr(D * D // 4 // 256):
                    idx = tid + 256 * i
                    row = idx // 32
                    e4 = (idx % 32) * 4
                    ld4(p_M, mo + row * D + e4, r4)
                    st4(r4, s_m.iterator, row * MP + e4)
                for k in cutlass.range_constexpr(NK):
                    acc[k] = N_g[mo + (k0 + k) * D + col]
                cute.arch.sync_threads()  # s_m and the previous s_s complete
                for e0 in range(0, D, 4):
                    for e in cutlass.range_constexpr(4):
                        s4[e] = s_s[(e0 + e) * TV + j]
                    for k in cutlass.range_constexpr(NK):
                        ld4(s_m.iterator, (k0 + k) * MP + e0, r4)
                        for e in cutlass.range_constexpr(4):
                            acc[k] = acc[k] + r4[e] * s4[e]
                cute.arch.sync_threads()  # every read of s_m and s_s done
                for k in cutlass.range_constexpr(NK):
                    s_s[(k0 + k) * TV + j] = acc[k]
            for k in cutlass.range_constexpr(NK):
                st_g[(bh * D + k0 + k) * D + col] = s_s[(k0 + k) * TV + j].to(p_state.dtype)

    class Norm:
        """Gated RMSNorm of every (b, l, h) row (a warp each), then the conv tail (trailing CTAs)."""

        def __init__(self, eps: float):
            self.eps = float(eps)

        @cute.jit
        def __call__(self, p_obuf: cute.Pointer, p_gate: cute.Pointer, p_onw: cute.Pointer, p_out: cute.Pointer,
                     p_qkv: cute.Pointer, p_conv: cute.Pointer, B: Int32, H: Int32, L: Int32,
                     stream: cuda.CUstream):
            C = 3 * H * D
            nrb = (B * L * H + 7) // 8
            ncb = (B * C + 255) // 256
            self.kernel(p_obuf, p_gate, p_onw, p_out, p_qkv, p_conv, B, H, L).launch(
                grid=[nrb + ncb, 1, 1], block=[256, 1, 1], stream=stream)

        @cute.kernel
        def kernel(self, p_obuf: cute.Pointer, p_gate: cute.Pointer, p_onw: cute.Pointer, p_out: cute.Pointer,
                   p_qkv: cute.Pointer, p_conv: cute.Pointer, B: Int32, H: Int32, L: Int32):
            C = 3 * H * D
            tid, _, _ = cute.arch.thread_idx()
            bx, _, _ = cute.arch.block_idx()
            warp = cute.arch.make_warp_uniform(cute.arch.warp_idx())
            lane = tid % 32
            rows = B * L * H
            nrb = (rows + 7) // 8
            if bx < nrb:
                row = bx * 8 + warp
                if row < rows:
                    off = row * D + lane * 4
                    o4 = cute.make_rmem_tensor((4,), Float32)
                    g4 = cute.make_rmem_tensor((4,), p_gate.dtype)
                    ld4(p_obuf, off, o4)
                    ld4(p_gate, off, g4)
                    onw = flat(p_onw, D)
                    ss = o4[0] * o4[0] + o4[1] * o4[1] + o4[2] * o4[2] + o4[3] * o4[3]
                    inv = cute.math.rsqrt(warp_sum(ss) * (1.0 / D) + self.eps)
                    y4 = cute.make_rmem_tensor((4,), p_out.dtype)
                    for e in cutlass.range_constexpr(4):
                        val = o4[e] * inv * onw[lane * 4 + e].to(Float32) * sigmoid(g4[e].to(Float32))
                        y4[e] = val.to(p_out.dtype)
                    st4(y4, p_out, off)
            else:
                idx = (bx - nrb) * 256 + tid
                if idx < B * C:
                    # conv_state[b, ch, jj] = seq[L + jj], seq = [conv_state[b, ch, :], x_0 .. x_{L-1}]
                    bi = idx // C
                    ch = idx % C
                    conv_g = flat(p_conv, B * C * 3)
                    qkv_g = flat(p_qkv, B * L * C)
                    keep = cute.make_rmem_tensor((3,), p_conv.dtype)
                    for jj in cutlass.range_constexpr(3):
                        i = L + jj
                        if i < 3:
                            keep[jj] = conv_g[idx * 3 + i]
                        else:
                            keep[jj] = qkv_g[(bi * L + i - 3) * C + ch]
                    for jj in cutlass.range_constexpr(3):
                        conv_g[idx * 3 + jj] = keep[jj]

    return SimpleNamespace(Prep=Prep, Intra=Intra, Chunks=Chunks, Summary=Summary, Scan=Scan, Norm=Norm)


# ---------------------------------------------------------------------------------------------
# Host wrapper
# ---------------------------------------------------------------------------------------------

_COMPILED: dict[tuple, Any] = {}


def _check_switches(chunk, inverse, grouped, tile_v):
    if isinstance(chunk, bool) or chunk not in PREFILL_CHUNKS:
        raise ValueError(f"kda cute prefill: chunk must be one of {PREFILL_CHUNKS} (got {chunk!r})")
    if inverse not in PREFILL_INVERSES:
        raise ValueError(f"kda cute prefill: inverse must be one of {PREFILL_INVERSES} (got {inverse!r})")
    if not isinstance(grouped, bool):
        raise ValueError(f"kda cute prefill: grouped must be a bool (got {grouped!r})")
    if isinstance(tile_v, bool) or tile_v not in PREFILL_TILES:
        raise ValueError(f"kda cute prefill: tile_v must be one of {PREFILL_TILES} (got {tile_v!r})")


def _validate_prefill(qkv, f, b, gate, params, state, conv_state, out):
    """Shapes, dtypes, device, contiguity. Returns (B, L, H)."""
    if not isinstance(qkv, torch.Tensor) or qkv.dim() != 3:
        raise ValueError("kda cute prefill: qkv must be a tensor [B, L, 3*H*D]")
    if qkv.device.type != "cuda":
        raise ValueError(f"kda cute prefill: qkv must be on a CUDA device (got {qkv.device})")
    H, D, W = params.heads, params.head_dim, params.conv_kernel
    if D != _D:
        raise NotImplementedError(f"kda cute prefill: head_dim must be {_D} (got {D})")
    if W != _W:
        raise NotImplementedError(f"kda cute prefill: conv kernel must be {_W} (got {W})")
    B, L = qkv.shape[:2]
    if B < 1 or L < 1:
        raise ValueError(f"kda cute prefill: qkv needs B >= 1 and L >= 1 (got shape {tuple(qkv.shape)})")
    dev = qkv.device
    C = 3 * H * D
    _check("qkv", qkv, (B, L, C), _BF16, dev)
    _check("f", f, (B, L, H * D), _BF16, dev)
    _check("b", b, (B, L, H), _BF16, dev)
    _check("gate", gate, (B, L, H * D), _BF16, dev)
    _check("state", state, (B, H, D, D), _STATE, dev)
    _check("conv_state", conv_state, (B, C, W - 1), _BF16, dev)
    _check("out", out, (B, L, H * D), _BF16, dev)
    _check("params.conv_w", params.conv_w, (C, W), _PARAM, dev)
    _check("params.A_log", params.A_log, (H,), _PARAM, dev)
    _check("params.dt_bias", params.dt_bias, (H * D,), _PARAM, dev)
    _check("params.o_norm_w", params.o_norm_w, (D,), _PARAM, dev)
    return B, L, H


def _run(key, build, args):
    """Compile `build()` for these arguments once per key, then launch it."""
    fn = _COMPILED.get(key)
    if fn is None:
        from cutlass import cute
        fn = cute.compile(build(), *args)
        _COMPILED[key] = fn
    fn(*args)


def kda_prefill(qkv, f, b, gate, params, state, conv_state, out, chunk: int = 64, inverse: str = "fp32",
                grouped: bool = False, tile_v: int = 32):
    """Chunked prefill of L positions per sequence. qkv [B,L,3HD], f/gate [B,L,HD], b [B,L,H] bf16.
    Writes out [B,L,HD] bf16; updates state [B,H,128,128] (fp32 or bf16) and conv_state [B,3HD,3]
    in place to the end of the sequence; returns out. Switches as kernels/triton/kda_prefill.py."""
    _check_switches(chunk, inverse, grouped, tile_v)
    B, L, H = _validate_prefill(qkv, f, b, gate, params, state, conv_state, out)
    CH, TV, D = chunk, tile_v, _D
    NC = -(-L // CH)
    Lp = NC * CH
    big = B * H * (NC * D * D if grouped else Lp * D)
    if big > _INT32_MAX or B * L * 3 * H * D > _INT32_MAX:
        raise NotImplementedError(f"kda cute prefill: B={B}, L={L}, H={H} overflows 32-bit indexing of the "
                                  f"scratch buffers; split the batch or the sequence")
    dev = qkv.device
    cls = _classes()
    f32 = dict(dtype=torch.float32, device=dev)
    q_b, k_b, v_b, G_b, W_b, U0_b = (torch.empty(B * H * Lp * D, **f32) for _ in range(6))
    beta_b = torch.empty(B * H * Lp, **f32)
    aqk_b = torch.empty(B * H * NC * CH * CH, **f32)
    o_b = torch.empty(B * L * H * D, **f32)
    # what a compiled kernel depends on besides its switches: the device and the parameter dtypes
    pk = (dev.index, params.conv_w.dtype, params.A_log.dtype, params.dt_bias.dtype, params.o_norm_w.dtype)
    with torch.cuda.device(dev):
        stream = _stream(dev)
        pq, pk_, pv, pG, pW, pU = (_ptr(t) for t in (q_b, k_b, v_b, G_b, W_b, U0_b))
        pbeta, paqk, po = _ptr(beta_b, 4), _ptr(aqk_b), _ptr(o_b)
        p_state = _ptr(state, state.element_size())
        p_conv = _ptr(conv_state, 2)
        dims = [B, H, L, stream]
        _run(("prep", CH, float(params.lower_bound)) + pk, lambda: cls.Prep(CH, params.lower_bound),
             [_ptr(qkv, 2), _ptr(f, 2), _ptr(b, 2), _ptr(params.conv_w, params.conv_w.element_size()),
              _ptr(params.A_log, params.A_log.element_size()), _ptr(params.dt_bias, params.dt_bias.element_size()),
              p_conv, pq, pk_, pv, pG, pbeta] + dims)
        _run(("intra", CH, inverse) + pk, lambda: cls.Intra(CH, inverse == "bf16"),
             [pq, pk_, pv, pG, pbeta, pW, pU, paqk] + dims)
        if not grouped:
            _run(("chunks", CH, TV, state.dtype) + pk, lambda: cls.Chunks(CH, TV, False),
                 [pq, pk_, pG, pW, pU, paqk, po, p_state] + dims)
        else:
            M_b, N_b, st_b = (torch.empty(B * H * NC * D * D, **f32) for _ in range(3))
            pM, pN, pst = _ptr(M_b), _ptr(N_b), _ptr(st_b)
            _run(("summary", CH, TV) + pk, lambda: cls.Summary(CH, TV), [pk_, pG, pW, pU, pM, pN] + dims)
            _run(("scan", TV, state.dtype) + pk, lambda: cls.Scan(TV), [pM, pN, pst, p_state, B, H, NC, stream])
            _run(("chunks-out", CH, TV) + pk, lambda: cls.Chunks(CH, TV, True),
                 [pq, pk_, pG, pW, pU, paqk, po, pst] + dims)
        _run(("norm", float(params.eps)) + pk, lambda: cls.Norm(params.eps),
             [po, _ptr(gate, 8), _ptr(params.o_norm_w, params.o_norm_w.element_size()), _ptr(out, 8),
              _ptr(qkv, 2), p_conv] + dims)
    return out
