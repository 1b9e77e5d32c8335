"""KDA multi-token verification (speculative decoding, T = 2..8 positions per sequence) in one CuTe
DSL launch, state kept on chip across positions ("column layout").

What one launch fuses, per (sequence b, head h), for every position t in order, exactly what
`k3lab.ref.kda.kda_verify` computes: the conv update + silu of the head's q|k|v channels, l2norm of
q and k, the decay gate and beta, the delta rule on the fp32 state, and the gated output RMSNorm;
it writes
    out        [B, T, H*D] bf16
    state_hist [B, T, H, D, D] fp32   (the state after each position, for rollback/commit)
    conv_hist  [B, T, 3*H*D, 3] bf16  (the conv window after each position)
`state` and `conv_state` are only read. `lengths` [B] int32 in 1..T selects the ragged path:
positions >= lengths[b] write nothing (their out/hist entries are left untouched); None compiles the
uniform-length specialization.

Layout. 256 threads a CTA, tile_v value columns a CTA (128: one CTA per head; 64 / 32: a cluster of
2 / 4 CTAs). The 8 warps form a grid: `row_warps` (WR) of them split the 128 key rows, 8 / WR split
the tile's columns; a lane holds 4 columns of 128 / (WR R) rows (R = rows one warp instruction
covers). The two key reductions of a position (k^T diag(d) S and q^T diag(d) S) finish with butterfly
shuffles inside the warp, and with WR > 1 the WR row blocks' partial sums meet in shared memory (one
CTA barrier per position, partials double-buffered). What does not depend on the state is taken out
of the position chain:
  1. prologue of ALL T positions first (conv, silu, squared norms, decay, beta), one barrier;
  2. the recurrence, position by position (state_hist stored from registers);
  3. epilogue: the gated RMSNorm of every position at once (warp t % 8 takes position t); its sum
     of o^2 meets across a cluster through distributed shared memory, one cluster barrier in all.
Why not WR = 1 (no barrier at all): a warp then owns tile_v / 8 columns, so each state_hist store
instruction writes 16-32 byte pieces of R different rows, and at B = 1 those stores dominate (the
store-free variant of the same kernel runs T=4 in 5.8 us, with stores 9-10 us). WR = 4 gives each
store instruction whole 128-byte lines at tile 32 and is the measured best (ROW_WARPS).
The baseline is kda_decode.py's row layout (layout="rows": a warp instruction moves whole state rows,
cross-warp reductions through shared memory, two CTA barriers and a cluster barrier per position, and
the prologue on the chain).

Per position, with row_warps > 1 (measured in profiles/h200/kda_cute_exp.json, second session, and again
in kda_cute_exp_pdl.json, third):
  - preload: every position's per-row factors and scalars go to registers after the prologue, so the
    chain holds no shared-memory load but the partial sums (B=1 T=4 tile 16: 5.96 vs 6.34 us without);
  - scatter: the 8 partial sums a lane holds meet over the row lanes by a butterfly reduce-scatter
    (4 + 2 + 1 shuffles instead of 3 x 8; 5.96 vs 6.35 us without);
  - delay: position t's state_hist stores leave after position t+1's partial sums are read back
    (on at T >= 4 when the grid fits one CTA per SM: second session T=4 5.95 vs 6.06 us, T=8 9.69 vs 9.90);
  - group_bar: the exchange waits on a named barrier of the row_warps warps sharing columns, not all 8
    (B=1 T=8 9.49 vs 9.71 us, B=64 T=4 72.82 vs 73.61; B=1 T=4 a tie).
Not kept: late_conv (conv_hist stores at the end: T=4 6.22 vs 5.96 us).
Tile 16 (a cluster of 8 CTAs per head, row_warps 2/4/8, 16 output lanes in the epilogue) spreads a
position's state_hist stores over 8 SMs per head; it is the B=1 winner.

Fifth session: the prologue was the long pole, not the chain. Taking it off the critical path
(profiles/h200/kda_cute_exp_lat.json, 80 rotated sets, 12 heads, B=1 T=4 tile 16):
  - fast (default on): exp, sigmoid and rsqrt as single MUFU ops (ex2.approx, rcp.approx, rsqrt.approx)
    instead of the accurate exp's range-reduced polynomial and the IEEE division's called slow path,
    both on every position's latency chain: 5.45 against 5.99 us;
  - bpro (on while the grid is resident, B H NC <= 2 x 132): the batched prologue, every position's conv,
    silu and decay in one branch per half (the positions interleave) and the 3 T warp sums in one
    reduce-scatter instead of T blocks of 15 shuffles one after another: 5.59 alone, 5.03 with fast;
  - chunk (measured, not kept; kda_cute_exp_chunk.json): the T positions as one WY chunk (one pass over
    the state, one exchange, a T x T solve per column) 6.24 against 5.93 us: the T exchanges were not
    the cost.

Measured on the H200, 12 heads, all outputs/histories within tolerance of the fp64 oracle
(profiles/h200/kda_sweep.json, fifth session, `k3lab bench kda`, inputs rotated past L2, copy 4.195 TB/s
in that run; fla = fused_recurrent_kda, which has no conv, no output norm and writes only the final state):
    B=1  T=4:  5.04 us (tile 16)   pdl 4.23   tile 32 5.34, Triton 10.05, fla 9.97
    B=1  T=8:  7.67 us (tile 16)   pdl 6.80   Triton 16.64, fla 16.37
    B=64 T=4: 71.92 us = 3.69 TB/s = 87.9 % of copy (tile 128)   pdl 75.19 (pdl loses here), Triton 86.82,
              fla 78.62
    B=64 T=8: 142.20 us (tile 64)   fla 137.67 (fla is 3 % faster, writing one state where this writes 8)
The issue's target (T=4, B=1 <= 6.0 us) is met with a plain launch (5.04 us) and with pdl (4.23 us).
Without any state_hist store the fast + bpro kernel needs 4.59 us (kda_cute_exp_lat.json, "hist": False).

Floor per (b, h): state 64 KiB read once + T x 64 KiB state_hist written, conv 2,304 B read +
T x 2,304 B conv_hist written, T x (768 + 256 + 256 + 256 + 2) B activations. For H = 12, B = 1:
T = 4 -> 4.1 MB -> 0.97 us at 4.275 TB/s; T = 8 -> 7.5 MB -> 1.75 us. At B = 1 the bound is latency:
launch, then the T-step chain; the state_hist stores of a position leave from the few SMs that own
the batch's heads (12 heads: 12 / 24 / 48 CTAs at tile 128 / 64 / 32).

    kda_verify(qkv, f, b, gate, params, state, conv_state, out, state_hist, conv_hist,
               lengths=None, tile_v=128, layout="columns", row_warps=None, pdl=False) -> out
"""
import functools
import math

