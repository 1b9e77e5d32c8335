"""Latent-MoE routed experts of several tokens in CuTe DSL, MXFP4 weights on tensor cores (mma.sync m16n8k16, f16
operands, fp32 accumulation): the token x top-k pairs grouped by expert on the device, so each chosen expert's weights
are read once however many tokens chose it; two launches, the second accumulating into y with fp32 atomics.

    act[q, i] = 2^6 wk[q] situ(W1_e z_b, W3_e z_b)[i]     pair q = b K + k, e = idx[b, k]   (f16 pairs)
    y[b, l]   = sum over b's pairs q of  sum_i W2_e[l, i] act[q, i] 2^-6                      (fp32)

Why no shared memory for the weights: the kernel layout (k3lab.mxfp4.to_kernel_layout) is the MMA's fragment layout.
Word t of a row's 32-block decodes (k3lab_kernels.mxfp4_ptx.decode_ptx, 7 integer operations) into four f16x2 parts
of e2m1 * 2^-14 for the block's activation pairs t, 4 + t, 8 + t, 12 + t, which are the pairs lane (g, t) of an
m16n8k16 A fragment holds for the block's two k-steps (parts 0, 1: k-step 0; parts 2, 3: k-step 1), and likewise a
B fragment's. So a lane loads one word a row a block straight into fragment registers; each block's two MMAs go into
a zeroed fragment that is then added times the block factor 2^(s - 119) (s the E8M0 scale; 2^-14 of the decode and
2^6 of the activations undone) into the fp32 accumulators.

  up    a CTA (4 warps) per (pair p, UP_ROWS = 64 intermediate rows). Every CTA zeroes its share of y. Then it lists p's
        group: the pairs with p's expert id, ascending, by ballots over the [B K] ids (`group`); only the group's
        leader (its first pair) goes on. Members are taken NMEM (8, the MMA's N) at a time: their z rows
        staged in shared memory as f16 pairs of 2^6 z, each 32-block's 16 pairs lane-major (a lane's B fragment of a
        block one 16-byte read); warp w's MMA rows g and g + 8 are intermediate rows r0 + 16 w + 2 g and
        + 2 g + 1 of W1_e and of W3_e, so a lane ends with both rows of one f16 pair of act; SiTU, times 2^6 wk,
        stored into each member's act row (an MMA column past the tile's last member redoes member 0, never
        stored). The block factors come from scale words biased once (`fexp`).
        Few pairs (B K <= FEW_PAIRS): FEW_UP_SPLIT warps share a 16-row tile, warp w over part w % FEW_UP_SPLIT of
        L, their accumulators summed through shared memory into the tile's first warp (more, smaller CTAs).
        Few groups (a group of at least SHARE_FROM members, e.g. every token on the same 16 experts): the members'
        CTAs, which would exit, share the leader's units (member tile, share of the block's 16-row tiles): h <=
        UP_SHARE shares, a unit's tiles 4 / h, each over h warps' parts of L summed as above; member of rank r runs
        units r, r + count, ... (at batch 8 on 16 experts: 16 x 6 x 4 busy CTAs instead of 16 x 6 leaders). With
        UP_LSPLIT (up to SHARE_LARGE_PAIRS pairs) a share is instead a part of L: every tile of the block (a warp a
        tile) over L's part r, only that part of z staged, the h parts' sums through a global workspace, added in
        rank order by the CTA whose ticket (an int32 per member tile and row block, zero between calls) comes last.
  down  a CTA per (pair p, 64 DOWN_TILES latent rows), PDL after up (it waits for up before reading anything); the
        same group listing, the leader only. Warp w runs DOWN_TILES tiles (FEW_DOWN_TILES for few pairs) of 16
        latent rows: the members' act words are the B fragments (loaded once a member tile), every block of I's W2
        words straight into A fragments (16-byte loads of four blocks with w2_quad; the next tile's words loaded
        while this one computes); each
        tile's 16 x 8 outputs added into y[b, l] with fp32 atomics (so the order of a token's terms is not fixed).
        A group of at least SHARE_FROM members shares likewise: h <= DOWN_SHARE shares of each warp's tiles (tiles
        r', r' + h, ...), and its member tiles, over its members' CTAs. Registers held to 128 (DOWN_CTAS_PER_SM).

Layout: z [B, L] bf16 (read as int32 pairs); idx [B, K] int32 or int64 (the low word read); wk [B, K] fp32; w1, w3
[E, I, L/8] and w2 [E, L, I/8] int32 kernel-layout words, w1 and w3 quad-transposed (w2 too with w2_quad, where
I % 128 == 0: a down lane's words of four blocks in one 16-byte load where it made four 4-byte loads)
(k3lab.mxfp4.quad_transpose: a lane's word of four consecutive blocks in one 16-byte load; ncu at batch 64 uniform
had the up kernel's L1 at 90 % of its throughput with a 4-byte load a lane a block, 8 rows a warp instruction); s1,
s3 [E, I, L/32] and s2 [E, L, I/32] uint8 E8M0 scales (read as the stack's 32-bit words, byte n in word n // 4); y
[B, L] fp32 (zeroed by up, accumulated by down); a workspace act [B K, I/2] int32 (cached per device and shape: make
the first call outside a CUDA graph capture). Needs L a multiple of 64 DOWN_TILES (64 FEW_DOWN_TILES for few pairs)
and of 128 times the up split; I of 64; B K <= MAX_PAIRS.
Exactness and tolerance: the decoded weights are exact (fp16 subnormals included) for s in 0..246 (up forms a step's
block factors from scale words with 8 added to each byte once, `fexp`: two operations a factor where `fbits` takes
three); the activations
are f16 of 2^6 z and of 2^6 wk situ (the simt path's scaling: exact for 2^-20 <= |z| < 1023); products and sums in the
MMA's fp32; the registry's MXFP4 tolerance (k3lab.ops.moe.TOL).

Floor (k3lab.ops.moe.experts_bytes): the chosen experts' codes and scales at the read bandwidth (TP8, batch 64
uniform: ~610 experts x 2.19 MB, ~290 us on the H200). Contract: moe_grouped(z, idx, wk, w1, w3, w2, s1, s3, s2, y, *,
b1, b2, pdl=None, w2_quad=False) -> y on torch's current stream; pdl=True: `up` waits for the kernel before
(griddepcontrol.wait) before its first access; None or False: `up` launches plainly, also inside the step's pdl
chain (launched early, its thousands of waiting CTAs slowed the batch-64 step: experiments/step_pdl, docs/NOTES_moe.md,
twenty-sixth session). Arguments are checked by name (MoEGroupedError); the component (k3lab.components.moe.experts,
backend "cute", path "grouped") passes the kernel layout, W2 quad-transposed where I % 128 == 0.
"""
import types
from typing import Any

