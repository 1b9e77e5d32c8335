"""KDA multi-token verification (speculative decoding, T positions per sequence) as one CuTe DSL launch,
the state kept on chip across positions ("column layout").

Fuses, per (sequence b, head h) and for every position t in order, what `k3lab.ref.kda.kda_verify`
computes: the conv update + silu of the head's q|k|v channels, l2norm of q and k, the decay and beta,
the delta rule on the fp32 state and the gated output RMSNorm. It writes
    out        [B, T, H*D] bf16
    state_hist [B, T, H, D, D] fp32   (the state after each position, for rollback / commit)
    conv_hist  [B, T, 3*H*D, 3] bf16  (the conv window after each position)
and only reads `state` and `conv_state`. `checkpoint` c (compile-time; 1 = the above) keeps fewer states:
state_hist [B, ceil(T / c), H, D, D], slot s = the state after position min((s + 1) c, T) - 1 (every c-th
position and the last); the other positions' states never leave the registers (k3lab.components.kda.commit
recomputes them). `lengths` [B] int32 in 1..T selects the ragged path: positions >= lengths[b] write nothing
(their out / conv_hist entries, and the slots whose position is >= lengths[b], are left untouched); None
compiles the uniform-length specialization.

Layout. 256 threads a CTA, tile_v value columns a CTA (128: one CTA per head; 64 / 32 / 16: a cluster
of 2 / 4 / 8 CTAs). The 8 warps form a grid: `row_warps` (WR) of them split the 128 key rows and 8 / WR
split the tile's columns; a lane holds 4 columns of 128 / (WR R) key rows (R rows per warp
instruction). What does not depend on the state leaves the position chain:
  1. the prologue of every position first (conv, silu, squared norms, decay), one CTA barrier;
  2. the recurrence, position by position: the two key reductions (k^T diag(d) S, q^T diag(d) S) by a
     butterfly reduce-scatter over the row lanes, then, with WR > 1, the row blocks' partial sums
     through shared memory (double-buffered by position) behind a named barrier of the WR warps that
     share the columns (all 8 when WR = 8); state_hist stored from registers;
  3. the epilogue: the gated RMSNorm of every position at once (warp t % 8 takes position t), its sum
     of o^2 joined across a cluster through distributed shared memory, one cluster barrier in all.
Always: exp, sigmoid and rsqrt as single MUFU ops (`fast`). What the shape decides (each measured:
docs/NOTES_kda.md):
  bpro     while the grid is resident (kda_decode._resident_grid): the batched prologue, every position's
           conv, silu and decay in one branch per half and all 3 T warp sums in one reduce-scatter;
  preload  S T <= 8 (<= 16 when the grid fits one CTA per SM): every position's row factors in registers;
  delay    T >= 4, WR > 1 and one CTA per SM: position t's state_hist stores leave after position t+1's
           partial sums are read back;
  registers at most 128 a thread (two CTAs per SM) once the grid has more CTAs than the GPU has SMs.
ROW_WARPS holds the default row_warps per tile; default_row_warps the shape's exceptions to it.

Floor (k3lab.ops.kda.kda_bytes, the one formula): per (b, h) the state 64 KiB read once and T x 64 KiB
state_hist written (ceil(T / c) x 64 KiB with a checkpoint c), the
conv window 2,304 B read and T x 2,304 B conv_hist written, T x (768 + 256 + 256 + 256 + 2) B
activations. 12 heads, B = 1: T = 4 4.1 MB (0.97 us at 4.275 TB/s), T = 8 7.5 MB (1.75 us); at B = 1
the bound is latency: the launch, then the T-step chain, with each position's state_hist stores leaving
from the few SMs that own the batch's heads.

Contract (torch tensors on one CUDA device, torch's current stream, CUDA-graph safe once compiled):

    kda_verify(qkv, f, b, gate, params, state, conv_state, out, state_hist, conv_hist,
               lengths=None, tile_v=128, row_warps=None, pdl=False, checkpoint=None) -> out

T in 1..16; the tensors as kda_decode's with a T axis. pdl=True: programmatic dependent launch as in
kda_decode (state, conv window and parameters loaded before the wait for the previous kernel; lengths
and activations after it); that kernel must not write this call's `state` or `conv_state` (e.g. a
commit of the same sequences directly before).
"""
import math

import torch

from .kda_decode import (_BF16, _D, _F32, _L2_EPS, _RESIDENT, _THREADS, _W, _check, _dsl, _get_compiled, _kernel_args,
                         _params_key, _resident_grid, _stream, _validate)

__all__ = ["ROW_WARPS", "ROW_WARPS_ALLOWED", "default_row_warps", "kda_verify"]