import torch

from .kda_decode import (_BF16, _D, _F32, _L2_EPS, _RESIDENT, _THREADS, _W, _check, _dsl, _get_compiled, _kernel_args,
                         _kernel_class, _params_key, _stream, _validate, kda_verify_bytes)

__all__ = ["LAYOUTS", "kda_verify", "kda_verify_bytes"]

LAYOUTS = ("columns", "rows")
# row_warps per tile_v when not given (profiles/h200/kda_cute_verify_split.json: 12 heads, B=1 T=4/8,
# B=64 T=4, row_warps 1/2/4/8): 4 is the best at tile 32 (the B=1 default) in every case and at
# tile 128 for B=64 (the large-batch default); at tile 64 within 2 % of the best. At tile 128 and B=1,
# 1-2 row warps are 5-13 % faster, but auto never picks tile 128 at B=1.
ROW_WARPS = {128: 4, 64: 4, 32: 4, 16: 4}
# row_warps each tile allows (a lane holds 4 columns: at tile 16 one warp has at most 16 / (8 / WR))
ROW_WARPS_ALLOWED = {128: (1, 2, 4, 8), 64: (1, 2, 4, 8), 32: (1, 2, 4, 8), 16: (2, 4, 8)}
_COLUMNS_CLS = None


def _columns_class():
    global _COLUMNS_CLS
    if _COLUMNS_CLS is not None:
        return _COLUMNS_CLS
    d = _dsl()
    cuda, cutlass, Float32, Int32, cute = d.cuda, d.cutlass, d.Float32, d.Int32, d.cute
    sigmoid, vec, st_cluster_f32, warp_sum = d.sigmoid, d.vec, d.st_cluster_f32, d.warp_sum
    expf, rsqrtf = d.expf, d.rsqrtf
    prologue_position, position_norms = d.prologue_position, d.position_norms

    def reduce_scatter(vals, lane, offs):
        """Butterfly reduce-scatter of `vals` over the lanes lane ^ off, off in offs: each round a lane keeps
        half of its values (the upper half when lane & off) and adds the partner's copy of that half; once
        one value is left the remaining rounds add it whole. Returns (the values kept, the index in `vals`
        of the first). len(vals) must halve evenly while more than one is left."""
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
        """chunk: prologue value i summed over the 4 lower warps, in warp order (as position_norms sums)."""
        cute.autovec_copy(vec(s_red.iterator, cute.assume(i * 4, divby=4), 4), r_c)
        return ((r_c[0] + r_c[1]) + r_c[2]) + r_c[3]

    class KDAVerifyColumns:
        """One CTA (or a cluster of NC CTAs) per (b, h); T positions in order; state only read."""

        def __init__(self, B: int, H: int, T: int, verify: bool, ragged: bool, eps: float,
                     lower_bound: float, tile_v: int = 128, row_warps: int = 1, hist: bool = True,
                     preload=None, scatter=None, delay=None, late_conv=None, group_bar=None, pdl=False,
                     chunk=None, fast=None, bpro=None):
            assert verify, "the column-layout generator is verify-only (decode: kda_decode.py)"
            # hist=False skips the state_hist stores: a measurement of what they cost at small batch
            # (kernels/cute/check_kda.py), not an API mode
            self.hist = hist
            self.B, self.H, self.T = B, H, T
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
            # preload: every position's per-row factors (q d, k d, d, k rk) and per-column / scalar terms
            # (beta v, beta rk, rq / sqrt(D), (q.k) / sqrt(D)) go to registers right after the prologue,
            # so a position's chain holds no shared-memory load but the partial sums. 4 S T + 4 T + 3 T
            # registers: on when S T <= 8 (tile 16 up to T = 4, tile 32 up to T = 2), or <= 16 when the
            # grid fits one CTA per SM (no register cap; at B = 1, T = 8, tile 16 it measured 9.86 us
            # against 10.28 without).
            # at most 128 registers a thread -> 2 CTAs (16 warps) per SM when the grid has more CTAs than
            # an H200 has SMs; a grid that fits in one CTA per SM may use more registers
            self.min_ctas = 2 if B * H * self.NC > _RESIDENT // 2 else 1
            # chunk: the T positions as one chunk of the delta rule (the WY form the chunked prefill uses,
            # with T <= 8 rows): what does not depend on the state (the l2norm factors, beta, the decay's
            # cumulative products P_t and, for j < t, the decayed products k_t.k_j and q_t.k_j) is reduced in
            # the prologue, while the state loads are in flight; then ONE pass over the state forms
            # S0^T (k_t P_t) and S0^T (q_t P_t) for every t, ONE exchange (shuffles, shared memory, one
            # barrier) reduces them, and a T x T triangular solve per column gives every u_t and o_t. The
            # stepwise chain instead pays T exchanges (shuffle rounds and a barrier) in sequence. The state
            # after each position comes from the same register update as the chain's. A measurement knob:
            # it LOSES everywhere (profiles/h200/kda_cute_exp_chunk.json, 12 heads: B = 1 T = 4 6.24 against
            # 5.93 us, T = 8 10.95 against 9.46, B = 64 T = 4 79.46 against 72.06): the chain's exchanges were
            # not the cost; the prologue's transcendentals and per-position blocks were (see fast, bpro).
            self.chunk = bool(chunk)
            # fast (default on): single-MUFU transcendentals (see kda_decode.py's KDAStepKernel). Measured
            # (profiles/h200/kda_cute_exp_lat.json, 12 heads, tile 16 at B = 1): T = 4 5.45 against 5.99 us,
            # T = 8 8.44 against 9.48; B = 64 T = 4 (tile 128) 71.74 against 72.35.
            self.fast = True if fast is None else bool(fast)
            # bpro: the batched prologue (the stepwise chain after it is unchanged): every position's conv,
            # silu and decay in one branch per half, the 3 T warp sums in one reduce-scatter (8 + 4 + 2 + 1 + 1
            # shuffles at T = 4 instead of 3 T x 5), instead of T position blocks one after another, each
            # with its own branch and five rounds of shuffles. Default: on when the whole grid is resident
            # at once (B H NC <= 2 x 132 CTAs). Measured (kda_cute_exp_lat.json, with fast): B = 1 T = 4 5.03
            # against 5.45 us (fast alone; 5.99 neither; pdl 4.20 against 4.99), T = 8 7.57 against 8.44,
            # T = 2 3.95 against 4.45 (neither); B = 2, 4, 8, 16 at T = 4 0.8-1.1 us faster than neither;
            # at B = 64 T = 4 it LOSES (73.29 against 71.74 with fast alone). Where it switches
            # (kda_cute_exp_thr.json, tile 128): grid 192 22.12 / 21.86 against 22.62 / 22.70 us (12 heads B = 16
            # T = 4, 6 heads B = 32 T = 4); grid 288 (B = 24 T = 2) 18.76 against 18.28, 384 39.89 / 39.65
            # against 38.58 / 38.57 (T = 4).
            if bpro is None:
                bpro = B * H * self.NC <= _RESIDENT and not late_conv
            assert not (bpro and late_conv), "bpro writes conv_hist in its prologue (late_conv off)"
            self.bpro = bool(bpro) and not self.chunk
            assert not (self.chunk and late_conv), "chunk writes conv_hist in its prologue (late_conv off)"
            # chunk: (t, j < t) -> index of the pair among the prologue's decayed cross terms
            self.pair, n_ = {}, 0
            for t_ in range(1, T):
                for m_ in range(t_):
                    self.pair[(t_, t_ - 1 - m_)] = n_
                    n_ += 1
            # values the prologue reduces (3 per position, 2 per pair), padded to a multiple of 32 for the
            # warp's reduce-scatter; values a thread reduces over its row lanes (8 per position), padded to a
            # multiple of 2 ** rounds
            # (bpro: 3 T sums, padded to a power of two, which halves evenly)
            self.nsum = (-(-(3 * T + 2 * n_) // 32) * 32 if self.chunk
                         else 1 << max(2, (3 * T - 1).bit_length()))
            rounds_ = len(self.red_offs)
            self.nacc = -(-(8 * T) // max(4, 2 ** rounds_)) * max(4, 2 ** rounds_)
            if preload is None and self.chunk:
                # chunk preloads 4 S T registers of row factors next to 8 T sums; T <= 4 at tile 16
                preload = self.S * T <= 8
            self.pre = (self.S * T <= (16 if self.min_ctas == 1 else 8)) if preload is None else bool(preload)
            # scatter (row_warps > 1): the shuffle reduction of a position's 8 partial sums (4 columns x
            # k and q) over the R row lanes is a butterfly reduce-scatter: each round a lane keeps half of
            # its values and sends the other half, so the rounds move 4 + 2 + 1 (+ 1 ...) values instead
            # of 8 each; a lane then writes the 8 / 2^rounds sums it owns to shared memory.
            self.scatter = (row_warps > 1) if scatter is None else bool(scatter) and row_warps > 1
            # delay (row_warps > 1): position t's state_hist stores are issued one position later, right
            # after position t+1's partial sums are read back, instead of ahead of t+1's shuffles. On for
            # T >= 4 when the grid fits one CTA per SM (profiles/h200/kda_cute_exp.json, 12 heads, tile 16:
            # B=1 T=4 5.95 vs 6.06 us, T=8 9.69 vs 9.90; T=2 4.67 vs 4.52 and B=64 T=4 73.89 vs 73.50 lose)
            self.delay = ((T >= 4 and self.min_ctas == 1) if delay is None else bool(delay)) and row_warps > 1
            self.delay = self.delay and not self.chunk
            # late_conv: the conv_hist stores (rank 0 of a cluster, 3 bf16 per channel per position) leave
            # at the very end, rebuilt from the start window and the inputs, instead of ahead of the
            # recurrence's first shuffles. Off: it loses (kda_cute_exp_pdl.json, B=1 tile 16: T=4 6.22 vs
            # 5.96 us, T=8 10.57 vs 9.71).
            self.late_conv = bool(late_conv)
            # group_bar (row_warps > 1, row_warps < 8): the per-position partial-sum exchange waits on a
            # named barrier of the row_warps warps that share the same columns (id 1 + column block)
            # instead of all 8 warps. On by default (profiles/h200/kda_cute_exp_pdl.json, 12 heads: B=1 T=8
            # tile 16 9.49 vs 9.71 us, B=64 T=4 tile 128 72.82 vs 73.61; B=1 T=4 5.97 vs 5.96, a tie).
            self.group_bar = (True if group_bar is None else bool(group_bar)) and 1 < row_warps < 8
            # pdl: programmatic dependent launch (kda_verify's docstring): state, conv window and parameter
            # loads before griddepcontrol.wait, lengths and activations after it
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
            # (chunk: per position, per key row r: (q P, k P, d, k), then per position the v channels)
            s_info = smem.allocate_tensor(Float32, cute.make_layout(T * 128 * (5 if self.chunk else 4)),
                                          byte_alignment=16)
            # per position, lower warps 0..3: (|q|^2, |k|^2, q.k, pad)  (chunk: value i of warp w at i * 4 + w)
            s_red = smem.allocate_tensor(Float32, cute.make_layout(self.nsum * 4 if (self.chunk or self.bpro)
                                                                   else T * 16),
                                         byte_alignment=16)
            # per position, the tile's unnormalized outputs
            s_o = smem.allocate_tensor(Float32, cute.make_layout(T * TV), byte_alignment=16)
            # row blocks' partial column sums (k^T d S | q^T d S), two position buffers
            # (chunk: one exchange of every position's sums, WR x nacc / 4 x TV)
            s_part = smem.allocate_tensor(Float32, cute.make_layout(WR * (self.nacc // 4) * TV if self.chunk
                                                                     else 2 * WR * 2 * TV), byte_alignment=16)
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
            # late_conv: the start windows, kept to rebuild every position's window at the end
            win0 = cute.make_rmem_tensor((2, 3) if self.late_conv else (1, 1), p_qkv.dtype)
            if cutlass.const_expr(self.late_conv):
                for i in cutlass.range_constexpr(3):
                    win0[0, i] = win1[i]
                    win0[1, i] = win2[i]  # (upper threads: unused)

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

            if cutlass.const_expr(not (self.chunk or self.bpro)):
                # ---- prologue of ALL positions (independent of the state): conv + silu, gate, norms ---
                for t in cutlass.range_constexpr(T):
                    bt = bb * T + t
                    active = Int32(1)
                    if cutlass.const_expr(self.ragged):
                        active = Int32(0)
                        if t < L:
                            active = Int32(1)
                    prologue_position(x1[t], x2[t], f_r[t], win1, win2, w1, w2, a_exp, dtb, self.lb, lower, lane,
                                      warp, c, s_info, t * 512 + c * 4, s_red, t * 16, False, None, 0, self.fast)
                    # conv_hist[b, t] (rank 0 of a cluster writes it)
                    wconv = active
                    if cutlass.const_expr(NC > 1):  # noqa: SIM102 (DSL: nested dynamic ifs)
                        if rank != 0:
                            wconv = Int32(0)
                    if cutlass.const_expr(self.late_conv):
                        wconv = Int32(0)
                    if wconv > 0:
                        for i in cutlass.range_constexpr(3):
                            ch_g[(bt * C + ch1) * 3 + i] = win1[i]
                        if lower:
                            for i in cutlass.range_constexpr(3):
                                ch_g[(bt * C + ch2) * 3 + i] = win2[i]

            else:
                # the batched prologue (bpro, and chunk): every position in one branch per half, so the
                # positions' conv, silu and decay interleave, and the warp sums of all positions meet in one
                # butterfly reduce-scatter (value i of lower warp w lands in s_red[i * 4 + w]). Lower thread
                # c: conv + silu of the q and k channels of key row c for every position; bpro: (q, k) into
                # s_info[.. + 0, 1] and the sums |q_t|^2, |k_t|^2, q_t.k_t; chunk (see the `chunk` knob): the
                # decay of row c too, its cumulative products, (q P_t, k P_t, d_t, k) into s_info, and for
                # j < t the decayed k_t.k_j and q_t.k_j as well. Upper thread c: conv + silu of the v channel
                # c (bpro: and the decay of row c, into s_info[.. + 2, 3]; chunk: v after the rows' block).
                # conv_hist[b, t] is written by rank 0 of a cluster, for positions t < L
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
                    y1[t] = conv_silu(win1, x1[t], w1, self.fast)
                    if whist[t] > 0:
                        for i in cutlass.range_constexpr(3):
                            ch_g[((bb * T + t) * C + ch1) * 3 + i] = win1[i]
                if lower:
                    y2 = cute.make_rmem_tensor((T,), Float32)
                    dk = cute.make_rmem_tensor((T if self.chunk else 1,), Float32)
                    for t in cutlass.range_constexpr(T):
                        y2[t] = conv_silu(win2, x2[t], w2, self.fast)
                        if cutlass.const_expr(self.chunk):
                            dk[t] = expf(self.lb * sigmoid(a_exp * (f_r[t].to(Float32) + dtb), self.fast),
                                         self.fast)
                        if whist[t] > 0:
                            for i in cutlass.range_constexpr(3):
                                ch_g[((bb * T + t) * C + ch2) * 3 + i] = win2[i]
                    # per position: (q P_t, k P_t, d_t, k) of row c, P_t = d_0 ... d_t (raw q, k: the
                    # l2norm factors are applied to the reduced sums)
                    if cutlass.const_expr(self.chunk):
                        pc = Float32(1.0)
                        for t in cutlass.range_constexpr(T):
                            pc = pc * dk[t]
                            s_info[t * 512 + c * 4 + 0] = y1[t] * pc
                            s_info[t * 512 + c * 4 + 1] = y2[t] * pc
                            s_info[t * 512 + c * 4 + 2] = dk[t]
                            s_info[t * 512 + c * 4 + 3] = y2[t]
                    else:
                        for t in cutlass.range_constexpr(T):
                            s_info[t * 512 + c * 4 + 0] = y1[t]
                            s_info[t * 512 + c * 4 + 1] = y2[t]
                    vals = []
                    for t in cutlass.range_constexpr(T):
                        vals += [y1[t] * y1[t], y2[t] * y2[t], y1[t] * y2[t]]
                    if cutlass.const_expr(self.chunk):
                        for t in cutlass.range_constexpr(1, T):
                            gd = Float32(1.0)
                            for m in cutlass.range_constexpr(t):
                                jj = t - 1 - m
                                gd = gd * dk[jj + 1]   # G[t, jj] = d_{jj+1} ... d_t (self.pair's order)
                                vals += [y2[t] * gd * y2[jj], y1[t] * gd * y2[jj]]
                    vals += [Float32(0.0)] * (self.nsum - len(vals))
                    kept, start = reduce_scatter(vals, lane, (16, 8, 4, 2, 1))
                    for i in cutlass.range_constexpr(len(kept)):
                        s_red[(start + i) * 4 + warp] = kept[i]
                else:
                    for t in cutlass.range_constexpr(T):
                        if cutlass.const_expr(self.chunk):
                            s_info[T * 512 + t * 128 + c] = y1[t]   # v_c
                        else:
                            s_info[t * 512 + c * 4 + 2] = expf(
                                self.lb * sigmoid(a_exp * (f_r[t].to(Float32) + dtb), self.fast), self.fast)
                            s_info[t * 512 + c * 4 + 3] = y1[t]
            cute.arch.sync_threads()  # the only CTA barrier before the epilogue

            if cutlass.const_expr(not self.chunk):
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
                        rq = rsqrtf(red4(s_red, 3 * t, r_c) + _L2_EPS, self.fast)
                        rk = rsqrtf(red4(s_red, 3 * t + 1, r_c) + _L2_EPS, self.fast)
                        dot = red4(s_red, 3 * t + 2, r_c)
                    else:
                        rq, rk, dot = position_norms(s_red, t * 16, self.fast)
                    beta = sigmoid(b_r[t].to(Float32), self.fast)
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
                    bt = bb * T + t
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
                    # the row blocks' partial sums meet in shared memory (double-buffered by position:
                    # buffer t % 2 is rewritten only after every thread passed the next barrier)
                    pb = (t % 2) * (WR * 2 * TV) + wr * (2 * TV) + colw
                    if cutlass.const_expr(self.scatter):
                        # vals then holds the sums of value indices start .. start + len - 1
                        vals, start = reduce_scatter([acc_k[0], acc_k[1], acc_k[2], acc_k[3],
                                                      acc_q[0], acc_q[1], acc_q[2], acc_q[3]], lane, self.red_offs)
                        for i in cutlass.range_constexpr(len(vals)):
                            g = start + i
                            s_part[pb + (g // 4) * TV + (g % 4)] = vals[i]
                    else:
                        for si in cutlass.range_constexpr(len(self.red_offs)):
                            for j in cutlass.range_constexpr(4):
                                acc_k[j] = acc_k[j] + cute.arch.shuffle_sync_bfly(acc_k[j],
                                                                                  offset=self.red_offs[si])
                                acc_q[j] = acc_q[j] + cute.arch.shuffle_sync_bfly(acc_q[j],
                                                                                  offset=self.red_offs[si])
                        if cutlass.const_expr(WR > 1):
                            cute.autovec_copy(acc_k, vec(s_part.iterator, cute.assume(pb, divby=4), 4))
                            cute.autovec_copy(acc_q, vec(s_part.iterator, cute.assume(pb + TV, divby=4), 4))
                    if cutlass.const_expr(WR > 1):
                        if cutlass.const_expr(self.group_bar):
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
                    if cutlass.const_expr(self.delay and self.hist and t > 0):
                        # position t-1's state, held back until now
                        act_p = Int32(1)
                        if cutlass.const_expr(self.ragged):
                            act_p = Int32(0)
                            if t - 1 < L:
                                act_p = Int32(1)
                        if act_p > 0:
                            h_off = cute.assume((((bt - 1) * H + h) * D + row0) * D + col0, divby=4)
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
                    if cutlass.const_expr(not self.hist):
                        active = Int32(0)
                    if cutlass.const_expr(self.delay):
                        for i in cutlass.range_constexpr(S):
                            for j in cutlass.range_constexpr(4):
                                r_prev[j, i] = r_s[j, i]
                        if cutlass.const_expr(t == T - 1):  # noqa: SIM102 (DSL: nested dynamic ifs)
                            if active > 0:
                                h_off = cute.assume((((bt * H) + h) * D + row0) * D + col0, divby=4)
                                g_dst = cute.make_tensor(p_shist + h_off, cute.make_layout((4, S), stride=(1, R * D)))
                                cute.autovec_copy(r_s, g_dst)
                    else:
                        if active > 0:
                            h_off = cute.assume((((bt * H) + h) * D + row0) * D + col0, divby=4)
                            g_dst = cute.make_tensor(p_shist + h_off, cute.make_layout((4, S), stride=(1, R * D)))
                            cute.autovec_copy(r_s, g_dst)

            else:
                # chunk: every position's l2norm factors, beta and decayed cross terms (state-independent),
                # then ONE pass over the state: A_t = S0^T (k_t P_t) and B_t = S0^T (q_t P_t) for all t (raw
                # q, k), reduced over the row lanes and row warps in one exchange; then per column, in
                # order, u_t = beta_t (v_t - rk_t (A_t + sum_{j<t} rk_j KK[t,j] u_j)) and
                # o_t = rq_t / sqrt(D) (B_t + sum_{j<t} rk_j QK[t,j] u_j) + (q_t.k_t) u_t / sqrt(D), and the
                # state after each position by the same register update as the stepwise chain.
                r_c = cute.make_rmem_tensor((4,), Float32)
                o = cute.make_rmem_tensor((4,), Float32)
                r_p = cute.make_rmem_tensor((4,), Float32)
                c_sc = cute.make_rmem_tensor((4, T), Float32)
                c_bv = cute.make_rmem_tensor((4, T), Float32)
                c_mk = cute.make_rmem_tensor((max(1, T * (T - 1) // 2),), Float32)
                c_mq = cute.make_rmem_tensor((max(1, T * (T - 1) // 2),), Float32)
                r_v = cute.make_rmem_tensor((4,), Float32)
                for t in cutlass.range_constexpr(T):
                    rq = rsqrtf(red4(s_red, 3 * t, r_c) + _L2_EPS, self.fast)
                    rk = rsqrtf(red4(s_red, 3 * t + 1, r_c) + _L2_EPS, self.fast)
                    dot = red4(s_red, 3 * t + 2, r_c)
                    beta = sigmoid(b_r[t].to(Float32), self.fast)
                    c_sc[0, t] = beta * rk
                    c_sc[1, t] = rq * scale
                    c_sc[2, t] = dot * rq * rk * scale
                    c_sc[3, t] = rk
                    cute.autovec_copy(vec(s_info.iterator, cute.assume(T * 512 + t * 128 + col0, divby=4), 4), r_v)
                    for j in cutlass.range_constexpr(4):
                        c_bv[j, t] = beta * r_v[j]
                for t in cutlass.range_constexpr(1, T):
                    for jj in cutlass.range_constexpr(t):
                        pi = self.pair[(t, jj)]
                        c_mk[pi] = c_sc[3, jj] * red4(s_red, 3 * T + 2 * pi, r_c)
                        c_mq[pi] = c_sc[3, jj] * red4(s_red, 3 * T + 2 * pi + 1, r_c)
                # per (row, position): k P, q P (the pass); d, k rk (the updates)  (preload only)
                c_row = cute.make_rmem_tensor((4, S, T) if self.pre else (4, 1, 1), Float32)
                r_info = cute.make_rmem_tensor((4,), Float32)
                if cutlass.const_expr(self.pre):
                    for t in cutlass.range_constexpr(T):
                        for i in cutlass.range_constexpr(S):
                            ro = t * 512 + (row0 + i * R) * 4
                            cute.autovec_copy(vec(s_info.iterator, cute.assume(ro, divby=4), 4),
                                              r_info)
                            c_row[0, i, t] = r_info[1]
                            c_row[1, i, t] = r_info[0]
                            c_row[2, i, t] = r_info[2]
                            c_row[3, i, t] = r_info[3] * c_sc[3, t]
                # the pass: acc[t, 0, j] = (S0^T k_t P_t)[col j], acc[t, 1, j] = (S0^T q_t P_t)[col j]
                acc = cute.make_rmem_tensor((4, 2, T), Float32)
                acc.fill(0.0)
                for i in cutlass.range_constexpr(S):
                    for t in cutlass.range_constexpr(T):
                        if cutlass.const_expr(self.pre):
                            kp = c_row[0, i, t]
                            qp = c_row[1, i, t]
                        else:
                            ro = t * 512 + (row0 + i * R) * 4
                            cute.autovec_copy(vec(s_info.iterator, cute.assume(ro, divby=4), 4),
                                              r_info)
                            kp = r_info[1]
                            qp = r_info[0]
                        for j in cutlass.range_constexpr(4):
                            acc[j, 0, t] = acc[j, 0, t] + kp * r_s[j, i]
                            acc[j, 1, t] = acc[j, 1, t] + qp * r_s[j, i]
                # over the R row lanes (butterfly reduce-scatter), then the WR row warps (shared memory, one
                # barrier); value g = (t * 2 + kind) * 4 + j, stored at (t * 2 + kind) * TV + colw + j
                if cutlass.const_expr(WR > 1):
                    vals = []
                    for t in cutlass.range_constexpr(T):
                        for kd in cutlass.range_constexpr(2):
                            for j in cutlass.range_constexpr(4):
                                vals.append(acc[j, kd, t])
                    vals += [Float32(0.0)] * (self.nacc - len(vals))
                    kept, start = reduce_scatter(vals, lane, self.red_offs)
                    for i in cutlass.range_constexpr(len(kept)):
                        g = start + i   # (padding values land in slots nobody reads)
                        s_part[wr * (self.nacc // 4 * TV) + (g // 4) * TV + colw + (g % 4)] = kept[i]
                    if cutlass.const_expr(self.group_bar):
                        cute.arch.barrier(barrier_id=1 + wc, number_of_threads=WR * 32)
                    else:
                        cute.arch.sync_threads()
                    acc.fill(0.0)
                    for w in cutlass.range_constexpr(WR):
                        for t in cutlass.range_constexpr(T):
                            for kd in cutlass.range_constexpr(2):
                                po = w * (self.nacc // 4 * TV) + (t * 2 + kd) * TV + colw
                                cute.autovec_copy(vec(s_part.iterator, cute.assume(po, divby=4), 4), r_p)
                                for j in cutlass.range_constexpr(4):
                                    acc[j, kd, t] = acc[j, kd, t] + r_p[j]
                else:
                    for si in cutlass.range_constexpr(len(self.red_offs)):
                        for t in cutlass.range_constexpr(T):
                            for kd in cutlass.range_constexpr(2):
                                for j in cutlass.range_constexpr(4):
                                    acc[j, kd, t] = acc[j, kd, t] + cute.arch.shuffle_sync_bfly(
                                        acc[j, kd, t], offset=self.red_offs[si])
                # the small triangular solve, column by column, and the outputs
                uu = cute.make_rmem_tensor((4, T), Float32)
                for t in cutlass.range_constexpr(T):
                    for j in cutlass.range_constexpr(4):
                        wv = acc[j, 0, t]
                        zv = acc[j, 1, t]
                        for jj in cutlass.range_constexpr(t):
                            pi = self.pair[(t, jj)]
                            wv = wv + c_mk[pi] * uu[j, jj]
                            zv = zv + c_mq[pi] * uu[j, jj]
                        uu[j, t] = c_bv[j, t] - c_sc[0, t] * wv
                        o[j] = c_sc[1, t] * zv + c_sc[2, t] * uu[j, t]
                    cute.autovec_copy(o, vec(s_o.iterator, cute.assume(t * TV + colw, divby=4), 4))
                # the state after each position: S_t = diag(d_t) S_{t-1} + k_t u_t^T, stored as it forms
                for t in cutlass.range_constexpr(T):
                    bt = bb * T + t
                    for i in cutlass.range_constexpr(S):
                        if cutlass.const_expr(self.pre):
                            dr = c_row[2, i, t]
                            kr = c_row[3, i, t]
                        else:
                            ro = t * 512 + (row0 + i * R) * 4
                            cute.autovec_copy(vec(s_info.iterator, cute.assume(ro, divby=4), 4),
                                              r_info)
                            dr = r_info[2]
                            kr = r_info[3] * c_sc[3, t]
                        for j in cutlass.range_constexpr(4):
                            r_s[j, i] = dr * r_s[j, i] + kr * uu[j, t]
                    active = Int32(1)
                    if cutlass.const_expr(self.ragged):
                        active = Int32(0)
                        if t < L:
                            active = Int32(1)
                    if cutlass.const_expr(not self.hist):
                        active = Int32(0)
                    if active > 0:
                        h_off = cute.assume((((bt * H) + h) * D + row0) * D + col0, divby=4)
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
                    inv = rsqrtf(ss_r[t] * (1.0 / D) + self.eps, self.fast)
                    r_out = cute.make_rmem_tensor((E,), p_out.dtype)
                    for j in cutlass.range_constexpr(E):
                        val = (r_o[j, t] * inv * r_onw_raw[j].to(Float32)
                               * sigmoid(gate_r[j, t].to(Float32), self.fast))
                        r_out[j] = val.to(p_out.dtype)
                    if cutlass.const_expr(EL < 32):  # noqa: SIM102 (DSL: nested dynamic ifs)
                        if lane >= EL:
                            active = Int32(0)
                    if active > 0:
                        o_off = cute.assume((bb * T + t) * HD + h * D + e0, divby=E)
                        cute.autovec_copy(r_out, vec(p_out, o_off, E))

            if cutlass.const_expr(self.late_conv):
                # window after position t = seq[t + 1 .. t + 3], seq = start window (3) then x_0 .. x_{T-1}
                for t in cutlass.range_constexpr(T):
                    bt = bb * T + t
                    wconv = Int32(1)
                    if cutlass.const_expr(self.ragged):
                        wconv = Int32(0)
                        if t < L:
                            wconv = Int32(1)
                    if cutlass.const_expr(NC > 1):  # noqa: SIM102 (DSL: nested dynamic ifs)
                        if rank != 0:
                            wconv = Int32(0)
                    if wconv > 0:
                        for i in cutlass.range_constexpr(3):
                            k = t + 1 + i
                            ch_g[(bt * C + ch1) * 3 + i] = win0[0, k] if k < 3 else x1[k - 3]
                        if lower:
                            for i in cutlass.range_constexpr(3):
                                k = t + 1 + i
                                ch_g[(bt * C + ch2) * 3 + i] = win0[1, k] if k < 3 else x2[k - 3]

    _COLUMNS_CLS = KDAVerifyColumns
    return KDAVerifyColumns


def kda_verify(qkv, f, b, gate, params, state, conv_state, out, state_hist, conv_hist,
               lengths=None, tile_v: int = 128, layout: str = "columns", row_warps: int | None = None,
               pdl: bool = False):
    """T positions per sequence (speculative verification), state kept on chip across positions.
    qkv [B,T,3HD], f [B,T,HD], b [B,T,H], gate [B,T,HD] bf16; writes out [B,T,HD] bf16,
    state_hist [B,T,H,128,128] fp32 (state after each position), conv_hist [B,T,3HD,3] bf16.
    `state`/`conv_state` are not modified. lengths [B] int32 in 1..T: positions >= lengths[b] are
    not computed and their out/hist entries are left untouched. layout: "columns" (this file's
    generator, the default) or "rows" (kda_decode.py's generator, the baseline). row_warps (columns
    layout only): how many of the 8 warps split the key rows, 1, 2, 4 or 8; None takes ROW_WARPS[tile_v].
    pdl=True: programmatic dependent launch, as in kda_decode (state and conv window loaded before the
    wait for the previous kernel; that kernel must not write this call's `state` or `conv_state`, e.g. a
    commit of the same sequences directly before). Returns `out`."""
    if not isinstance(pdl, bool):
        raise TypeError(f"kda cute verify: pdl must be a bool (got {pdl!r})")
    if layout not in LAYOUTS:
        raise ValueError(f"kda cute verify: layout must be one of {LAYOUTS} (got {layout!r})")
    if layout == "rows" and row_warps is not None:
        raise ValueError("kda cute verify: row_warps applies to layout='columns' only")
    if row_warps is not None and row_warps not in (1, 2, 4, 8):
        raise ValueError(f"kda cute verify: row_warps must be 1, 2, 4 or 8 (got {row_warps!r})")
    if layout == "columns" and row_warps is not None and row_warps not in ROW_WARPS_ALLOWED.get(tile_v, (row_warps,)):
        raise ValueError(f"kda cute verify: row_warps must be one of {ROW_WARPS_ALLOWED[tile_v]} at "
                         f"tile_v={tile_v} (got {row_warps})")
    if not isinstance(qkv, torch.Tensor) or qkv.dim() != 3:
        raise ValueError("kda cute verify: qkv must be [B, T, 3HD]")
    T = qkv.shape[1]
    if not 1 <= T <= 16:
        raise NotImplementedError(f"kda cute verify: T must be in 1..16 (got {T})")
    B, H = _validate(qkv, f, b, gate, params, state, conv_state, out, tile_v, T)
    dev = qkv.device
    C = 3 * H * _D
    _check("state_hist", state_hist, (B, T, H, _D, _D), _F32, dev)
    _check("conv_hist", conv_hist, (B, T, C, _W - 1), _BF16, dev)
    if state_hist.numel() >= 2**31:
        raise NotImplementedError("kda cute verify: state_hist too large for 32-bit indexing")
    if lengths is not None:
        _check("lengths", lengths, (B,), (torch.int32,), dev)
    if layout == "columns" and row_warps is None:
        row_warps = ROW_WARPS[tile_v]
    knobs = {"pdl": True} if pdl else {}
    _launch(qkv, f, b, gate, params, state, conv_state, out, state_hist, conv_hist, lengths, tile_v, layout,
            row_warps, **knobs)
    return out


def _launch(qkv, f, b, gate, params, state, conv_state, out, state_hist, conv_hist, lengths, tile_v, layout,
            row_warps, hist: bool = True, **knobs):
    """Compile (once per shape) and launch on the current stream; arguments already validated.
    hist=False (column layout only) skips the state_hist stores: kernels/cute/check_kda.py uses it to
    measure what the stores cost, nothing else should. knobs (column layout; measurement only): preload,
    scatter, delay, late_conv, group_bar, fast, bpro, chunk = True/False force the generator's choices (see
    KDAVerifyColumns); pdl (both layouts) is kda_verify's switch."""
    B, T = qkv.shape[:2]
    H = params.heads
    dev = qkv.device
    ragged = lengths is not None
    args = _kernel_args(qkv, f, b, gate, params, state, conv_state, out, state_hist, conv_hist, lengths)
    key = (("verify", layout, row_warps, hist, tuple(sorted(knobs.items())), B, H, T, ragged, tile_v, dev.index)
           + _params_key(params))
    if layout == "columns":
        def cls():
            return functools.partial(_columns_class(), row_warps=row_warps, hist=hist, **knobs)
    else:
        if set(knobs) - {"pdl"}:
            raise ValueError(f"kda cute verify: layout='rows' takes only the pdl knob (got {sorted(knobs)})")

        def cls():
            return functools.partial(_kernel_class(), **knobs)
    with torch.cuda.device(dev):
        stream = _stream(dev)
        fn = _get_compiled(key, B, H, T, True, ragged, params, args + [stream], tile_v, cls)
        fn(*args, stream)