import torch

from ..mxfp4_ptx import decode_ptx
from .moe_experts import MoECuteError as MoEGroupedError  # one error class for the CuTe experts' arguments
from .moe_experts import experts_tensors

_THREADS = 128
UP_ROWS = 64        # intermediate rows of W1 and of W3 an up CTA (16 MMA rows a warp)
DOWN_TILES = 8      # tiles of 16 latent rows a warp of the down kernel (a CTA: 64 DOWN_TILES = 512 rows)
NMEM = 8            # members a tile (the MMA's N)
UP_UNROLL = 8       # blocks of L an up step (their 32 weight words and 8 scale words loaded together; a multiple
                    # of 4: 4 / 16 / 28 measured slower, docs/NOTES_moe.md)
MAX_PAIRS = 4096
# Few pairs (few groups): more, smaller CTAs so that every SM has warps in flight. Up: FEW_UP_SPLIT warps share a
# 16-row tile, each over 1/FEW_UP_SPLIT of L, summed through shared memory; down: FEW_DOWN_TILES tiles a warp.
FEW_PAIRS = 32      # batch x top-k at most this: the few-pairs shape (batch 2 at top-16)
FEW_UP_SPLIT = 2
FEW_DOWN_TILES = 1
# Few groups (every token on the same experts): a group of at least SHARE_FROM members shares its leader's work among
# its members' CTAs, which would otherwise exit: up, UP_SHARE CTAs at most split a row block's 16-row tiles (their
# warps splitting L among the more of them per tile); down, DOWN_SHARE CTAs at most split each warp's tiles; and the
# member tiles of a group larger than one tile (NMEM members) go to different CTAs. 1 turns a kernel's
# sharing off.
UP_SHARE = 4
UP_SHARE_LARGE = 2     # UP_SHARE above SHARE_LARGE_PAIRS pairs (batch 16 and up at top-16)
# up shares by parts of L (UP_LSPLIT): each of a member tile's h CTAs runs all of the row block's 16-row tiles (a warp
# a tile) over its part rank of L, staging only that part of z; the parts' sums go through a global workspace and
# the CTA whose ticket comes last adds them in rank order (deterministic) and stores act. False: each CTA runs 4 / h
# of the tiles over all of L, its warps over parts of L summed in shared memory (every CTA stages all of z). "auto":
# on up to SHARE_LARGE_PAIRS pairs (the shares of 4). H100 (docs/NOTES_moe.md, fifty-ninth session): ahead at batch 8
# same16, level at uniform batch 16 (batch 64: only the sixtieth session's chunked form was timed on against off,
# level).
# Staging z a chunk at a time under it (so that shared memory held four CTAs an SM, not three), the up kernel's
# registers capped to four or five CTAs an SM, and shares of 8 were level or slower (docs/NOTES_moe.md, sixtieth
# session; code in git history at 37d2bf7).
UP_LSPLIT = "auto"
SHARE_LARGE_PAIRS = 128
DOWN_SHARE = 4
SHARE_FROM = 4
DOWN_CTAS_PER_SM = 4  # the down kernel's registers held to four CTAs an SM (128 a thread; not in the few-pairs shape)
# Requesting a unit's weights into L2 at its start (UP_L2 / DOWN_L2) was timed and lost (slower at batch 8-64,
# uniform and same16, on an H100: profiles/h100-80gb-hbm3/moe_grouped_l2_variants.json.gz, retired for room:
# git history at ed41b45; docs/NOTES_moe.md); git history has the requests too.

MMA_F16_PTX = ("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {$0, $1, $2, $3}, {$4, $5, $6, $7}, {$8, $9}, "
               "{$10, $11, $12, $13};")
# one kernel-layout word ($4) -> its four f16x2 parts ($0..$3)
DECODE_PTX = "\n".join(["{", ".reg .b32 t, d0, d1, d2, d3;"] + decode_ptx("$4")
                       + [f"mov.b32 ${p}, d{p};" for p in range(4)] + ["}"])

__all__ = ["MAX_PAIRS", "MoEGroupedError", "moe_grouped", "supports"]

_KERNEL_CLS = None
# the device helpers the kernels below are written with, for the grouped bf16 / fp8 twins (kernels/cute/moe_dense.py):
# set by _kernel_classes()
DEVICE_OPS = None