# row_warps per tile_v when not given (kda_cute_verify_split.json.gz, in git history at af86fbf: 4 is the best at
# tile 32 and at tile 128 for B=64, near the best at tile 64; docs/NOTES_kda.md)
ROW_WARPS = {128: 4, 64: 4, 32: 4, 16: 4}
# row_warps each tile allows (a lane holds 4 columns: at tile 16 one warp has at most 16 / (8 / WR))
ROW_WARPS_ALLOWED = {128: (1, 2, 4, 8), 64: (1, 2, 4, 8), 32: (1, 2, 4, 8), 16: (2, 4, 8)}
_KERNEL_CLS = None


def default_row_warps(tile_v: int, B: int, H: int, T: int) -> int:
    """row_warps when not given: ROW_WARPS[tile_v], except where the ninth session measured otherwise
    (profiles/h200/kda_decode_fi.json.gz and kda_explore9.json.gz (git history at a2d91e6), 12 heads, B = 8;
    docs/NOTES_kda.md):
    tile 128 on a grid of one CTA per SM at T >= 8 takes 1, tile 64 on a resident grid at T = 3..4 takes 2 (each
    faster than 4)."""
    ctas = B * H * (128 // tile_v)
    if tile_v == 128 and T >= 8 and ctas <= _RESIDENT // 2:
        return 1
    if tile_v == 64 and 2 < T <= 4 and ctas <= _RESIDENT:
        return 2
    return ROW_WARPS[tile_v]


def _kernel_class():
    """The verify generator (built once)."""
    global _KERNEL_CLS
    if _KERNEL_CLS is not None:
        return _KERNEL_CLS
    d = _dsl()
    cuda, cutlass, Float32, Int32, cute = d.cuda, d.cutlass, d.Float32, d.Int32, d.cute
    sigmoid, vec, st_cluster_f32, warp_sum = d.sigmoid, d.vec, d.st_cluster_f32, d.warp_sum
    expf, rsqrtf = d.expf, d.rsqrtf
    prologue_position, position_norms = d.prologue_position, d.position_norms

    def reduce_scatter(vals, lane, offs):
        """Butterfly reduce-scatter of `vals` over the lanes lane ^ off, off in offs: each round a lane keeps half
        of its values (the upper half when lane & off) and adds the partner's copy of that half; once one
        value is left the remaining rounds add it whole. Returns (the values kept, the index in `vals` of the
        first). len(vals) must halve evenly while more than one is left."""
        vals = list(vals)
        start = Int32(0)
        for off in offs:
            if len(vals) > 1:
                assert len(vals) % 2 == 0, len(vals)
                hn = len(vals) // 2
                up = (lane & off) != 0
                kept = []
                for i in range(hn):
                    send = Float32(cutlass.select_(up, vals[i], vals[i + hn]))
                    keep = Float32(cutlass.select_(up, vals[i + hn], vals[i]))
                    kept.append(keep + cute.arch.shuffle_sync_bfly(send, offset=off))
                vals = kept
                start = start + Int32(cutlass.select_(up, Int32(hn), Int32(0)))
            else:
                vals[0] = vals[0] + cute.arch.shuffle_sync_bfly(vals[0], offset=off)
        return vals, start

    def conv_silu(win, x, w, fast):
        """The batched prologue's conv step of one channel: x enters the window (win[3]), the 4-tap conv and
        silu, then the window shifts by one (win[0..2] is then the conv state after this position)."""
        win[3] = x
        y = Float32(0.0)
        for i in range(4):
            y = y + win[i].to(Float32) * w[i]
        for i in range(3):
            win[i] = win[i + 1]
        return y * sigmoid(y, fast)

    def red4(s_red, i, r_c):
        """The batched prologue's value i summed over the 4 lower warps, in warp order (as position_norms
        sums)."""
        cute.autovec_copy(vec(s_red.iterator, cute.assume(i * 4, divby=4), 4), r_c)
        return ((r_c[0] + r_c[1]) + r_c[2]) + r_c[3]

    class KDAVerifyKernel:
        """One CTA (or a cluster of NC CTAs) per (b, h); T positions in order; state only read."""

        def __init__(self, B: int, H: int, T: int, ragged: bool, eps: float, lower_bound: float,
                     tile_v: int = 128, row_warps: int = 4, pdl: bool = False, checkpoint: int = 1):
            self.B, self.H, self.T = B, H, T
            assert 1 <= checkpoint <= T, (checkpoint, T)
            self.CK = checkpoint           # state_hist keeps the state after every CK-th position and the last
            self.NS = -(-T // checkpoint)  # state_hist slots
            self.ragged = ragged
            self.eps, self.lb = float(eps), float(lower_bound)
            assert tile_v in (128, 64, 32, 16)
            self.TV = tile_v            # value columns per CTA
            self.NC = 128 // tile_v     # CTAs per head (a cluster; they share the output RMSNorm)
            assert row_warps in (1, 2, 4, 8)
            self.WR = row_warps         # warps splitting the key rows (partial sums meet in smem)
            self.WC = 8 // row_warps    # warps splitting the value columns
            self.CW = tile_v // self.WC  # value columns per warp
            self.G = self.CW // 4       # lanes across one row of a warp's columns (4 columns each)
            self.R = 32 // self.G       # key rows one warp instruction covers
            self.RW = 128 // row_warps  # key rows per warp
            self.S = self.RW // self.R  # key rows per thread
            assert self.G >= 1 and self.S >= 1, (tile_v, row_warps)
            self.E = max(1, tile_v // 32)  # epilogue: output columns per lane
            self.EL = tile_v // self.E     # epilogue: lanes holding columns (16 at tile 16, else 32)
            offs, o_ = [], self.G
            while o_ < 32:
                offs.append(o_)
                o_ *= 2
            self.red_offs = tuple(offs)   # shuffle offsets joining the lanes that share columns
            # the shape's choices (module doc)
            ctas = B * H * self.NC
            # at most 128 registers a thread (2 CTAs, 16 warps, an SM) when the grid has more CTAs than an
            # H200 has SMs; a grid that fits one CTA per SM may use more
            self.min_ctas = 2 if ctas > _RESIDENT // 2 else 1
            # preload: 4 S T + 4 T + 3 T registers of row factors and per-position terms
            self.pre = self.S * T <= (16 if self.min_ctas == 1 else 8)
            self.delay = T >= 4 and self.min_ctas == 1 and row_warps > 1
            self.bpro = _resident_grid(ctas)
            # bpro's 3 T warp sums, padded to a power of two (halves evenly in the reduce-scatter)
            self.nsum = 1 << max(2, (3 * T - 1).bit_length())
            # pdl: state, conv window and parameter loads before griddepcontrol.wait, lengths and activations
            # after it
            self.pdl = bool(pdl)

        def is_slot(self, t: int) -> bool:
            """Whether position t's state is stored (slot t // CK): t + 1 a multiple of CK, or the last position."""
            return (t + 1) % self.CK == 0 or t == self.T - 1

        @cute.jit
        def __call__(self, p_qkv: cute.Pointer, p_f: cute.Pointer, p_b: cute.Pointer,
                     p_gate: cute.Pointer, p_convw: cute.Pointer, p_alog: cute.Pointer,
                     p_dtb: cute.Pointer, p_onw: cute.Pointer, p_state: cute.Pointer,
                     p_conv: cute.Pointer, p_out: cute.Pointer, p_shist: cute.Pointer,
                     p_chist: cute.Pointer, p_len: cute.Pointer, stream: cuda.CUstream):
            if cutlass.const_expr(self.NC == 1):
                self.kernel(p_qkv, p_f, p_b, p_gate, p_convw, p_alog, p_dtb, p_onw, p_state, p_conv,
                            p_out, p_shist, p_chist, p_len).launch(
                    grid=[self.H, self.B, 1], block=[_THREADS, 1, 1], stream=stream,
                    max_number_threads=[_THREADS, 1, 1], min_blocks_per_mp=self.min_ctas, use_pdl=self.pdl)
            else:
                self.kernel(p_qkv, p_f, p_b, p_gate, p_convw, p_alog, p_dtb, p_onw, p_state, p_conv,
                            p_out, p_shist, p_chist, p_len).launch(
                    grid=[self.H * self.NC, self.B, 1], block=[_THREADS, 1, 1],
                    cluster=[self.NC, 1, 1], stream=stream,
                    max_number_threads=[_THREADS, 1, 1], min_blocks_per_mp=self.min_ctas, use_pdl=self.pdl)

        @cute.kernel
        def kernel(self, p_qkv: cute.Pointer, p_f: cute.Pointer, p_b: cute.Pointer,
                   p_gate: cute.Pointer, p_convw: cute.Pointer, p_alog: cute.Pointer,
                   p_dtb: cute.Pointer, p_onw: cute.Pointer, p_state: cute.Pointer,
                   p_conv: cute.Pointer, p_out: cute.Pointer, p_shist: cute.Pointer,
                   p_chist: cute.Pointer, p_len: cute.Pointer):
            D = _D
            H = self.H
            T = self.T
            HD = H * D
            C = 3 * HD
            scale = 1.0 / math.sqrt(D)

            TV, NC, CW, G, R, S, E = self.TV, self.NC, self.CW, self.G, self.R, self.S, self.E
            WR, WC, RW = self.WR, self.WC, self.RW
            CK, NS = self.CK, self.NS
            tid, _, _ = cute.arch.thread_idx()
            hx, bb, _ = cute.arch.block_idx()
            h = hx
            rank = Int32(0)
            if cutlass.const_expr(NC > 1):
                h = hx // NC
                rank = hx % NC
            warp = cute.arch.make_warp_uniform(cute.arch.warp_idx())
            lane = tid % 32
            rsub = lane // G   # which of the R key rows of a warp instruction
            cg = lane % G      # which 4-column group of the warp's columns
            wc = warp % WC             # this warp's column block
            wr = warp // WC            # this warp's row block
            colw = wc * CW + cg * 4    # first of this thread's 4 value columns (tile-local)
            col0 = rank * TV + colw    # (head-local)
            row0 = wr * RW + rsub      # first of this thread's key rows: row0 + i * R, i < S
            lower = tid < 128
            half = tid // 128  # 0: q/k channels of row c; 1: v channel and decay gate of row c
            c = tid % 128  # key row (lower half) / value channel + gate row (upper half)

            smem = cutlass.memory.SmemAllocator()
            # per position, per key row r: (q_raw, k_raw, decay d, v_raw[r])
            s_info = smem.allocate_tensor(Float32, cute.make_layout(T * 128 * 4), byte_alignment=16)
            # per position, lower warps 0..3: (|q|^2, |k|^2, q.k, pad)  (bpro: value i of warp w at i * 4 + w)
            s_red = smem.allocate_tensor(Float32, cute.make_layout(self.nsum * 4 if self.bpro else T * 16),
                                         byte_alignment=16)
            # per position, the tile's unnormalized outputs
            s_o = smem.allocate_tensor(Float32, cute.make_layout(T * TV), byte_alignment=16)
            # row blocks' partial column sums (k^T d S | q^T d S), two position buffers
            s_part = smem.allocate_tensor(Float32, cute.make_layout(2 * WR * 2 * TV), byte_alignment=16)
            # cluster: every CTA's partial sum of o^2 per position, written by the peers
            s_ss = smem.allocate_tensor(Float32, cute.make_layout(T * NC), byte_alignment=16)

            # sequence length (ragged verify): positions >= L write nothing
            L = Int32(T)
            if cutlass.const_expr(self.ragged and not self.pdl):
                L = cute.make_tensor(p_len, cute.make_layout(self.B))[bb]

            # ---- issue the state loads first: S x 16 B per thread ----------------------------------
            # thread's key rows: row0 + i * R, i < S; value columns col0 .. col0 + 3
            s_off = cute.assume(((bb * H + h) * D + row0) * D + col0, divby=4)
            g_state = cute.make_tensor(p_state + s_off, cute.make_layout((4, S), stride=(1, R * D)))
            r_s = cute.make_rmem_tensor((4, S), Float32)
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
            ch_g = cute.make_tensor(p_chist, cute.make_layout(self.B * T * C * 3))
            convw_g = cute.make_tensor(p_convw, cute.make_layout(C * 4))
            for i in cutlass.range_constexpr(3):
                win1[i] = conv_g[(bb * C + ch1) * 3 + i]
            for i in cutlass.range_constexpr(4):
                w1[i] = convw_g[ch1 * 4 + i].to(Float32)
            a_exp = cute.math.exp(cute.make_tensor(p_alog, cute.make_layout(H))[h].to(Float32))
            dtb = cute.make_tensor(p_dtb, cute.make_layout(HD))[h * D + c].to(Float32)
            if lower:
                for i in cutlass.range_constexpr(3):
                    win2[i] = conv_g[(bb * C + ch2) * 3 + i]
                for i in cutlass.range_constexpr(4):
                    w2[i] = convw_g[ch2 * 4 + i].to(Float32)

            if cutlass.const_expr(self.pdl):
                # the previous kernel produced the activations and lengths: wait for it, then let the next
                # kernel launch (it waits for this one before its own activations)
                cute.arch.griddepcontrol_wait()
                cute.arch.griddepcontrol_launch_dependents()
                if cutlass.const_expr(self.ragged):
                    L = cute.make_tensor(p_len, cute.make_layout(self.B))[bb]

            # every position's activations now (no global load waits behind a barrier)
            qkv_g = cute.make_tensor(p_qkv, cute.make_layout(self.B * T * C))
            f_g = cute.make_tensor(p_f, cute.make_layout(self.B * T * HD))
            b_g = cute.make_tensor(p_b, cute.make_layout(self.B * T * H))
            x1 = cute.make_rmem_tensor((T,), p_qkv.dtype)
            x2 = cute.make_rmem_tensor((T,), p_qkv.dtype)
            f_r = cute.make_rmem_tensor((T,), p_f.dtype)
            b_r = cute.make_rmem_tensor((T,), p_b.dtype)
            for t in cutlass.range_constexpr(T):
                bt = bb * T + t
                x1[t] = qkv_g[bt * C + ch1]
                f_r[t] = f_g[bt * HD + h * D + c]
                b_r[t] = b_g[bt * H + h]
            if lower:
                for t in cutlass.range_constexpr(T):
                    x2[t] = qkv_g[(bb * T + t) * C + ch2]
            # epilogue inputs: warp (t % 8) finishes position t; lane owns E output columns
            # (tile 16: lanes 16..31 hold no column; they load nothing and add 0 to the sums)
            EL = self.EL
            e_lane = lane
            if cutlass.const_expr(EL < 32):
                e_lane = lane % EL
            e0 = rank * TV + e_lane * E  # head-local first output column of this lane
            r_onw_raw = cute.make_rmem_tensor((E,), p_onw.dtype)
            cute.autovec_copy(vec(p_onw, cute.assume(e0, divby=E), E), r_onw_raw)
            gate_r = cute.make_rmem_tensor((E, T), p_gate.dtype)
            for t in cutlass.range_constexpr(T):
                if warp == t % 8:
                    cute.autovec_copy(vec(p_gate, cute.assume((bb * T + t) * HD + h * D + e0, divby=E), E),
                                      gate_r[None, t])

            if cutlass.const_expr(not self.bpro):
                # ---- prologue of ALL positions (independent of the state): conv + silu, gate, norms ---
                for t in cutlass.range_constexpr(T):
                    bt = bb * T + t
                    active = Int32(1)
                    if cutlass.const_expr(self.ragged):
                        active = Int32(0)
                        if t < L:
                            active = Int32(1)
                    prologue_position(x1[t], x2[t], f_r[t], win1, win2, w1, w2, a_exp, dtb, self.lb, lower, lane,
                                      warp, c, s_info, t * 512 + c * 4, s_red, t * 16, False, None, 0, True)
                    # conv_hist[b, t] (rank 0 of a cluster writes it)
                    wconv = active
                    if cutlass.const_expr(NC > 1):  # noqa: SIM102 (DSL: nested dynamic ifs)
                        if rank != 0:
                            wconv = Int32(0)
                    if wconv > 0:
                        for i in cutlass.range_constexpr(3):
                            ch_g[(bt * C + ch1) * 3 + i] = win1[i]
                        if lower:
                            for i in cutlass.range_constexpr(3):
                                ch_g[(bt * C + ch2) * 3 + i] = win2[i]

            else:
                # the batched prologue (bpro): every position in one branch per half, so the positions' conv,
                # silu and decay interleave, and the warp sums of all positions meet in one butterfly
                # reduce-scatter (value i of lower warp w lands in s_red[i * 4 + w]). Lower thread c: conv +
                # silu of the q and k channels of key row c for every position, (q, k) into s_info[.. + 0, 1]
                # and the sums |q_t|^2, |k_t|^2, q_t.k_t. Upper thread c: conv + silu of the v channel c and
                # the decay of row c, into s_info[.. + 2, 3]. conv_hist[b, t] is written by rank 0 of a
                # cluster, for positions t < L
                whist = []
                for t in cutlass.range_constexpr(T):
                    wconv = Int32(1)
                    if cutlass.const_expr(self.ragged):
                        wconv = Int32(0)
                        if t < L:
                            wconv = Int32(1)
                    if cutlass.const_expr(NC > 1):  # noqa: SIM102 (DSL: nested dynamic ifs)
                        if rank != 0:
                            wconv = Int32(0)
                    whist.append(wconv)
                y1 = cute.make_rmem_tensor((T,), Float32)
                for t in cutlass.range_constexpr(T):
                    y1[t] = conv_silu(win1, x1[t], w1, True)
                    if whist[t] > 0:
                        for i in cutlass.range_constexpr(3):
                            ch_g[((bb * T + t) * C + ch1) * 3 + i] = win1[i]
                if lower:
                    y2 = cute.make_rmem_tensor((T,), Float32)
                    for t in cutlass.range_constexpr(T):
                        y2[t] = conv_silu(win2, x2[t], w2, True)
                        if whist[t] > 0:
                            for i in cutlass.range_constexpr(3):
                                ch_g[((bb * T + t) * C + ch2) * 3 + i] = win2[i]
                    for t in cutlass.range_constexpr(T):
                        s_info[t * 512 + c * 4 + 0] = y1[t]
                        s_info[t * 512 + c * 4 + 1] = y2[t]
                    vals = []
                    for t in cutlass.range_constexpr(T):
                        vals += [y1[t] * y1[t], y2[t] * y2[t], y1[t] * y2[t]]
                    vals += [Float32(0.0)] * (self.nsum - len(vals))
                    kept, start = reduce_scatter(vals, lane, (16, 8, 4, 2, 1))
                    for i in cutlass.range_constexpr(len(kept)):
                        s_red[(start + i) * 4 + warp] = kept[i]
                else:
                    for t in cutlass.range_constexpr(T):
                        s_info[t * 512 + c * 4 + 2] = expf(self.lb * sigmoid(a_exp * (f_r[t].to(Float32) + dtb), True),
                                                           True)
                        s_info[t * 512 + c * 4 + 3] = y1[t]
            cute.arch.sync_threads()  # the only CTA barrier before the epilogue

            # ---- the recurrence: per position only warp-local work (no barrier) -----------------
            r_info = cute.make_rmem_tensor((4,), Float32)
            acc_k = cute.make_rmem_tensor((4,), Float32)
            acc_q = cute.make_rmem_tensor((4,), Float32)
            u = cute.make_rmem_tensor((4,), Float32)
            o = cute.make_rmem_tensor((4,), Float32)
            r_p = cute.make_rmem_tensor((4,), Float32)
            # per position: beta rk, rq / sqrt(D), (q.k) / sqrt(D), rk; per (column, position): beta v
            c_sc = cute.make_rmem_tensor((4, T), Float32)
            c_bv = cute.make_rmem_tensor((4, T), Float32)
            # per (row, position): q d, k d, d, k rk  (preload only)
            c_row = cute.make_rmem_tensor((4, S, T) if self.pre else (4, 1, 1), Float32)
            r_prev = cute.make_rmem_tensor((4, S) if self.delay else (4, 1), Float32)  # delay: last state
            for t in cutlass.range_constexpr(T):
                if cutlass.const_expr(self.bpro):
                    r_c = cute.make_rmem_tensor((4,), Float32)
                    rq = rsqrtf(red4(s_red, 3 * t, r_c) + _L2_EPS, True)
                    rk = rsqrtf(red4(s_red, 3 * t + 1, r_c) + _L2_EPS, True)
                    dot = red4(s_red, 3 * t + 2, r_c)
                else:
                    rq, rk, dot = position_norms(s_red, t * 16, True)
                beta = sigmoid(b_r[t].to(Float32), True)
                c_sc[0, t] = beta * rk
                c_sc[1, t] = rq * scale
                c_sc[2, t] = dot * rq * rk * scale
                c_sc[3, t] = rk
                for j in cutlass.range_constexpr(4):
                    c_bv[j, t] = beta * s_info[t * 512 + (col0 + j) * 4 + 3]
                if cutlass.const_expr(self.pre):
                    for i in cutlass.range_constexpr(S):
                        ro = t * 512 + (row0 + i * R) * 4
                        cute.autovec_copy(vec(s_info.iterator, cute.assume(ro, divby=4), 4),
                                          r_info)
                        c_row[0, i, t] = r_info[0] * r_info[2]
                        c_row[1, i, t] = r_info[1] * r_info[2]
                        c_row[2, i, t] = r_info[2]
                        c_row[3, i, t] = r_info[1] * rk
            for t in cutlass.range_constexpr(T):
                active = Int32(1)
                if cutlass.const_expr(self.ragged):
                    active = Int32(0)
                    if t < L:
                        active = Int32(1)

                # k^T diag(d) S and q^T diag(d) S over the old state: this thread's S rows, then the
                # lanes holding the same columns (other rows) by butterfly shuffles
                acc_k.fill(0.0)
                acc_q.fill(0.0)
                for i in cutlass.range_constexpr(S):
                    if cutlass.const_expr(self.pre):
                        qd = c_row[0, i, t]
                        kd = c_row[1, i, t]
                    else:
                        r = row0 + i * R
                        cute.autovec_copy(vec(s_info.iterator, cute.assume(t * 512 + r * 4, divby=4), 4),
                                          r_info)
                        qd = r_info[0] * r_info[2]
                        kd = r_info[1] * r_info[2]
                    for j in cutlass.range_constexpr(4):
                        acc_k[j] = acc_k[j] + kd * r_s[j, i]
                        acc_q[j] = acc_q[j] + qd * r_s[j, i]
                if cutlass.const_expr(WR > 1):
                    # over the row lanes by a butterfly reduce-scatter (a lane then holds the sums of value
                    # indices start .. start + len - 1), then the row blocks' partial sums meet in shared
                    # memory (double-buffered by position: buffer t % 2 is rewritten only after every thread
                    # passed the next barrier), behind a barrier of the WR warps that share these columns
                    pb = (t % 2) * (WR * 2 * TV) + wr * (2 * TV) + colw
                    vals, start = reduce_scatter([acc_k[0], acc_k[1], acc_k[2], acc_k[3],
                                                  acc_q[0], acc_q[1], acc_q[2], acc_q[3]], lane, self.red_offs)
                    for i in cutlass.range_constexpr(len(vals)):
                        g = start + i
                        s_part[pb + (g // 4) * TV + (g % 4)] = vals[i]
                    if cutlass.const_expr(WR < 8):
                        cute.arch.barrier(barrier_id=1 + wc, number_of_threads=WR * 32)
                    else:
                        cute.arch.sync_threads()
                    acc_k.fill(0.0)
                    acc_q.fill(0.0)
                    for w in cutlass.range_constexpr(WR):
                        pw = (t % 2) * (WR * 2 * TV) + w * (2 * TV) + colw
                        cute.autovec_copy(vec(s_part.iterator, cute.assume(pw, divby=4), 4), r_p)
                        for j in cutlass.range_constexpr(4):
                            acc_k[j] = acc_k[j] + r_p[j]
                        cute.autovec_copy(vec(s_part.iterator, cute.assume(pw + TV, divby=4), 4), r_p)
                        for j in cutlass.range_constexpr(4):
                            acc_q[j] = acc_q[j] + r_p[j]
                else:
                    # one row block: the lanes holding the same columns (other rows) by butterfly shuffles
                    for si in cutlass.range_constexpr(len(self.red_offs)):
                        for j in cutlass.range_constexpr(4):
                            acc_k[j] = acc_k[j] + cute.arch.shuffle_sync_bfly(acc_k[j], offset=self.red_offs[si])
                            acc_q[j] = acc_q[j] + cute.arch.shuffle_sync_bfly(acc_q[j], offset=self.red_offs[si])
                if cutlass.const_expr(self.delay and t > 0 and self.is_slot(t - 1)):
                    # position t-1's state (a slot position), held back until now
                    act_p = Int32(1)
                    if cutlass.const_expr(self.ragged):
                        act_p = Int32(0)
                        if t - 1 < L:
                            act_p = Int32(1)
                    if act_p > 0:
                        h_off = cute.assume((((bb * NS + (t - 1) // CK) * H + h) * D + row0) * D + col0, divby=4)
                        cute.autovec_copy(r_prev, cute.make_tensor(p_shist + h_off,
                                                                   cute.make_layout((4, S), stride=(1, R * D))))
                # u = beta (v - S'^T k);  o = S''^T q / sqrt(D) = (S'^T q + (q.k) u) / sqrt(D)
                for j in cutlass.range_constexpr(4):
                    u[j] = c_bv[j, t] - c_sc[0, t] * acc_k[j]
                    o[j] = c_sc[1, t] * acc_q[j] + c_sc[2, t] * u[j]
                # every lane of a column group holds the same o: all store it (same value, same
                # address: no branch in the position chain)
                cute.autovec_copy(o, vec(s_o.iterator, cute.assume(t * TV + colw, divby=4), 4))
                # S'' = diag(d) S + k u^T
                for i in cutlass.range_constexpr(S):
                    if cutlass.const_expr(self.pre):
                        dr = c_row[2, i, t]
                        kr = c_row[3, i, t]
                    else:
                        r = row0 + i * R
                        cute.autovec_copy(vec(s_info.iterator, cute.assume(t * 512 + r * 4, divby=4), 4),
                                          r_info)
                        dr = r_info[2]
                        kr = r_info[1] * c_sc[3, t]
                    for j in cutlass.range_constexpr(4):
                        r_s[j, i] = dr * r_s[j, i] + kr * u[j]
                # the state after a slot position (compile-time: t + 1 a multiple of CK, or the last) goes to
                # state_hist[b, t // CK]; the others stay in registers only
                if cutlass.const_expr(self.delay):
                    if cutlass.const_expr(self.is_slot(t)):
                        for i in cutlass.range_constexpr(S):
                            for j in cutlass.range_constexpr(4):
                                r_prev[j, i] = r_s[j, i]
                    if cutlass.const_expr(t == T - 1):  # noqa: SIM102 (DSL: nested dynamic ifs)
                        if active > 0:
                            h_off = cute.assume((((bb * NS + t // CK) * H + h) * D + row0) * D + col0, divby=4)
                            g_dst = cute.make_tensor(p_shist + h_off, cute.make_layout((4, S), stride=(1, R * D)))
                            cute.autovec_copy(r_s, g_dst)
                elif cutlass.const_expr(self.is_slot(t)):
                    if active > 0:
                        h_off = cute.assume((((bb * NS + t // CK) * H + h) * D + row0) * D + col0, divby=4)
                        g_dst = cute.make_tensor(p_shist + h_off, cute.make_layout((4, S), stride=(1, R * D)))
                        cute.autovec_copy(r_s, g_dst)

            # ---- epilogue: gated RMSNorm of every position (warp t % 8 takes position t) ----------
            cute.arch.sync_threads()  # s_o complete
            r_o = cute.make_rmem_tensor((E, T), Float32)
            ss_r = cute.make_rmem_tensor((T,), Float32)
            for t in cutlass.range_constexpr(T):
                if warp == t % 8:
                    cute.autovec_copy(vec(s_o.iterator, cute.assume(t * TV + e_lane * E, divby=E), E),
                                      r_o[None, t])
                    ss = Float32(0.0)
                    for j in cutlass.range_constexpr(E):
                        ss = ss + r_o[j, t] * r_o[j, t]
                    if cutlass.const_expr(EL < 32):  # noqa: SIM102 (DSL: nested dynamic ifs)
                        if lane >= EL:
                            ss = Float32(0.0)
                    ss_r[t] = warp_sum(ss)
            if cutlass.const_expr(NC > 1):
                # the head's sum of o^2 meets across the cluster through distributed shared memory
                cute.arch.cluster_wait()  # matches the relaxed arrive after the state loads
                for t in cutlass.range_constexpr(T):
                    if warp == t % 8:  # noqa: SIM102 (DSL: nested dynamic ifs)
                        if lane < NC:
                            st_cluster_f32(s_ss.iterator + (t * NC + rank), lane, ss_r[t])
                cute.arch.cluster_arrive()
                cute.arch.cluster_wait()
                for t in cutlass.range_constexpr(T):
                    if warp == t % 8:
                        tot = Float32(0.0)
                        for rr in cutlass.range_constexpr(NC):
                            tot = tot + s_ss[t * NC + rr]
                        ss_r[t] = tot
            for t in cutlass.range_constexpr(T):
                if warp == t % 8:
                    active = Int32(1)
                    if cutlass.const_expr(self.ragged):
                        active = Int32(0)
                        if t < L:
                            active = Int32(1)
                    inv = rsqrtf(ss_r[t] * (1.0 / D) + self.eps, True)
                    r_out = cute.make_rmem_tensor((E,), p_out.dtype)
                    for j in cutlass.range_constexpr(E):
                        val = (r_o[j, t] * inv * r_onw_raw[j].to(Float32)
                               * sigmoid(gate_r[j, t].to(Float32), True))
                        r_out[j] = val.to(p_out.dtype)
                    if cutlass.const_expr(EL < 32):  # noqa: SIM102 (DSL: nested dynamic ifs)
                        if lane >= EL:
                            active = Int32(0)
                    if active > 0:
                        o_off = cute.assume((bb * T + t) * HD + h * D + e0, divby=E)
                        cute.autovec_copy(r_out, vec(p_out, o_off, E))

    _KERNEL_CLS = KDAVerifyKernel
    return KDAVerifyKernel


def kda_verify(qkv, f, b, gate, params, state, conv_state, out, state_hist, conv_hist,
               lengths=None, tile_v: int = 128, row_warps: int | None = None, pdl: bool = False,
               checkpoint: int | None = None):
    """T positions per sequence (speculative verification), state kept on chip across positions.
    qkv [B,T,3HD], f [B,T,HD], b [B,T,H], gate [B,T,HD] bf16; writes out [B,T,HD] bf16,
    state_hist [B,ceil(T/c),H,128,128] fp32 (slot s: the state after position min((s+1) c, T) - 1; c =
    checkpoint, None = 1: every position), conv_hist [B,T,3HD,3] bf16 (every position).
    `state`/`conv_state` are not modified. lengths [B] int32 in 1..T: positions >= lengths[b] are
    not computed and their out / conv_hist entries and the slots whose position is >= lengths[b] are left
    untouched. row_warps: how many of the 8 warps split
    the key rows (ROW_WARPS_ALLOWED[tile_v]); None takes default_row_warps. pdl=True: programmatic
    dependent launch (module doc; the kernel directly before must not write `state` or `conv_state`).
    Returns `out`."""
    if not isinstance(pdl, bool):
        raise TypeError(f"kda cute verify: pdl must be a bool (got {pdl!r})")
    if row_warps is not None and row_warps not in (1, 2, 4, 8):
        raise ValueError(f"kda cute verify: row_warps must be 1, 2, 4 or 8 (got {row_warps!r})")
    if row_warps is not None and row_warps not in ROW_WARPS_ALLOWED.get(tile_v, (row_warps,)):
        raise ValueError(f"kda cute verify: row_warps must be one of {ROW_WARPS_ALLOWED[tile_v]} at "
                         f"tile_v={tile_v} (got {row_warps})")
    if not isinstance(qkv, torch.Tensor) or qkv.dim() != 3:
        raise ValueError("kda cute verify: qkv must be [B, T, 3HD]")
    T = qkv.shape[1]
    if not 1 <= T <= 16:
        raise NotImplementedError(f"kda cute verify: T must be in 1..16 (got {T})")
    ck = 1 if checkpoint is None else checkpoint
    if isinstance(ck, bool) or not isinstance(ck, int) or not 1 <= ck <= T:
        raise ValueError(f"kda cute verify: checkpoint must be None or an int in 1..T={T} (got {checkpoint!r})")
    B, H = _validate(qkv, f, b, gate, params, state, conv_state, out, tile_v, T)
    dev = qkv.device
    C = 3 * H * _D
    _check("state_hist", state_hist, (B, -(-T // ck), H, _D, _D), _F32, dev)
    _check("conv_hist", conv_hist, (B, T, C, _W - 1), _BF16, dev)
    if state_hist.numel() >= 2**31:
        raise NotImplementedError("kda cute verify: state_hist too large for 32-bit indexing")
    if lengths is not None:
        _check("lengths", lengths, (B,), (torch.int32,), dev)
    if row_warps is None:
        row_warps = default_row_warps(tile_v, B, H, T)
    ragged = lengths is not None
    args = _kernel_args(qkv, f, b, gate, params, state, conv_state, out, state_hist, conv_hist, lengths)
    key = ("verify", B, H, T, ragged, tile_v, row_warps, pdl, ck, dev.index) + _params_key(params)
    with torch.cuda.device(dev):
        stream = _stream(dev)
        fn = _get_compiled(key, lambda: _kernel_class()(B, H, T, ragged, params.eps, params.lower_bound, tile_v,
                                                        row_warps, pdl, ck), args + [stream])
        fn(*args, stream)
    return out