def _kernel_classes():
    """The two kernels' generators (built once; importing this module never needs cutlass)."""
    global _KERNEL_CLS, DEVICE_OPS
    if _KERNEL_CLS is not None:
        return _KERNEL_CLS
    import cuda.bindings.driver as cuda
    import cutlass
    from cutlass import Float32, Int32, cute
    from cutlass._mlir.dialects import llvm as _llvm
    from cutlass.cutlass_dsl import dsl_user_op

    from .moe_experts import PACK_PTX, TO_F16_PTX

    def vec(ptr, off, n):
        return cute.make_tensor(ptr + off, cute.make_layout(n))

    def _asm(res, ops, text, cons, loc, ip):
        return _llvm.inline_asm(res, ops, text, cons, has_side_effects=False, is_align_stack=False,
                                asm_dialect=_llvm.AsmDialect.AD_ATT, loc=loc, ip=ip)

    @dsl_user_op
    def mma(a0, a1, a2, a3, b0, b1, c0, c1, c2, c3, *, loc=None, ip=None):
        """One m16n8k16 f16 MMA with fp32 accumulation: (d0..d3) = A B + C (the PTX fragment layouts)."""
        ops = ([Int32(x).ir_value(loc=loc, ip=ip) for x in (a0, a1, a2, a3, b0, b1)]
               + [Float32(x).ir_value(loc=loc, ip=ip) for x in (c0, c1, c2, c3)])
        res = _asm(_llvm.StructType.get_literal([Float32.mlir_type] * 4), ops, MMA_F16_PTX,
                   "=f,=f,=f,=f,r,r,r,r,r,r,f,f,f,f", loc, ip)
        return [Float32(_llvm.extractvalue(Float32.mlir_type, res, [i], loc=loc, ip=ip)) for i in range(4)]

    @dsl_user_op
    def decode(w, *, loc=None, ip=None):
        """A kernel-layout word -> its four f16x2 parts (e2m1 * 2^-14 of the block's pairs t, 4+t, 8+t, 12+t)."""
        res = _asm(_llvm.StructType.get_literal([Int32.mlir_type] * 4), [Int32(w).ir_value(loc=loc, ip=ip)],
                   DECODE_PTX, "=r,=r,=r,=r,r", loc, ip)
        return [Int32(_llvm.extractvalue(Int32.mlir_type, res, [i], loc=loc, ip=ip)) for i in range(4)]

    @dsl_user_op
    def to_f16x2(x, *, loc=None, ip=None):
        return Int32(_asm(Int32.mlir_type, [Int32(x).ir_value(loc=loc, ip=ip)], TO_F16_PTX, "=r,r", loc, ip))

    @dsl_user_op
    def pack_f16x2(hi, lo, *, loc=None, ip=None):
        return Int32(_asm(Int32.mlir_type, [Float32(hi).ir_value(loc=loc, ip=ip), Float32(lo).ir_value(loc=loc, ip=ip)],
                          PACK_PTX, "=r,f,f", loc, ip))

    def ids():
        """(thread, CTA, lane, warp, g = lane / 4, t = lane % 4) of a one-dimensional launch."""
        tid, _, _ = cute.arch.thread_idx()
        c, _, _ = cute.arch.block_idx()
        lane = tid % 32
        return tid, c, lane, tid // 32, lane // 4, lane % 4

    def fbits(w, sh):
        """The block factor 2^(s - 119) (fp32) of the scale byte at bit sh of word w."""
        return Int32((((w >> sh) & 0xFF) + 8) << 23).bitcast(Float32)

    def biased(w):
        """A scale word with 8 added to each of its four bytes (no carry for s <= 247; s >= 247 is already out of
        the factor's range, module docstring)."""
        return w + 0x08080808

    def fexp(wb, k: int):
        """The block factor 2^(s - 119) of byte k of a biased scale word: its byte moved into the exponent field in
        one shift and one mask (two operations where fbits takes three)."""
        sh = 23 - 8 * k
        return Int32(((wb << sh) if sh > 0 else (wb >> -sh)) & 0x7F800000).bitcast(Float32)

    def load_step(p_w1, p_w3, p_s1, p_s3, ra, t, j0, dst, UJ: int, SW: int, NB: int, RW: int):
        """An up step's loads into dst: the lane's words of blocks j0 .. j0 + UJ - 1 of rows ra, ra + 1 of W1 and of
        W3 (quad-transposed words, one 16-byte load per four blocks; j0 and UJ multiples of 4), then their scale
        words (SW a row: one per four blocks where aligned, else one a block)."""
        for m in range(2):
            for h in range(2):
                row = ra + h
                for q in range(UJ // 4):
                    four = cute.make_rmem_tensor((4,), Int32)
                    off = cute.assume(row * RW + 4 * (j0 + 4 * q) + 4 * t, divby=4)
                    cute.autovec_copy(vec(p_w1 if m == 0 else p_w3, off, 4), four)
                    for u in range(4):
                        dst[(2 * m + h) * UJ + 4 * q + u] = four[u]
                for k in range(SW):
                    n = (row * NB + j0) // 4 + k if SW < UJ else (row * NB + j0 + k) // 4
                    dst[4 * UJ + (2 * m + h) * SW + k] = vec(p_s1 if m == 0 else p_s3, n, 1)[0]

    def load_down(p_w2, p_s2, ra, t, dst, NB: int, RW: int, QUAD: bool = False):
        """A down tile's loads into dst: the lane's W2 words of rows ra, ra + 8 (NB blocks each; QUAD: W2
        quad-transposed, four blocks' words in one 16-byte load), then their scale words (NB / 4 a row where
        NB % 4 == 0, else one a block)."""
        SD = NB // 4 if NB % 4 == 0 else NB
        for h in range(2):
            row = ra + 8 * h
            if QUAD:
                for q in range(NB // 4):
                    four = cute.make_rmem_tensor((4,), Int32)
                    cute.autovec_copy(vec(p_w2, cute.assume(row * RW + 16 * q + 4 * t, divby=4), 4), four)
                    for u in range(4):
                        dst[h * NB + 4 * q + u] = four[u]
            else:
                for j in range(NB):
                    dst[h * NB + j] = vec(p_w2, row * RW + 4 * j + t, 1)[0]
            for k in range(SD):
                dst[2 * NB + h * SD + k] = vec(p_s2, (row * NB) // 4 + k if SD < NB else (row * NB + k) // 4, 1)[0]

    def down_factors(src, row, h, NB: int):
        """The NB block factors of row (the tile's row h) from the scale words load_down left in src."""
        SD = NB // 4 if NB % 4 == 0 else NB
        base = 2 * NB + h * SD
        if SD < NB:
            return [fbits(src[base + j // 4], 8 * (j % 4)) for j in range(NB)]
        return [fbits(src[base + j], ((row * NB + j) % 4) * 8) for j in range(NB)]

    def step_factors(src, m, h, ra, j0, UJ: int, SW: int, NB: int):
        """The UJ block factors of row ra + h of matrix m (W1, W3) from a step's scale words."""
        base = 4 * UJ + (2 * m + h) * SW
        if SW < UJ:
            ws = [biased(src[base + k]) for k in range(SW)]
            return [fexp(ws[u // 4], u % 4) for u in range(UJ)]
        return [fbits(src[base + u], ((ra + h) * NB + j0 + u) % 4 * 8) for u in range(UJ)]

    def sigmoid(x):
        return 1.0 / (1.0 + cute.math.exp(-x))

    def tanh(x):
        return 2.0 * sigmoid(2.0 * x) - 1.0

    def WC(RND: int) -> int:
        """Where `group` leaves the group's size in s_wc."""
        return 2 * RND * 4 + 1

    @cute.jit
    def group(p_idx: cute.Pointer, e: Int32, tid: Int32, lane: Int32, warp: Int32, s_mem: cute.Tensor,
              s_wc: cute.Tensor, N: cutlass.Constexpr, step: cutlass.Constexpr):
        """s_mem[0 .. n) = the pairs whose id is e, ascending; s_wc[WC(RND)] = n (RND = rounds of 128 pairs;
        s_wc holds the 4 RND counts of (round, warp), then their exclusive offsets and the total). The ids are all
        loaded before the ballots; every thread sums its own offset from the counts (no serial pass). Three barriers;
        every thread of the CTA takes part."""
        RND = (N + _THREADS - 1) // _THREADS
        C = RND * 4                      # counts at s_wc[0 .. C), offsets at s_wc[C + 1 .. 2 C], the total at 2 C + 1
        ids_r = cute.make_rmem_tensor((RND,), Int32)
        for r in cutlass.range_constexpr(RND):
            q = r * _THREADS + tid
            ids_r[r] = Int32(-1)
            if q < N:
                ids_r[r] = vec(p_idx, q * step, 1)[0]
        bals = cute.make_rmem_tensor((RND,), Int32)
        for r in cutlass.range_constexpr(RND):
            b = cute.arch.vote_ballot_sync(ids_r[r] == e)
            bals[r] = b
            if lane == 0:
                s_wc[r * 4 + warp] = cute.arch.popc(b)
        cute.arch.sync_threads()
        if tid < C:                      # thread i: the offset of count i; the last thread also the total
            run = Int32(0)
            for i in cutlass.range_constexpr(C):
                if i < tid:
                    run = run + s_wc[i]
            s_wc[C + 1 + tid] = run
            if tid == C - 1:
                s_wc[2 * C + 1] = run + s_wc[C - 1]
        cute.arch.sync_threads()
        below = (Int32(1) << lane) - 1
        for r in cutlass.range_constexpr(RND):
            if ids_r[r] == e:
                s_mem[s_wc[C + 1 + r * 4 + warp] + cute.arch.popc(bals[r] & below)] = r * _THREADS + tid
        cute.arch.sync_threads()

    @cute.jit
    def share_units(p: Int32, cnt: Int32, n_mt: Int32, tid: Int32, s_mem: cute.Tensor, s_wc: cute.Tensor,
                    slot: cutlass.Constexpr, LOGH: cutlass.Constexpr, FROM: cutlass.Constexpr):
        """The units a CTA of pair p runs, (h, first, stride, count): units are (member tile, share), h shares a
        member tile; the leader runs all n_mt (h = 1), or, for a group of at least FROM members (H = 2^LOGH > 1),
        member `rank` runs units rank, rank + cnt, ... of n_mt h, h <= H the largest power of two <= cnt / n_mt
        (every unit has a member); a member that is not the leader runs none. The rank goes through s_wc[slot]
        (one CTA barrier, shared groups only)."""
        h = Int32(1)
        first = Int32(0)
        stride = Int32(1)
        n_units = n_mt
        if s_mem[0] != p:
            first = n_units
        if cutlass.const_expr(LOGH > 0):
            if cnt >= FROM:
                per = cnt // n_mt
                for k in cutlass.range_constexpr(1, LOGH + 1):
                    if per >= (1 << k):
                        h = Int32(1 << k)
                for i in range(tid, cnt, _THREADS):
                    if s_mem[i] == p:
                        s_wc[slot] = i
                cute.arch.sync_threads()
                first = s_wc[slot]
                stride = cnt
                n_units = n_mt * h
        return h, first, stride, n_units

    class Up:
        def __init__(self, B: int, K: int, I: int, L: int, step: int, b1: float, b2: float, pdl: bool, split: int,
                     share: int, share_from: int, lsplit: bool = False):
            self.B, self.K, self.I, self.L, self.step = B, K, I, L, step
            self.b1, self.b2, self.pdl = float(b1), float(b2), bool(pdl)
            self.N = B * K
            self.S = split               # warps a 16-row tile, each over a part of L (times a shared group's h)
            self.ROWS = UP_ROWS // split  # rows a CTA
            self.RT = I // self.ROWS
            # words between staged z rows, 16 mod 32 banks: a quarter warp's 16-byte fragment reads (members g, g + 1,
            # lanes t 0..3) then cover the 32 banks once
            self.ZP = L // 2 + (16 - L // 2) % 32
            self.RND = (self.N + _THREADS - 1) // _THREADS
            self.UJ = up_unroll(L // 32, split)
            self.NM = NMEM               # members a member tile (the MMA's N; 4, half the staged z, lost:
            # docs/NOTES_moe.md, git history at 90ac0dc)
            self.H = share               # most CTAs sharing a group's row block (1: the leader runs it alone)
            self.FROM = share_from       # a group's members from which it shares
            # a shared group's sums of S parts of L go through the staged z's words (after a barrier; at least 4 x
            # 272 words at L >= 512, which sharing needs): a separate 4 KB would take three CTAs an SM past 196 KB of
            # shared memory, leaving L1 28 KB where 60 KB were (the carveout's next step); the few-pairs shape (no
            # sharing) keeps its own buffer
            self.RED_Z = share > 1
            assert not self.RED_Z or self.NM * self.ZP >= _THREADS * 8
            self.LS = bool(lsplit) and share > 1 and split == 1  # shares by parts of L (UP_LSPLIT)

        @cute.jit
        def __call__(self, p_z: cute.Pointer, p_idx: cute.Pointer, p_wk: cute.Pointer, p_w1: cute.Pointer,
                     p_w3: cute.Pointer, p_s1: cute.Pointer, p_s3: cute.Pointer, p_act: cute.Pointer,
                     p_y: cute.Pointer, p_part: cute.Pointer, p_cnt: cute.Pointer, stream: cuda.CUstream):
            self.kernel(p_z, p_idx, p_wk, p_w1, p_w3, p_s1, p_s3, p_act, p_y, p_part, p_cnt).launch(
                grid=[self.N * self.RT, 1, 1], block=[_THREADS, 1, 1], stream=stream, use_pdl=self.pdl)

        @cute.kernel
        def kernel(self, p_z: cute.Pointer, p_idx: cute.Pointer, p_wk: cute.Pointer, p_w1: cute.Pointer,
                   p_w3: cute.Pointer, p_s1: cute.Pointer, p_s3: cute.Pointer, p_act: cute.Pointer,
                   p_y: cute.Pointer, p_part: cute.Pointer, p_cnt: cute.Pointer):
            K, I, L, N, RT, ZP = self.K, self.I, self.L, self.N, self.RT, self.ZP
            NB = L // 32
            RW = L // 8
            L16 = L // 32                # 16-word blocks of a z row (L/2 words)
            UJ = self.UJ                 # blocks of L a step (up_unroll)
            NG = NB // UJ                # steps over the whole of L; a warp's part is a run of them
            SW = UJ // 4 if NB % 4 == 0 and UJ % 4 == 0 else UJ   # scale words a row a step
            NW = 4 * UJ + 4 * SW         # a step's registers: [W1 a, W1 b, W3 a, W3 b] x UJ words, then scale words
            tid, c, lane, warp, g, t = ids()
            smem = cutlass.memory.SmemAllocator()
            s_z = smem.allocate_tensor(Int32, cute.make_layout(self.NM * ZP), byte_alignment=16)
            s_mem = smem.allocate_tensor(Int32, cute.make_layout(N), byte_alignment=16)
            s_wc = smem.allocate_tensor(Int32, cute.make_layout(WC(self.RND) + 3), byte_alignment=16)
            s_red = smem.allocate_tensor(Float32, cute.make_layout(
                _THREADS * 8 if self.S * self.H > 1 and not self.RED_Z else 1), byte_alignment=16)
            if cutlass.const_expr(self.pdl):
                cute.arch.griddepcontrol_wait()  # idx, wk and z come from the kernels before; y may be read there
            for i in range(c * _THREADS + tid, self.B * L, N * RT * _THREADS):
                vec(p_y, i, 1)[0] = Float32(0.0)
            p = c // RT
            e = vec(p_idx, p * self.step, 1)[0]
            group(p_idx, e, tid, lane, warp, s_mem, s_wc, N, self.step)
            cnt = s_wc[WC(self.RND)]
            n_mt = (cnt + self.NM - 1) // self.NM
            # the units of this row block: (member tile, share of the block's 16-row tiles)
            h, first, stride, n_units = share_units(p, cnt, n_mt, tid, s_mem, s_wc, WC(self.RND) + 1,
                                                    self.H.bit_length() - 1, self.FROM)
            S = self.S * h               # warps a tile (CTA-uniform)
            if cutlass.const_expr(self.LS):
                S = Int32(1)             # a warp a tile; the CTA's part of L is its share rank (below)
            kp = warp % S                # this warp's part of L: steps kp NG / S .. (kp + 1) NG / S - 1
            for unit in range(first, n_units, stride):
                mt = unit // h
                rr = unit - mt * h
                part = kp
                parts = S
                tile = rr * (4 // S) + warp // S
                if cutlass.const_expr(self.LS):
                    part = rr            # UP_LSPLIT: every tile, this share's part of L
                    parts = h
                    tile = warp
                jb = (part * NG) // parts * UJ
                je = ((part + 1) * NG) // parts * UJ
                r0 = (c % RT) * self.ROWS + 16 * tile
                ra = e * I + r0 + 2 * g  # this lane's two rows: MMA rows g (ra) and g + 8 (ra + 1)
                tc = cnt - mt * self.NM
                if tc > self.NM:
                    tc = Int32(self.NM)
                # the tile's z rows as f16 pairs of 2^6 z, each 32-block's 16 pairs stored lane-major: pair 4 cc + t
                # at 4 t + cc, so lane t's four B-fragment pairs of a block are one 16-byte read
                sj0 = Int32(0)           # the blocks of z staged: all of L, or (UP_LSPLIT) this share's part
                sjn = Int32(L16)
                if cutlass.const_expr(self.LS):
                    sj0 = jb
                    sjn = je - jb
                for i in range(tid, tc * sjn, _THREADS):
                    n = i // sjn
                    j = sj0 + i - n * sjn
                    b = s_mem[mt * self.NM + n] // K
                    zr = cute.make_rmem_tensor((16,), Int32)
                    cute.autovec_copy(vec(p_z, cute.assume(b * (L // 2) + 16 * j, divby=4), 16), zr)
                    zt = cute.make_rmem_tensor((16,), Int32)
                    for u in cutlass.range_constexpr(16):
                        zt[4 * (u % 4) + u // 4] = to_f16x2(zr[u])
                    cute.autovec_copy(zt, vec(s_z.iterator, cute.assume(n * ZP + 16 * j, divby=4), 16))
                cute.arch.sync_threads()
                gz = g
                if g >= tc:
                    gz = Int32(0)
                acc = cute.make_rmem_tensor((8,), Float32)   # [W1, W3] x (row a, row b) x (col 2t, 2t + 1)
                for u in cutlass.range_constexpr(8):
                    acc[u] = Float32(0.0)
                # UJ blocks a step; step j0 + UJ's words and scale words are loaded (into nxt) before step j0
                # computes (on cur), so a warp keeps a step's loads in flight while it computes
                cur = cute.make_rmem_tensor((NW,), Int32)
                nxt = cute.make_rmem_tensor((NW,), Int32)
                load_step(p_w1, p_w3, p_s1, p_s3, ra, t, jb, cur, UJ, SW, NB, RW)
                for j0 in range(jb, je, UJ):
                    # the last step loads the first again (unused)
                    load_step(p_w1, p_w3, p_s1, p_s3, ra, t, jb + (j0 - jb + UJ) % (je - jb), nxt, UJ, SW, NB, RW)
                    fs = [[step_factors(cur, m, hh, ra, j0, UJ, SW, NB) for hh in range(2)] for m in range(2)]
                    for u in cutlass.range_constexpr(UJ):
                        zb = cute.make_rmem_tensor((4,), Int32)
                        cute.autovec_copy(vec(s_z.iterator, cute.assume(gz * ZP + 16 * (j0 + u) + 4 * t, divby=4), 4),
                                          zb)
                        for m in cutlass.range_constexpr(2):
                            da = decode(cur[(2 * m) * UJ + u])
                            db = decode(cur[(2 * m + 1) * UJ + u])
                            d = mma(da[0], db[0], da[1], db[1], zb[0], zb[1], 0.0, 0.0, 0.0, 0.0)
                            d = mma(da[2], db[2], da[3], db[3], zb[2], zb[3], d[0], d[1], d[2], d[3])
                            acc[4 * m + 0] = acc[4 * m + 0] + d[0] * fs[m][0][u]
                            acc[4 * m + 1] = acc[4 * m + 1] + d[1] * fs[m][0][u]
                            acc[4 * m + 2] = acc[4 * m + 2] + d[2] * fs[m][1][u]
                            acc[4 * m + 3] = acc[4 * m + 3] + d[3] * fs[m][1][u]
                    for u in cutlass.range_constexpr(NW):
                        cur[u] = nxt[u]
                if cutlass.const_expr(self.S * self.H > 1):
                    if S > 1:            # the tile's S parts of L summed into its first warp
                        if cutlass.const_expr(self.RED_Z):  # through z's words: every warp done reading them first
                            cute.arch.sync_threads()
                            for u in cutlass.range_constexpr(8):
                                s_z[(warp * 8 + u) * 32 + lane] = acc[u].bitcast(Int32)
                        else:
                            for u in cutlass.range_constexpr(8):
                                s_red[(warp * 8 + u) * 32 + lane] = acc[u]
                        cute.arch.sync_threads()
                        if kp == 0:
                            for k in range(1, S):
                                for u in cutlass.range_constexpr(8):
                                    if cutlass.const_expr(self.RED_Z):
                                        acc[u] = acc[u] + Int32(s_z[((warp + k) * 8 + u) * 32 + lane]).bitcast(Float32)
                                    else:
                                        acc[u] = acc[u] + s_red[((warp + k) * 8 + u) * 32 + lane]
                store = kp == 0
                if cutlass.const_expr(self.LS):
                    if h > 1:            # the h parts of L joined: the CTA whose ticket comes last adds them
                        key = s_mem[mt * self.NM] * RT + c % RT   # the member tile's first pair x the row block
                        pb = ((key * self.H + rr) * 4 + warp) * 256 + lane
                        for u in cutlass.range_constexpr(8):
                            vec(p_part, pb + 32 * u, 1)[0] = acc[u]
                        cute.arch.sync_threads()
                        if tid == 0:
                            cute.arch.fence_acq_rel_gpu()
                            old = cute.arch.atomic_add(p_cnt + key, Int32(1), sem="acq_rel", scope="gpu")
                            last = Int32(0)
                            if old == h - 1:
                                last = Int32(1)
                                cute.arch.atomic_add(p_cnt + key, -h, sem="relaxed", scope="gpu")  # zero again
                            cute.arch.fence_acq_rel_gpu()
                            s_wc[WC(self.RND) + 2] = last
                        cute.arch.sync_threads()
                        store = s_wc[WC(self.RND) + 2] == 1
                        if store:
                            for u in cutlass.range_constexpr(8):
                                acc[u] = Float32(0.0)
                            for q in range(h):
                                qb = ((key * self.H + q) * 4 + warp) * 256 + lane
                                for u in cutlass.range_constexpr(8):
                                    acc[u] = acc[u] + cute.arch.load(p_part + (qb + 32 * u), Float32, sem="relaxed",
                                                                     scope="gpu")
                if store:                # the tile's first warp (every warp when S = 1) stores act
                    for col in cutlass.range_constexpr(2):
                        if 2 * t + col < tc:
                            q = s_mem[mt * self.NM + 2 * t + col]
                            wt = vec(p_wk, q, 1)[0] * 64.0
                            ga = acc[col]
                            gb = acc[2 + col]
                            ua = acc[4 + col]
                            ub = acc[6 + col]
                            aa = wt * (self.b1 * tanh(ga / self.b1) * sigmoid(ga)) * (self.b2 * tanh(ua / self.b2))
                            ab = wt * (self.b1 * tanh(gb / self.b1) * sigmoid(gb)) * (self.b2 * tanh(ub / self.b2))
                            vec(p_act, q * (I // 2) + r0 // 2 + g, 1)[0] = pack_f16x2(ab, aa)
                cute.arch.sync_threads()     # before the next unit's z (and sums) overwrite this one's
            if cutlass.const_expr(self.pdl):
                cute.arch.griddepcontrol_launch_dependents()

    class Down:
        def __init__(self, B: int, K: int, I: int, L: int, step: int, tiles: int, share: int, share_from: int,
                     quad: bool = False):
            self.B, self.K, self.I, self.L, self.step = B, K, I, L, step
            self.N = B * K
            self.QUAD = bool(quad)       # W2 quad-transposed (I / 32 % 4 == 0)
            self.DT = tiles              # tiles of 16 latent rows a warp
            self.H = share               # most CTAs sharing a group's tiles (a power of two dividing DT)
            self.FROM = share_from
            self.DR = 64 * tiles
            self.LT = L // self.DR
            self.RND = (self.N + _THREADS - 1) // _THREADS

        @cute.jit
        def __call__(self, p_idx: cute.Pointer, p_w2: cute.Pointer, p_s2: cute.Pointer, p_act: cute.Pointer,
                     p_y: cute.Pointer, stream: cuda.CUstream):
            self.kernel(p_idx, p_w2, p_s2, p_act, p_y).launch(
                grid=[self.N * self.LT, 1, 1], block=[_THREADS, 1, 1], max_number_threads=[_THREADS, 1, 1],
                min_blocks_per_mp=DOWN_CTAS_PER_SM if self.DT > 1 else 0, stream=stream, use_pdl=True)

        @cute.kernel
        def kernel(self, p_idx: cute.Pointer, p_w2: cute.Pointer, p_s2: cute.Pointer, p_act: cute.Pointer,
                   p_y: cute.Pointer):
            K, I, L, N = self.K, self.I, self.L, self.N
            NB = I // 32
            RW = I // 8
            tid, c, lane, warp, g, t = ids()
            smem = cutlass.memory.SmemAllocator()
            s_mem = smem.allocate_tensor(Int32, cute.make_layout(N), byte_alignment=16)
            s_wc = smem.allocate_tensor(Int32, cute.make_layout(WC(self.RND) + 2), byte_alignment=16)
            cute.arch.griddepcontrol_wait()  # up's act and zeroed y (and idx, from before it)
            p = c // self.LT
            l0 = (c % self.LT) * self.DR + warp * (16 * self.DT) + g
            e = vec(p_idx, p * self.step, 1)[0]
            group(p_idx, e, tid, lane, warp, s_mem, s_wc, N, self.step)
            cnt = s_wc[WC(self.RND)]
            n_mt = (cnt + NMEM - 1) // NMEM
            # the units of this CTA's rows: (member tile, share of each warp's tiles)
            h, first, stride, n_units = share_units(p, cnt, n_mt, tid, s_mem, s_wc, WC(self.RND) + 1,
                                                    self.H.bit_length() - 1, self.FROM)
            SD = NB // 4 if NB % 4 == 0 else NB
            for unit in range(first, n_units, stride):
                mt = unit // h
                rr = unit - mt * h       # this unit's tiles of each warp: rr, rr + h, ...
                tc = cnt - mt * NMEM
                if tc > NMEM:
                    tc = Int32(NMEM)
                gz = g
                if g >= tc:
                    gz = Int32(0)
                qz = s_mem[mt * NMEM + gz]
                bw = cute.make_rmem_tensor((NB * 4,), Int32)   # member gz's act pairs t, 4+t, 8+t, 12+t a block
                for j in cutlass.range_constexpr(NB):
                    for cc in cutlass.range_constexpr(4):
                        bw[4 * j + cc] = vec(p_act, qz * (I // 2) + 16 * j + 4 * cc + t, 1)[0]
                # the next tile's words are loaded (into nxt) before a tile computes (on cur)
                cur = cute.make_rmem_tensor((2 * NB + 2 * SD,), Int32)
                nxt = cute.make_rmem_tensor((2 * NB + 2 * SD,), Int32)
                load_down(p_w2, p_s2, e * L + l0 + 16 * rr, t, cur, NB, RW, self.QUAD)
                for it in cutlass.range(self.DT // h, unroll=1):
                    tile = rr + it * h
                    ra = e * L + l0 + 16 * tile  # MMA rows g (ra) and g + 8 (ra + 8)
                    acc = cute.make_rmem_tensor((4,), Float32)
                    for u in cutlass.range_constexpr(4):
                        acc[u] = Float32(0.0)
                    nt = tile + h                # the last tile loads the first again (unused)
                    if nt >= self.DT:
                        nt = rr
                    load_down(p_w2, p_s2, e * L + l0 + 16 * nt, t, nxt, NB, RW, self.QUAD)
                    ws = [[cur[hh * NB + j] for j in range(NB)] for hh in range(2)]
                    fs = [down_factors(cur, ra + 8 * hh, hh, NB) for hh in range(2)]
                    for j in cutlass.range_constexpr(NB):
                        da = decode(ws[0][j])
                        db = decode(ws[1][j])
                        d = mma(da[0], db[0], da[1], db[1], bw[4 * j], bw[4 * j + 1], 0.0, 0.0, 0.0, 0.0)
                        d = mma(da[2], db[2], da[3], db[3], bw[4 * j + 2], bw[4 * j + 3], d[0], d[1], d[2], d[3])
                        acc[0] = acc[0] + d[0] * fs[0][j]
                        acc[1] = acc[1] + d[1] * fs[0][j]
                        acc[2] = acc[2] + d[2] * fs[1][j]
                        acc[3] = acc[3] + d[3] * fs[1][j]
                    for u in cutlass.range_constexpr(2 * NB + 2 * SD):
                        cur[u] = nxt[u]
                    for col in cutlass.range_constexpr(2):
                        if 2 * t + col < tc:
                            b = s_mem[mt * NMEM + 2 * t + col] // K
                            cute.arch.atomic_add(p_y + (b * L + l0 + 16 * tile), acc[col])
                            cute.arch.atomic_add(p_y + (b * L + l0 + 16 * tile + 8), acc[2 + col])

    _KERNEL_CLS = (Up, Down)
    DEVICE_OPS = types.SimpleNamespace(vec=vec, ids=ids, group=group, WC=WC, mma=mma, to_f16x2=to_f16x2, asm=_asm,
                                       sigmoid=sigmoid, tanh=tanh)
    return _KERNEL_CLS


# ---------------------------------------------------------------------------------------------
# Host wrapper
# ---------------------------------------------------------------------------------------------

_COMPILED: dict[tuple, Any] = {}
_WS: dict[tuple, torch.Tensor] = {}
_JOIN: dict[tuple, tuple[torch.Tensor, torch.Tensor]] = {}


def _join_workspace(dev, keys: int, share: int) -> tuple[torch.Tensor, torch.Tensor]:
    """UP_LSPLIT's parts (fp32, [keys, share, 4 warps, 8, 32]: a member tile's first pair x row block) and its tickets
    (int32 [keys], zero between calls: the last CTA of a unit takes its count back); one word each without it.
    Cached per device and size: make the first call outside a CUDA graph capture; like `act`, one call at a time a
    device (two streams running the grouped kernels at once would share the tickets)."""
    n = keys if share else 1
    k = (dev.index, n, share)
    if k not in _JOIN:
        _JOIN[k] = (torch.empty(max(1, n * share * 4 * 256), dtype=torch.float32, device=dev),
                    torch.empty(n, dtype=torch.int32, device=dev).zero_())
    return _JOIN[k]


def _fail(name: str, msg: str):
    raise MoEGroupedError(f"moe_grouped cute: {name!r} {msg}")


def shape_config(pairs: int) -> tuple[int, int]:
    """(warps sharing an up tile, down tiles a warp) for `pairs` token x expert pairs: the few-pairs shape up to
    FEW_PAIRS, else one warp a 16-row up tile over the whole of L and DOWN_TILES."""
    return (FEW_UP_SPLIT, FEW_DOWN_TILES) if pairs <= FEW_PAIRS else (1, DOWN_TILES)


def up_unroll(nb: int, split: int) -> int:
    """Blocks of L an up step: UP_UNROLL where each of `split` warps gets whole steps of it, else 4."""
    return UP_UNROLL if nb % UP_UNROLL == 0 and nb // UP_UNROLL >= split else 4


def _pow2_at_most(n: int) -> int:
    return 1 << (max(1, n).bit_length() - 1)


def lsplit_config(pairs: int, split: int, up_share: int) -> bool:
    """Whether the up kernel's shares are parts of L (UP_LSPLIT; "auto": up to SHARE_LARGE_PAIRS pairs) at this shape
    (`shape_config`'s split, `share_config`'s up share): only shares of a warp a tile can split L."""
    if UP_LSPLIT is not True and UP_LSPLIT is not False and UP_LSPLIT != "auto":
        _fail("UP_LSPLIT", f"(module setting) must be True, False or 'auto', got {UP_LSPLIT!r}")
    return (UP_LSPLIT is True or (UP_LSPLIT == "auto" and pairs <= SHARE_LARGE_PAIRS)) and up_share > 1 and split == 1


def share_config(L: int, split: int, tiles: int, pairs: int = 0) -> tuple[int, int]:
    """(most CTAs sharing a group's up row block, most sharing its down tiles) at these sizes: UP_SHARE (UP_SHARE_LARGE
    above SHARE_LARGE_PAIRS pairs) in the shape of a warp a tile (split 1), so that a tile's warps (at most 4) each get
    a step of L; DOWN_SHARE, a power of two dividing `tiles`. H200 (docs/NOTES_moe.md, thirty-sixth session): up
    shares of 4 at batch 8, of 2 from 16 (the faster on same16; uniform level)."""
    nb = L // 32
    cap = UP_SHARE_LARGE if pairs > SHARE_LARGE_PAIRS else UP_SHARE
    up = 1 if split > 1 else _pow2_at_most(min(cap, 4, nb // up_unroll(nb, 1)))
    down = _pow2_at_most(min(DOWN_SHARE, tiles))
    while tiles % down:  # every share the same count of each warp's tiles
        down //= 2
    return up, down


def supports(B: int, K: int, I: int, L: int) -> str | None:
    """Why the grouped kernels cannot take these sizes, or None (the CTA shapes follow the pairs: shape_config)."""
    split, tiles = shape_config(B * K)
    if L % (64 * tiles):
        return (f"the grouped cute experts need latent % {64 * tiles} == 0 (a down CTA's rows at {B} x {K} pairs), "
                f"got {L}")
    if L % (128 * split):
        return (f"the grouped cute experts need latent % {128 * split} == 0 (whole groups of four blocks a warp's "
                f"part of L at {B} x {K} pairs), got {L}")
    if I % UP_ROWS:
        return f"the grouped cute experts need the per-GPU intermediate % {UP_ROWS} == 0 (an up CTA's rows), got {I}"
    if B * K > MAX_PAIRS:
        return f"the grouped cute experts take batch x top-k <= {MAX_PAIRS}, got {B} x {K}"
    return None


def moe_grouped(z, idx, wk, w1, w3, w2, s1, s3, s2, y, *, b1: float = 4.0, b2: float = 25.0,
                pdl: bool | None = None, w2_quad: bool = False):
    """y [B, L] fp32 = the routed experts of B tokens (module docstring). Returns y."""
    import cutlass

    from .kda_decode import gmem_ptr

    if pdl is None:
        pdl = False  # not the chain's setting (module docstring)
    if not isinstance(pdl, bool):
        _fail("pdl", f"must be None or a bool, got {pdl!r}")
    if not isinstance(w2_quad, bool):
        _fail("w2_quad", f"must be a bool, got {w2_quad!r}")
    if not isinstance(z, torch.Tensor) or z.dim() != 2:
        _fail("z", f"must be [B, L] bf16, got {getattr(z, 'shape', z)!r}")
    dev = z.device
    B, L = z.shape
    if not isinstance(w1, torch.Tensor) or w1.dim() != 3:
        _fail("w1", f"must be the kernel-layout words [E, I, L/8] int32, got {getattr(w1, 'shape', w1)!r}")
    I = w1.shape[1]
    if not isinstance(idx, torch.Tensor) or idx.dim() != 2 or idx.shape[0] != B:
        _fail("idx", f"must be [B={B}, K] expert ids, got {getattr(idx, 'shape', idx)!r}")
    K = idx.shape[1]
    why = supports(B, K, I, L)
    if why:
        _fail("z", why)
    if w2_quad and (I // 32) % 4:
        _fail("w2_quad", f"needs the intermediate a multiple of 128 (whole groups of four blocks a W2 row), got {I}")
    sw = experts_tensors(z, idx, wk, w1, w3, w2, s1, s3, s2, y, B, _fail)
    step = 2 if idx.dtype == torch.int64 else 1
    key_ws = (dev.index, B * K, I)
    act = _WS.get(key_ws)
    if act is None:
        act = _WS[key_ws] = torch.empty(B * K, I // 2, dtype=torch.int32, device=dev)
    I32, F32 = cutlass.Int32, cutlass.Float32
    split, tiles = shape_config(B * K)
    if isinstance(UP_SHARE, bool) or UP_SHARE not in (1, 2, 4):
        _fail("UP_SHARE", f"(module setting) must be 1, 2 or 4 (a row block's four 16-row tiles), got {UP_SHARE!r}")
    up_share, down_share = share_config(L, split, tiles, B * K)
    lsplit = lsplit_config(B * K, split, up_share)
    part, cnt = _join_workspace(dev, B * K * (I // UP_ROWS), up_share if lsplit else 0)
    up_args = [gmem_ptr(z.view(torch.int32), I32, 16), gmem_ptr(idx.view(torch.int32), I32, 4),
               gmem_ptr(wk, F32, 4), gmem_ptr(w1, I32, 16), gmem_ptr(w3, I32, 16), gmem_ptr(sw[0], I32, 4),
               gmem_ptr(sw[1], I32, 4), gmem_ptr(act, I32, 16), gmem_ptr(y, F32, 16), gmem_ptr(part, F32, 16),
               gmem_ptr(cnt, I32, 4)]
    down_args = [gmem_ptr(idx.view(torch.int32), I32, 4), gmem_ptr(w2, I32, 16), gmem_ptr(sw[2], I32, 4),
                 gmem_ptr(act, I32, 16), gmem_ptr(y, F32, 16)]
    if isinstance(SHARE_FROM, bool) or not isinstance(SHARE_FROM, int) or SHARE_FROM < 1:
        _fail("SHARE_FROM", f"(module setting) must be a positive int, got {SHARE_FROM!r}")
    # a lane loads four blocks' quad-transposed words at once: 2 ran and gave wrong sums (H100, fifty-ninth session)
    if isinstance(UP_UNROLL, bool) or not isinstance(UP_UNROLL, int) or UP_UNROLL < 4 or UP_UNROLL % 4:
        _fail("UP_UNROLL", f"(module setting) must be a positive multiple of 4, got {UP_UNROLL!r}")
    # every module setting a compile reads is in the key (a changed setting compiles anew)
    key = (B, K, I, L, step, float(b1), float(b2), pdl, dev.index, UP_UNROLL, split, tiles, up_share, down_share,
           SHARE_FROM, DOWN_CTAS_PER_SM, w2_quad, lsplit)
    with torch.cuda.device(dev):
        import cuda.bindings.driver as cuda

        stream = cuda.CUstream(torch.cuda.current_stream(dev).cuda_stream)
        fns = _COMPILED.get(key)
        if fns is None:
            from cutlass import cute

            up_cls, down_cls = _kernel_classes()
            up = up_cls(B, K, I, L, step, b1, b2, pdl, split, up_share, SHARE_FROM, lsplit)
            fns = (cute.compile(up, *up_args, stream),
                   cute.compile(down_cls(B, K, I, L, step, tiles, down_share, SHARE_FROM, w2_quad), *down_args,
                                stream))
            _COMPILED[key] = fns
        fns[0](*up_args, stream)
        fns[1](*down_args, stream)
    return y
