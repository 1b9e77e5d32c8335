"""Gated-MLA decode attention over the latent cache (absorbed form), split-KV, in two Triton kernels.

What it computes (k3lab.ref.mla.mla_attend): for sequence b, query row (t, h) and visible position s,
    score = (q_lat[b,t,h] . c_s + q_rope[b,t,h] . k_rope_s) * scale        (scale = 192^-0.5 passed in)
    o_lat[b,t,h] = softmax_s(score) . c_s  (fp32, [B,T,H,C]),   lse[b,t,h] = log sum_s exp(score) (fp32)
over the cache entries [c (C=512) | k_rope (Dr=64)] of positions s <= lengths[b] + t (the T new
positions are causal among themselves; their entries are already in the cache).

Kernel 1, `_mla_split_kernel`: one program per (row group g, partition p, DCP shard r) x sequence b,
grid (G * P * NS, B) with g fastest (the groups of one piece run side by side and share its rows in L2).
  * ALL query heads of one sequence are one tile of rows: row = t * HR + h (HR = pad_heads, or H when
    not padded), BM rows a program (BM = next power of two >= max(16, T*HR), at most `block_m`: 16, or 32
    from batch 8 where that takes fewer groups and below it for >= 96 rows over >= 16K positions,
    `default_block_m`; more rows = G > 1 groups, e.g. T=8 at 12/16 heads). So each cache row is read ONCE
    per sequence for all heads and all T queries (G times, the later ones mostly from L2, when G > 1). Padded
    rows (h >= H or t >= T) are loaded as zero queries and never stored: they cannot change any result.
  * Head padding: tl.dot needs M >= 16, so both forms run tensor-core tiles. Unpadded, the T*H rows are
    packed densely and masked up to BM; pad_heads=16 lays each position's heads out as 16 rows.
  * The piece: the shard's visible positions of sequence b are cut into P contiguous chunks of
    ceil(n / P) rounded up to a multiple of BN. With the longest history n_max known on the host (the
    component passes it) n = ceil(n_max / NS) for every sequence, so a program knows its piece before it
    has read lengths[b] and loads its first page indices at once (one dependent DRAM round trip fewer);
    otherwise each sequence is cut by its own length. A piece with no positions (short history, many
    partitions, DCP shard past the history) writes an empty partial: o = 0, lse = -inf (never NaN: the
    running max is guarded).
  * Per block of BN positions: the block's rows are gathered (contiguous: b * S_max + s; paged: page =
    block_table[b, s // PAGE], row page * PAGE + s % PAGE), each row 1152 contiguous bytes in bf16
    (576 in fp8) loaded as a [BN, C] and a [BN, Dr] tile (16-byte vectors: the row stride 576 is a
    constexpr), used for BOTH products: S = Q_lat C^T + Q_rope Kr^T (fp32, tensor cores), online softmax
    in fp32 (exp2), acc += P C (P rounded to bf16 for the tensor-core product, acc fp32). The loads stay
    inside the visible range (masked), so garbage past a sequence (other pages, NaN) is never read. The latent
    columns come in KS pieces (`default_ksplit`: 4 for 16- and 32-row tiles): the scores
    are then the sum of KS + 1 independent products, KS short chains of MMAs instead of one of 36 dependent ones,
    and q and acc are kept in the same pieces.
  * Pipelining: with the page index loaded inside the block loop Triton's pipeliner keeps ONE buffer of rows
    (the next block's copy waits for the index). Where a block lies in one page (page % BN == 0, no DCP) and
    a piece has >= PRELOAD_MIN_BLOCKS (2) blocks, its page indices are loaded NPG = DEFAULT_PRELOAD_PAGES (16) at a
    time before the block loop
    (the block's index is picked from registers), and num_stages = 3 double-buffers the rows: one block
    streams while the previous one is multiplied. A contiguous cache's rows are arithmetic: it takes the same
    32-position blocks and three stages (`streamed_rows`; not 32-row tiles from batch 16).
  * fp8 e4m3 cache: the tile is converted to bf16 in registers (exact). Scale scheme: PER-TENSOR, one fp32
    scale (0-d tensor, read in the kernel: no host sync) folded into the score scale and applied to o
    once at the end; PER-TOKEN, one fp32 scale per cache row ([B, S_max] contiguous, [n_pages, PAGE]
    paged, beside the rows) multiplies the row's scores (S[:, j] * s_j) and its softmax weight
    (P[:, j] * s_j before the P C product), i.e. the kernel attends over e4m3 * scale exactly as
    k3lab.ref.mla.MLACache.read dequantizes it.
  * DCP-N emulated: shard r holds positions r, r+N, r+2N, ... (interleave) or the r-th contiguous slice
    of ceil(n / N) (contiguous) of each sequence; its programs are exactly what one GPU of DCP-N runs
    over its local positions (all heads, its own P pieces). Partial k = r * P + p.
  Output: the partials o [B, K, T, H, C] fp32 (normalized) and lse [B, K, T, H] fp32, K = NS * P; with
  K = 1 the kernel writes o_lat / lse directly and there is no second kernel. With PDL (default on) each
  program lets the merge / combine launch once its partial is stored.

The merge inside the split (`fuse_merge`; rule `default_fuse_merge`: one new position from batch 8): once its partial
is stored each program takes a ticket (an arrival counter per sequence and row group); the last NM to arrive wait for
the rest, then each merges units of one output row's E columns over the K partials (read past L1) into o_lat / lse,
and the last of them resets the counters. NM stays at or under the SMs over the pairs merging at once, so the programs
still to arrive always find a slot. No second launch.

Kernel 2, `_mla_merge_kernel` (K > 1, not fused): o = sum_k exp(lse_k - lse) o_k with lse = log sum_k exp(lse_k),
one pass with a running max; empty partials weigh 0. Grid (B*T*H / RB, C / BC): on a GPU one (b, t, h)
row and 32 columns a program (192 programs at batch 1, 12 heads), up to 256 partials in one step: one L2
round trip for K <= 256. (k3lab.components.mla.verify skips it: k3lab_kernels.triton.mla_combine merges
the partials inside the combine with Wuv and the gate.)

Floor (bytes that must move, per call; cache bytes read once per sequence):
  cache   sum_b (lengths[b] + T) * 576 * e    (e = 2 bf16, 1 fp8; + 4 per position with per-token scales)
  queries B*T*H*576*2;  outputs B*T*H*(512 + 1)*4 (fp32 o_lat, lse);  block table / lengths: small.
  e.g. batch 1, 12 heads, bf16: 1K context 1.18 MB (0.26 us at 4.6 TB/s: launch-bound); 8K 9.4 MB
  (2.05 us); 32K 37.7 MB (8.2 us); 128K 151 MB (32.8 us); batch 64 at 8K 604 MB (131 us).
The partials (K * B*T*H*513*4 bytes written then read: 3.1 MB at batch 1, K = 128, 12 heads; L2-resident)
are the split's price. No measured figure is quoted here: docs/NOTES_mla.md.
Grid sizing: at batch 1 the partitions fill the GPU (the automatic choice, `default_partitions`: one block a
piece up to one program an SM, two programs an SM once pieces keep >= 4 blocks); from batch 8 one program an
SM; at batch 64 a few pieces suffice.
"""
from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from k3lab_kernels.triton.pdl import chain_pdl, launch_kw, pdl_on

LOG2E = 1.4426950408889634
LN2 = 0.6931471805599453
MAX_PARTITIONS = 512
BLOCK_N_ALLOWED = (16, 32, 64, 128)
PRELOAD_ALLOWED = (0, 16, 32, 64, 128)  # page indices preloaded a step (0: one load a block, in the loop)
DCP_LAYOUTS = ("interleave", "contiguous")
NOMINAL_SMS = 132  # the H200's SM count: the automatic choice on a machine without a GPU
# rows a program: 16 (T > 1 at 12 heads: row groups of 16, each re-reading its piece mostly from L2) measured
# ahead of 32 and 64 at T = 4 (docs/NOTES_mla.md); T = 1 at 12 or 16 heads is one group either way
DEFAULT_BLOCK_M = 16
# ... and 32 below batch 8 for at least this many rows over histories of at least this many positions
# (`default_block_m`)
VERIFY_LONG_ROWS = 96
VERIFY_LONG_N = 16384
# the lazy rescale (`lazy`): the running max moves only when a row's block maximum passes it by this much (log2
# units: weights up to 2^8 against the older max, exact in fp32 sums and bf16 products). Rule (`default_lazy`): on
# for a verify of at least LAZY_MIN_T positions from batch LAZY_MIN_BATCH (slower at batch 1, level at 16 and at
# T = 1; H100, profiles/h100-80gb-hbm3/mla_lazy.json.gz, git history at b23339a; docs/NOTES_mla.md); DEFAULT_LAZY
# (None: the rule) forces it either way
LAZY_TAU = tl.constexpr(8.0)
LAZY_MIN_T, LAZY_MIN_BATCH = 4, 32
DEFAULT_LAZY = None


# the merge inside the split (`fuse_merge`, `_tail_merge`): the last programs of a sequence to store merge its partials,
# no second launch. Rule (`default_fuse_merge`): on for one new position from batch FUSE_MERGE_MIN_BATCH (slower
# below it; H100, profiles/h100-80gb-hbm3/mla_fused_*.json.gz; docs/NOTES_mla.md); the verify's row groups not measured.
# DEFAULT_FUSE_MERGE (None: the rule) forces it either way
DEFAULT_FUSE_MERGE = None
FUSE_MERGE_MIN_BATCH = 8


def default_fuse_merge(K: int, B: int, T: int = 1) -> bool:
    """The fused merge's rule: K > 1 partials a sequence, one new position, from batch FUSE_MERGE_MIN_BATCH."""
    return K > 1 and T == 1 and B >= FUSE_MERGE_MIN_BATCH


def default_lazy(T: int, B: int) -> bool:
    """The lazy rescale's rule (module constants above): a verify of >= LAZY_MIN_T positions from batch
    LAZY_MIN_BATCH."""
    return T >= LAZY_MIN_T and B >= LAZY_MIN_BATCH


# programmatic dependent launch between the split and its merge / combine: the split lets them start once its
# partials are stored (docs/NOTES_mla.md)
DEFAULT_PDL = True
DEFAULT_PRELOAD_PAGES = 16  # page indices loaded before the block loop, this many at a time (0: one a block)
PRELOAD_MIN_BLOCKS = 2  # ... when a piece has at least this many blocks (one block a piece: the plain loop wins)
DEFAULT_HOST_CHUNK = True  # pieces sized on the host from n_max when the caller gives it (see mla_decode)
MERGE_BLOCK_C = 32  # the merge kernel's columns a program on a GPU
# the latent columns' pieces a block (1 or 4; 2 measured no faster than 1: docs/NOTES_mla.md): the scores as
# independent products of the pieces (and the rope's), so the MMAs of a block run as four chains of 8 (+ 4) instead of
# one of 36 (where C is a power of two divisible by 64; else 1). None: `default_ksplit` (4, except 1 on preloaded
# page indices with at most two blocks a piece, where 4 measured slower: docs/NOTES_mla.md, thirty-second session,
# and 1 for 64-row tiles, not measured).
DEFAULT_KSPLIT = None


def dot_f32() -> bool:
    """True under TRITON_INTERPRET=1. There (Triton 3.9) tl.dot multiplies bf16 operands wrongly (as raw
    bit patterns) and float -> bf16 / fp8 casts truncate (fp8: a mantissa carry is lost, 1.99 -> 1.0), so
    interpreted kernels round to nearest-even explicitly (`rne_bf16`, `rne_e4m3`: what the GPU's casts do)
    and widen the same bf16 operands to fp32 before tl.dot. On a GPU the products are bf16 x bf16 -> fp32
    tensor-core MMAs and the casts are the hardware's."""
    return os.environ.get("TRITON_INTERPRET") == "1"


@triton.jit
def rne_bf16(x):
    """fp32 -> the nearest bf16 value (ties to even), still fp32: bf16's cast then is exact everywhere."""
    bits = x.to(tl.int32, bitcast=True)
    bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & -65536
    return bits.to(tl.float32, bitcast=True)


@triton.jit
def rne_e4m3(x):
    """fp32 in [-448, 448] -> the nearest float8 e4m3 value (ties to even), still fp32. Normal range
    (|x| >= 2^-6): 3 mantissa bits kept on the fp32 bit pattern (a carry moves into the exponent);
    subnormals: multiples of 2^-9, by adding and removing 1.5 * 2^14 (whose fp32 ulp is 2^-9)."""
    bits = x.to(tl.int32, bitcast=True)
    bits = (bits + 0x7FFFF + ((bits >> 20) & 1)) & -1048576
    sub = (x + 24576.0) - 24576.0
    return tl.where(tl.abs(x) < 0.015625, sub, bits.to(tl.float32, bitcast=True))


@triton.jit
def _mask2(rows_ok, cols_ok, ROWS_ONLY: tl.constexpr):
    """[R, 1] (every column valid: a row-only mask, vector loads along the row) or [R, N]."""
    if ROWS_ONLY:
        return rows_ok[:, None]
    else:
        return rows_ok[:, None] & cols_ok[None, :]


def _pow2(n: int) -> int:
    return 1 << max(0, int(n) - 1).bit_length()


@triton.jit
def _kv_block(kv, block_table, b, s_btb, s_kvb, start, hi, pos0, pstride, rr, r_ok, lo, pg_lo,
              C: tl.constexpr, DR: tl.constexpr, DRP: tl.constexpr, W: tl.constexpr,
              BN: tl.constexpr, PAGED: tl.constexpr, PAGE: tl.constexpr, PAGE_ROWS: tl.constexpr):
    """The cache rows of the block of positions [start, start + BN) of a piece ending at `hi`: (row pointers
    [BN, 1] (the latent columns are loaded by _attend_rows), kr [BN, Dr] bf16, row [BN] int64). Positions >= hi
    are never read."""
    j = start + tl.arange(0, BN)
    ok = j < hi
    gp = pos0 + j * pstride
    if PAGE_ROWS:  # the block lies in one page (PAGE % BN == 0, no DCP stride): one index, BN rows; the
        # piece's first index (pg_lo) was loaded before the loop
        page = tl.where(start == lo, pg_lo,
                        tl.load(block_table + b * s_btb + start // PAGE, mask=(start < hi) & (start != lo), other=0))
        row = page.to(tl.int64) * PAGE + (start % PAGE) + tl.arange(0, BN)
    elif PAGED:
        page = tl.load(block_table + b * s_btb + gp // PAGE, mask=ok, other=0)
        row = page.to(tl.int64) * PAGE + (gp % PAGE)
    else:
        row = b.to(tl.int64) * s_kvb + gp
    base = kv + row[:, None] * W
    kr = tl.load(base + C + rr[None, :], mask=_mask2(ok, r_ok, DRP == DR), other=0.0).to(tl.bfloat16)
    return base, kr, row


@triton.jit
def _opaque(x):
    """x through an inline-asm move: a tl.dot result the compiler cannot fold into the next dot's accumulator (so
    the pieces' products stay independent chains of MMAs)."""
    return tl.inline_asm_elementwise("mov.b32 $0, $1;", "=r,r", [x], dtype=tl.float32, is_pure=True, pack=1)


@triton.jit
def _attend_rows(q0, q1, q2, q3, qr, m, l, a0, a1, a2, a3, base, rmask, kr, gp, ok, limit, tok, qk_scale,
                 SCALE_MODE: tl.constexpr, DOT_F32: tl.constexpr, KS: tl.constexpr, CW: tl.constexpr,
                 LAZY: tl.constexpr):
    """One block of positions into the running (m, l, acc) of the tile's rows: S = Q_lat C^T + Q_rope Kr^T,
    online softmax (exp2), acc += P C. The block's latent columns are loaded here from `base` (row pointers
    [BN, 1]) in KS pieces of CW: with KS > 1 the scores are the sum of KS + 1 independent products (the latent
    pieces' and the rope's), KS short chains of MMAs instead of one of (C + Dr) / 16, and q / acc come in the
    same pieces (a1..a3, q1..q3 unused at KS = 1). LAZY: the running max m moves (and l, acc are rescaled) only in
    a block where some row's maximum passes m + LAZY_TAU; otherwise the block's weights are exp2(s - m) <= 2^LAZY_TAU
    against the older m, the same softmax once l and acc are divided out (m, l, acc stay consistent), without the
    accumulators' multiply in most blocks."""
    cw = tl.arange(0, CW)
    c0 = tl.load(base + cw[None, :], mask=rmask, other=0.0).to(tl.bfloat16)
    if DOT_F32:
        c0 = c0.to(tl.float32)
        kr = kr.to(tl.float32)
    if KS == 1:
        s = tl.dot(q0, tl.trans(c0)) + tl.dot(qr, tl.trans(kr))
    else:
        c1 = tl.load(base + CW + cw[None, :], mask=rmask, other=0.0).to(tl.bfloat16)
        c2 = tl.load(base + 2 * CW + cw[None, :], mask=rmask, other=0.0).to(tl.bfloat16)
        c3 = tl.load(base + 3 * CW + cw[None, :], mask=rmask, other=0.0).to(tl.bfloat16)
        if DOT_F32:  # the interpreter: fp32 products of the same values, no inline asm (and nothing to fold)
            c1 = c1.to(tl.float32)
            c2 = c2.to(tl.float32)
            c3 = c3.to(tl.float32)
            s = (tl.dot(q0, tl.trans(c0)) + tl.dot(q1, tl.trans(c1)) + tl.dot(q2, tl.trans(c2))
                 + tl.dot(q3, tl.trans(c3)) + tl.dot(qr, tl.trans(kr)))
        else:
            s = ((_opaque(tl.dot(q0, tl.trans(c0))) + _opaque(tl.dot(q1, tl.trans(c1))))
                 + (_opaque(tl.dot(q2, tl.trans(c2))) + _opaque(tl.dot(q3, tl.trans(c3))))
                 + _opaque(tl.dot(qr, tl.trans(kr))))
    if SCALE_MODE == 2:
        s = s * tok[None, :]
    s = s * qk_scale
    vis = ok[None, :] & (gp[None, :] <= limit[:, None])
    s = tl.where(vis, s, float("-inf"))
    m_blk = tl.max(s, 1)
    if LAZY:
        # a block-uniform branch: rescale only when some row's maximum grew past m + LAZY_TAU (always in a row's
        # first visible block, where m is -inf); a row whose block is all masked has m_blk = -inf (never grows)
        grow = tl.max((m_blk > m + LAZY_TAU).to(tl.int32), 0) > 0
    else:
        grow = True  # every block (a compile-time branch)
    if grow:
        m_new = tl.maximum(m, m_blk)
        alpha = tl.exp2(m - tl.where(m_new == float("-inf"), 0.0, m_new))
        l = l * alpha
        a0 = a0 * alpha[:, None]
        if KS == 4:
            a1 = a1 * alpha[:, None]
            a2 = a2 * alpha[:, None]
            a3 = a3 * alpha[:, None]
        m = m_new
    pw = tl.exp2(s - tl.where(m == float("-inf"), 0.0, m)[:, None])
    l = l + tl.sum(pw, 1)
    pb = _weights_bf16(pw, tok, SCALE_MODE, DOT_F32)
    a0 = a0 + tl.dot(pb, c0)
    if KS == 4:
        a1 = a1 + tl.dot(pb, c1)
        a2 = a2 + tl.dot(pb, c2)
        a3 = a3 + tl.dot(pb, c3)
    return m, l, a0, a1, a2, a3


@triton.jit
def _weights_bf16(pw, tok, SCALE_MODE: tl.constexpr, DOT_F32: tl.constexpr):
    """The block's softmax weights as the P operand: times the per-position scale (mode 2), rounded to bf16."""
    if SCALE_MODE == 2:
        pw = pw * tok[None, :]
    if DOT_F32:
        return rne_bf16(pw)
    return pw.to(tl.bfloat16)


@triton.jit
def _normed(a, rden, ts, SCALE_MODE: tl.constexpr):
    """The partial's output columns: acc / l as acc * (1 / l), one reciprocal a row (times the per-tensor scale)."""
    o = a * rden[:, None]
    if SCALE_MODE == 1:
        o = o * ts
    return o


@triton.jit
def _mla_split_kernel(
    q_lat, q_rope, kv, kv_scale, block_table, lengths, o_part, lse_part, o_out, lse_out, tickets,
    qk_scale,
    s_qb, s_qt, s_qh, s_rb, s_rt, s_rh,
    s_kvb, s_sb, s_btb,
    T, H, P, NS, G, CHUNK, MAXPG, NM,
    C: tl.constexpr, DR: tl.constexpr, CP: tl.constexpr, DRP: tl.constexpr, W: tl.constexpr,
    HR: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr,
    PAGED: tl.constexpr, PAGE: tl.constexpr, SCALE_MODE: tl.constexpr, CONTIG_SHARDS: tl.constexpr,
    DOT_F32: tl.constexpr, PAGE_ROWS: tl.constexpr, NPG: tl.constexpr, HOST_CHUNK: tl.constexpr, PDL: tl.constexpr,
    WAIT: tl.constexpr, KS: tl.constexpr, LAZY: tl.constexpr,
    FUSE: tl.constexpr, ME: tl.constexpr, MKB: tl.constexpr,
):
    pid = tl.program_id(0)
    b = tl.program_id(1)
    g = pid % G
    rest = pid // G
    p = rest % P
    r = rest // P
    K = NS * P
    n_b = tl.load(lengths + b).to(tl.int32) + T  # positions the sequence's last query sees
    # this shard's positions of the sequence: global position = pos0 + j * pstride, j in [0, n_loc)
    if CONTIG_SHARDS:
        size = (n_b + NS - 1) // NS
        pos0 = r * size
        pstride = 1
        n_loc = tl.minimum(tl.maximum(n_b - pos0, 0), size)
    else:
        pos0 = r
        pstride = NS
        n_loc = (n_b - r + NS - 1) // NS  # >= 0: r <= NS - 1 and n_b >= 1
    if HOST_CHUNK:  # the piece length from the host (the longest history): the piece's first page indices
        chunk = CHUNK  # are loaded below without waiting for lengths[b] (in bounds of the table row; an entry
    else:           # past the sequence is never used)
        chunk = (n_loc + P - 1) // P
        chunk = (chunk + BN - 1) // BN * BN
    lo = p * chunk
    hi = tl.minimum(lo + chunk, n_loc)
    if NPG > 0:
        pp = tl.arange(0, NPG)
        first = tl.load(block_table + b * s_btb + lo // PAGE + pp, mask=lo // PAGE + pp < MAXPG, other=0)
        pg_lo = 0
    elif PAGE_ROWS:
        pg_lo = tl.load(block_table + b * s_btb + lo // PAGE, mask=lo // PAGE < MAXPG, other=0)
    else:
        pg_lo = 0

    rows = g * BM + tl.arange(0, BM)
    t = rows // HR
    h = rows % HR
    row_ok = (t < T) & (h < H)
    limit = n_b - T + t  # lengths[b] + t: the last position row (t, h) sees
    cc = tl.arange(0, CP)
    rr = tl.arange(0, DRP)
    # column masks only where the width is not a power of two (C = 512, Dr = 64 need none: a row-only
    # mask keeps the 16-byte vector loads along the row)
    if CP == C:
        c_ok = cc < CP
    else:
        c_ok = cc < C
    if DRP == DR:
        r_ok = rr < DRP
    else:
        r_ok = rr < DR
    if WAIT:  # launched with PDL (pdl_chain): lengths and the page indices above, the query and rows after the wait
        tl.extra.cuda.gdc_wait()
    CW: tl.constexpr = CP // KS  # the latent columns in KS pieces (KS > 1 only where C = CP)
    cw = tl.arange(0, CW)
    qrow = q_lat + b * s_qb + t[:, None] * s_qt + h[:, None] * s_qh
    if KS == 1:
        q0 = tl.load(qrow + cc[None, :], mask=_mask2(row_ok, c_ok, CP == C), other=0.0).to(tl.bfloat16)
        q1 = 0.0
        q2 = 0.0
        q3 = 0.0
    else:
        q0 = tl.load(qrow + cw[None, :], mask=row_ok[:, None], other=0.0).to(tl.bfloat16)
        q1 = tl.load(qrow + CW + cw[None, :], mask=row_ok[:, None], other=0.0).to(tl.bfloat16)
        q2 = tl.load(qrow + 2 * CW + cw[None, :], mask=row_ok[:, None], other=0.0).to(tl.bfloat16)
        q3 = tl.load(qrow + 3 * CW + cw[None, :], mask=row_ok[:, None], other=0.0).to(tl.bfloat16)
    qr = tl.load(q_rope + b * s_rb + t[:, None] * s_rt + h[:, None] * s_rh + rr[None, :],
                 mask=_mask2(row_ok, r_ok, DRP == DR), other=0.0).to(tl.bfloat16)
    if DOT_F32:  # the interpreter: the same bf16 values, multiplied in fp32 (see `dot_f32`)
        q0 = q0.to(tl.float32)
        qr = qr.to(tl.float32)
        if KS == 4:
            q1 = q1.to(tl.float32)
            q2 = q2.to(tl.float32)
            q3 = q3.to(tl.float32)
    ts = 1.0
    if SCALE_MODE == 1:
        ts = tl.load(kv_scale).to(tl.float32)
        qk_scale = qk_scale * ts

    m = tl.full([BM], float("-inf"), tl.float32)
    l = tl.zeros([BM], tl.float32)
    a0 = tl.zeros([BM, CW], tl.float32)
    a1 = 0.0
    a2 = 0.0
    a3 = 0.0
    if KS == 4:
        a1 = tl.zeros([BM, CW], tl.float32)
        a2 = tl.zeros([BM, CW], tl.float32)
        a3 = tl.zeros([BM, CW], tl.float32)
    if NPG > 0:
        # PAGE_ROWS with the piece's page indices loaded NPG at a time before the block loop: the loop's row
        # addresses come from registers, not from a load in the loop, so the pipeliner multi-buffers the rows
        # (num_stages - 1 blocks in flight; with the index loaded in the loop it keeps one buffer)
        pg_hi = (hi + PAGE - 1) // PAGE
        for pg0 in range(lo // PAGE, pg_hi, NPG):
            later = (pg0 + pp < pg_hi) & (pp + pg0 != pp + lo // PAGE)  # the first step's indices are `first`
            pages = tl.where(pg0 == lo // PAGE, first, tl.load(block_table + b * s_btb + pg0 + pp, mask=later, other=0))
            for start in range(tl.maximum(lo, pg0 * PAGE), tl.minimum(hi, (pg0 + NPG) * PAGE), BN):
                j = start + tl.arange(0, BN)
                ok = j < hi
                page = tl.sum(tl.where(pp == start // PAGE - pg0, pages, 0))
                row = page.to(tl.int64) * PAGE + (start % PAGE) + tl.arange(0, BN)
                base = kv + row[:, None] * W
                kr = tl.load(base + C + rr[None, :], mask=_mask2(ok, r_ok, DRP == DR), other=0.0).to(tl.bfloat16)
                if SCALE_MODE == 2:
                    tok = tl.load(kv_scale + row, mask=ok, other=0.0).to(tl.float32)
                else:
                    tok = 0.0
                m, l, a0, a1, a2, a3 = _attend_rows(q0, q1, q2, q3, qr, m, l, a0, a1, a2, a3, base,
                                                    _mask2(ok, c_ok, CP == C), kr, j, ok, limit, tok, qk_scale,
                                                    SCALE_MODE, DOT_F32, KS, CW, LAZY)
    else:
        for start in range(lo, hi, BN):
            j = start + tl.arange(0, BN)
            ok = j < hi
            gp = pos0 + j * pstride
            base, kr, row = _kv_block(kv, block_table, b, s_btb, s_kvb, start, hi, pos0, pstride, rr, r_ok, lo, pg_lo,
                                      C, DR, DRP, W, BN, PAGED, PAGE, PAGE_ROWS)
            if SCALE_MODE == 2:
                if PAGED:
                    srow = row
                else:
                    srow = b.to(tl.int64) * s_sb + gp
                tok = tl.load(kv_scale + srow, mask=ok, other=0.0).to(tl.float32)
            else:
                tok = 0.0
            m, l, a0, a1, a2, a3 = _attend_rows(q0, q1, q2, q3, qr, m, l, a0, a1, a2, a3, base,
                                                _mask2(ok, c_ok, CP == C), kr, gp, ok, limit, tok, qk_scale,
                                                SCALE_MODE, DOT_F32, KS, CW, LAZY)

    has = l > 0.0
    den = tl.where(has, l, 1.0)
    lse = tl.where(has, (m + tl.log2(den)) * 0.6931471805599453, float("-inf"))
    rden = 1.0 / den
    k = r * P + p
    orow = ((b.to(tl.int64) * K + k) * T + t) * H + h
    optr = o_part + orow[:, None] * C
    if KS == 1:
        tl.store(optr + cc[None, :], _normed(a0, rden, ts, SCALE_MODE), mask=_mask2(row_ok, c_ok, CP == C))
    else:
        tl.store(optr + cw[None, :], _normed(a0, rden, ts, SCALE_MODE), mask=row_ok[:, None])
        tl.store(optr + CW + cw[None, :], _normed(a1, rden, ts, SCALE_MODE), mask=row_ok[:, None])
        tl.store(optr + 2 * CW + cw[None, :], _normed(a2, rden, ts, SCALE_MODE), mask=row_ok[:, None])
        tl.store(optr + 3 * CW + cw[None, :], _normed(a3, rden, ts, SCALE_MODE), mask=row_ok[:, None])
    tl.store(lse_part + orow, lse, mask=row_ok)
    if PDL:  # this program's results are stored: let the next kernel (merge / combine, launched with PDL) start
        tl.extra.cuda.gdc_launch_dependents()
    if FUSE:  # the last NM programs of (b, g) to store merge the K partials, a column slice each
        _tail_merge(o_part, lse_part, o_out, lse_out, tickets + (b * G + g) * 2, b, K, T, H, t, h, row_ok, NM,
                    C, ME, MKB, DOT_F32)


@triton.jit
def _merge_unit(o_part, lse_part, o_out, lse_out, b, K, TH, row, c0,
                C: tl.constexpr, E: tl.constexpr, KB: tl.constexpr, EVEN: tl.constexpr):
    """Columns [c0, c0 + E) of sequence b's output row `row` (= t * H + h) merged over its K partials: o = sum_k
    exp(lse_k - lse) o_k, lse = log sum_k exp(lse_k), in one pass (a running max rescales what is summed so far; the
    lse and o loads of a step are issued together), KB partials a step, read past L1 (.cg: the split kernel's
    programs on other SMs wrote them); empty partials weigh 0; c0 = 0 writes the row's lse. EVEN: C % E == 0 (no
    column mask: vector loads along the row). The fused merge's body."""
    cols = c0 + tl.arange(0, E)
    cm = cols < C
    m = tl.full([1], float("-inf"), tl.float32)
    den = tl.zeros([1], tl.float32)
    acc = tl.zeros([E], tl.float32)
    first = b.to(tl.int64) * K * TH + row  # partial 0 of the row; partial k is k * TH rows on (int32 offsets)
    lrow = lse_part + first
    orow0 = o_part + first * C + cols
    for k0 in range(0, K, KB):
        kb = k0 + tl.arange(0, KB)
        km = kb < K
        lb = tl.load(lrow + kb * TH, mask=km, other=float("-inf"), cache_modifier=".cg")
        ob = tl.load(orow0[None, :] + (kb * (TH * C))[:, None], mask=_mask2(km, cm, EVEN), other=0.0,
                     cache_modifier=".cg")
        m_new = tl.maximum(m, tl.max(lb, 0))
        mu = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp(m - mu)  # 0 while m = -inf
        w = tl.exp(lb - mu)
        den = den * alpha + tl.sum(w, 0)
        acc = acc * alpha + tl.sum(w[:, None] * ob, 0)
        m = m_new
    has = den > 0.0
    orow = b.to(tl.int64) * TH + row
    if EVEN:
        tl.store(o_out + orow * C + cols, acc / tl.where(has, den, 1.0))
    else:
        tl.store(o_out + orow * C + cols, acc / tl.where(has, den, 1.0), mask=cm)
    if c0 == 0:
        mu = tl.where(m == float("-inf"), 0.0, m)
        lse = tl.where(has, mu + tl.log(tl.where(has, den, 1.0)), float("-inf"))
        tl.store(lse_out + orow + tl.arange(0, 1), lse)


@triton.jit
def _tail_merge(o_part, lse_part, o_out, lse_out, tk, b, K, T, H, t, h, row_ok, NM,
                C: tl.constexpr, E: tl.constexpr, KB: tl.constexpr, INTERP: tl.constexpr):
    """The merge inside the split: each program takes a ticket (arrival counter tk[0], acq_rel) once its partial is
    stored; the last NM to arrive (NM <= the SMs over the pairs merging at once, so the ones still to arrive always
    find a slot) wait until all K have, then merge units (one output row's E columns) NM apart: the tile's output rows
    (t * H + h, a contiguous range) times C / E units a row. A departure counter (tk[1]) lets the last merger reset
    both, so they are zero between calls. Under TRITON_INTERPRET=1 (programs run one after another) the last program
    merges every unit (NM = 1) without waiting."""
    flat = t * H + h
    lo = tl.min(tl.where(row_ok, flat, 1 << 30), 0)
    hi = tl.max(tl.where(row_ok, flat + 1, 0), 0)
    UR: tl.constexpr = (C + E - 1) // E  # units a row
    n_units = (hi - lo) * UR
    tl.debug_barrier()  # every thread's partial stored before the release below
    old = tl.atomic_add(tk, 1, sem="acq_rel")
    if INTERP:
        if old == K - 1:
            for q in range(0, n_units):
                _merge_unit(o_part, lse_part, o_out, lse_out, b, K, T * H, lo + q // UR, (q % UR) * E, C, E, KB,
                            C % E == 0)
            tl.atomic_xchg(tk, 0)
    else:
        u = old - (K - NM)
        if u >= 0:
            n = old + 1
            while n < K:
                n = tl.atomic_add(tk, 0, sem="acquire")
            left = tl.atomic_add(tk + 1, 1, sem="relaxed")
            if left == NM - 1:  # every merger is past the wait: both counters back to zero
                tl.atomic_xchg(tk + 1, 0, sem="relaxed")
                tl.atomic_xchg(tk, 0, sem="relaxed")
            for q in range(u, n_units, NM):
                _merge_unit(o_part, lse_part, o_out, lse_out, b, K, T * H, lo + q // UR, (q % UR) * E, C, E, KB,
                            C % E == 0)


@triton.jit
def _mla_merge_kernel(o_part, lse_part, o_lat, lse_out, K, TH, NR,
                      C: tl.constexpr, RB: tl.constexpr, BC: tl.constexpr, KB: tl.constexpr, EVEN: tl.constexpr,
                      PDL: tl.constexpr):
    """o_lat[b, th] = sum_k w_k o_part[b, k, th], w_k = exp(lse_k - lse), lse = log sum_k exp(lse_k), for
    RB rows (b, th) (th = t * H + h) and BC columns a program, KB partials a step, in ONE pass (a running
    max rescales what is summed so far: the lse and o loads of a step are issued together). Its own body, not
    `_merge_unit` one row at a time (slower at batch 1: docs/NOTES_mla.md, forty-sixth to fifty-third sessions)."""
    if PDL:  # launched with PDL: the split's partials are complete and visible after this
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()  # a PDL successor may launch now
    rows = tl.program_id(0) * RB + tl.arange(0, RB)
    cb = tl.program_id(1)
    rok = rows < NR
    b = rows // TH
    base = b.to(tl.int64) * K * TH + rows % TH  # [RB]: partial k of row at base + k * TH
    kk = tl.arange(0, KB)
    cols = cb * BC + tl.arange(0, BC)
    cm = cols < C
    m = tl.full([RB], float("-inf"), tl.float32)
    den = tl.zeros([RB], tl.float32)
    acc = tl.zeros([RB, BC], tl.float32)
    for k0 in range(0, K, KB):
        km = rok[:, None] & (k0 + kk < K)[None, :]
        off = base[:, None] + (k0 + kk)[None, :] * TH
        lk = tl.load(lse_part + off, mask=km, other=float("-inf"))
        if EVEN:  # C % BC == 0: no column mask (vector loads along the row)
            omask = km[:, :, None]
        else:
            omask = km[:, :, None] & cm[None, None, :]
        ok = tl.load(o_part + off[:, :, None] * C + cols[None, None, :], mask=omask, other=0.0)
        m_new = tl.maximum(m, tl.max(lk, 1))
        m_use = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp(m - m_use)  # 0 while m = -inf (nothing summed yet)
        w = tl.exp(lk - m_use[:, None])
        den = den * alpha + tl.sum(w, 1)
        acc = acc * alpha[:, None] + tl.sum(w[:, :, None] * ok, 1)
        m = m_new
    has = den > 0.0
    o = acc / tl.where(has, den, 1.0)[:, None]
    tl.store(o_lat + rows.to(tl.int64)[:, None] * C + cols[None, :], o, mask=_mask2(rok, cm, EVEN))
    if cb == 0:
        m_use = tl.where(m == float("-inf"), 0.0, m)
        tl.store(lse_out + rows, tl.where(has, m_use + tl.log(tl.where(has, den, 1.0)), float("-inf")), mask=rok)


# ---- launch helpers ------------------------------------------------------------------------------

def default_block_m(rows: int, B: int, n_max: int | None = None) -> int:
    """Rows a program for `rows` = T * HR query rows a sequence: DEFAULT_BLOCK_M (16), or 32 where 32-row tiles walk
    the cache in fewer row groups without padding more rows than 16-row tiles do:
      - from batch 8 (H200, 12 heads, 8K: faster at batch 64; at batch 8 T = 4 (64 rows for 48) and at batch 1
        slower, so 16 there; docs/NOTES_mla.md, sixteenth session);
      - below batch 8 for at least VERIFY_LONG_ROWS rows, from batch 4 or over a history of at least VERIFY_LONG_N
        positions (n_max, the longest; None: the batch rule alone): faster at T = 8, 12 heads,
        H200 (profiles/h200/mla_verify_blockm_32k.json.gz, git history at 1c9f81d) and H100 (a tie at batch 1 / 2 at 8K;
        profiles/h100-80gb-hbm3/mla_verify_rule46.json.gz, git history at 3bae41e); T = 4's 48 rows lose with 32
        (profiles/h100-80gb-hbm3/mla_verify_bm.json.gz, git history at 85e7670)."""
    g16, g32 = -(-rows // 16), -(-rows // 32)
    if g32 < g16 and (B >= 16 or 32 * g32 <= 16 * g16):
        if B >= 8 or (rows >= VERIFY_LONG_ROWS and (B >= 4 or (n_max is not None and n_max >= VERIFY_LONG_N))):
            return 32
    return DEFAULT_BLOCK_M


def rows_per_program(T: int, H: int, pad_heads: int = 0, block_m: int | None = None,
                     B: int = 1, n_max: int | None = None) -> tuple[int, int, int]:
    """(HR, BM, G): the row stride per position, the rows of a program and the row groups (block_m None: the
    rule by rows, batch and longest history, `default_block_m`)."""
    HR = pad_heads if pad_heads else H
    BM = max(16, _pow2(T * HR))
    BM = min(BM, block_m or default_block_m(T * HR, B, n_max))
    G = -(-(T * HR) // BM)
    return HR, BM, G


def default_block_n(BM: int, B: int = 1, preload: bool = True) -> int:
    """Positions a step: 32 (16 for 64-row tiles); 64 from batch 16 where the rows wait on a page index loaded in
    the loop (preload False: the loop then keeps one buffer: larger blocks stream better; measured at batch 1 and 64:
    docs/NOTES_mla.md). A contiguous cache's rows need no index (`streamed_rows`)."""
    if BM > 32:
        return 16
    return 64 if B >= 16 and not preload else 32


CONTIG_STREAMED = True  # `streamed_rows` for a contiguous cache (False: the tiles before it, for A/Bs)


def streamed_rows(paged: bool, BM: int, dcp: int = 1, page: int = 1, preload_pages: int | None = None,
                  B: int = 1) -> bool:
    """Whether the block loop's rows need no page index loaded in the loop, so that the pipeliner multi-buffers
    them (32 positions a block, three stages): a paged cache whose indices can be preloaded (one page a block, no
    DCP), or a contiguous cache (its rows are arithmetic) at any number of new positions but for 32-row tiles from
    batch 16, which keep 64 positions and two stages (there three stages lost). Measured on an H100, for the
    split at T = 1 from batch 8 and for the verify below batch 16: profiles/h100-80gb-hbm3/mla_contig.json.gz,
    mla_contig_t4.json.gz, mla_contig_t28.json.gz (git history at `1fc86d9` / `ebeda97` / `1affc20`); the figures in
    docs/NOTES_mla.md (forty-sixth to fifty-third sessions)."""
    if not paged:
        return CONTIG_STREAMED and (BM == 16 or (BM == 32 and B < 16))
    return dcp == 1 and page % 32 == 0 and preload_pages != 0


def default_preload(n_max: int, K: int, BN: int) -> int:
    """Page indices preloaded a step (0 = none) for pieces of ceil(n_max / K) positions: DEFAULT_PRELOAD_PAGES
    from PRELOAD_MIN_BLOCKS blocks a piece (the rows then stream double-buffered), else none."""
    piece = -(-max(1, n_max) // K)
    blocks = -(-piece // BN)
    return DEFAULT_PRELOAD_PAGES if blocks >= PRELOAD_MIN_BLOCKS else 0


def default_num_stages(npg: int, contiguous: bool = False) -> int:
    """3 with preloaded page indices or streamed contiguous rows (`streamed_rows`: two blocks of rows in flight); 2
    otherwise (behind a page-index load in the loop the pipeliner keeps one buffer at any num_stages)."""
    return 3 if npg or contiguous else 2


KSPLIT_ALLOWED = (1, 4)


def ksplit_takes(C: int) -> bool:
    """Whether C latent columns can run in four pieces (a power of two, 16-wide pieces)."""
    return _pow2(C) == C and C % 64 == 0


def default_ksplit(npg: int, blocks: int, BM: int = 16) -> int:
    """The latent columns' pieces for 16-row tiles (one new position at <= 16 heads): 4 (faster for the step's
    contiguous cache at batch 1 / 8K, paged at batch 1 / 32K and batch 16 / 64), 1 with preloaded page indices and at
    most two blocks a piece (batch 1 / 8K / page 64, where 4 lost). 32-row tiles (the verify's, `default_block_m`):
    4 as well (H100, profiles/h100-80gb-hbm3/mla_verify_rule46.json.gz (git history at 3bae41e); from batch 8,
    profiles/h100-80gb-hbm3/mla_verify_ks_b8.json.gz (git history at 3bae41e): T = 2 level; every piece there held
    more than two blocks, so the 16-row tiles' exception stands for both; docs/NOTES_mla.md).
    64-row tiles keep 1 (not measured)."""
    return 4 if BM in (16, 32) and not (npg and blocks <= 2) else 1


def default_num_warps(BM: int) -> int:
    return 4 if BM <= 32 else 8


def default_partitions(B: int, n_max: int, *, T: int = 1, H: int = 12, pad_heads: int = 0, dcp: int = 1,
                       block_n: int | None = None, block_m: int | None = None, sms: int | None = None) -> int:
    """The automatic partition count, from the H200 sweeps (docs/NOTES_mla.md). The split kernel holds ~210
    registers a thread and ~93 KB of shared memory double-buffered, so an SM runs two of its programs at most
    ("slots" = 2 * SMs / (B * dcp * G) programs per sequence and row group), and at small batch it is
    latency-bound: more, shorter pieces win until the merge's cost (K partials of 24.6 KB at 12 heads) takes
    over. The rule: one block a piece up to one program an SM (slots / 2 pieces); all the slots only when each
    piece still gets >= 4 blocks. Checked against 16..264 pieces at batch 1 (1K..128K) and 2..8 at batch 64
    (docs/NOTES_mla.md). One program an SM from batch 8 (forty-seventh session, ahead on an H100 at 8K) lost on the
    H200 at batch 8..32 (profiles/h200/mla_parts56.json.gz): removed, code in git history at `3ff48cd`.
    Host values only (n_max = the longest visible history, max(lengths) + T): no device sync."""
    _, BM, G = rows_per_program(T, H, pad_heads, block_m, B, n_max)
    bn = block_n or default_block_n(BM, B)
    if sms is None:
        sms = (torch.cuda.get_device_properties(torch.cuda.current_device()).multi_processor_count
               if torch.cuda.is_available() else NOMINAL_SMS)
    n_loc = -(-max(1, n_max) // dcp)  # positions one shard holds
    blocks = -(-n_loc // bn)
    slots = max(1, 2 * sms // (B * dcp * G))
    pieces = slots if blocks >= 4 * slots else max(1, min(blocks, slots // 2))
    return int(min(pieces, MAX_PARTITIONS))


def fuse_plan(K: int, C: int, rows: int, sms: int, interp: bool, seqs: int = 1) -> tuple[int, int, int]:
    """(NM, E, KB) of the merge inside the split for `rows` output rows a program's tile: units of one row's E
    columns (E a power of two <= C's, >= 16), NM mergers with NM <= K and, over the `seqs` (sequence, row group) pairs
    that merge at once, seqs * NM <= sms (the waiting mergers never hold every slot); E as small as leaves about one
    unit a merger; the partials KB a step (KB * E <= 8,192 values: 64 registers a thread at 4 warps). The
    interpreter: one merger."""
    CP = _pow2(C)
    cap = max(1, min(K, sms // max(1, seqs)))
    E = min(CP, max(16, _pow2(-(-rows * CP // cap))))
    units = rows * -(-C // E)
    NM = 1 if interp else min(units, cap)
    return NM, E, min(_pow2(K), max(1, 8192 // E))


_TICKETS: dict[tuple, torch.Tensor] = {}


def tickets(device, n: int) -> torch.Tensor:
    """The fused merge's counters (arrival, departure) per (sequence, row group): int32 [n, 2], zero between calls
    (the kernel's last merger resets them). Allocated once per device and size (call once before a CUDA-graph
    capture, as `workspace`)."""
    key = (str(device), n)
    if key not in _TICKETS:
        if torch.device(device).type == "cuda" and torch.cuda.is_current_stream_capturing():
            raise RuntimeError("mla_decode(fuse_merge=True): its counters are allocated on the first call; run one "
                               "call of this batch and row-group count before capturing a CUDA graph")
        _TICKETS[key] = torch.zeros(n, 2, dtype=torch.int32, device=device)
    return _TICKETS[key]


_WS: dict[tuple, tuple[torch.Tensor, torch.Tensor]] = {}


def workspace(device, B: int, K: int, T: int, H: int, C: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The partials' buffers (o [B,K,T,H,C] fp32, lse [B,K,T,H] fp32), allocated once per shape and device
    and reused (call once before a CUDA-graph capture; concurrent calls of one shape on two streams would
    share them: not supported)."""
    key = (str(device), B, K, T, H, C)
    if key not in _WS:
        _WS[key] = (torch.empty(B, K, T, H, C, dtype=torch.float32, device=device),
                    torch.empty(B, K, T, H, dtype=torch.float32, device=device))
    return _WS[key]


def mla_decode(q_lat: torch.Tensor, q_rope: torch.Tensor, kv: torch.Tensor, lengths: torch.Tensor,
               o_lat: torch.Tensor | None = None, lse: torch.Tensor | None = None, *, scale: float,
               kv_scale: torch.Tensor | None = None, block_table: torch.Tensor | None = None,
               partitions: int = 1, pad_heads: int = 0, dcp: int = 1, dcp_layout: str = "interleave",
               merge: bool = True, block_n: int | None = None, block_m: int | None = None,
               num_warps: int | None = None, num_stages: int | None = None,
               parts: tuple[torch.Tensor, torch.Tensor] | None = None, pdl: bool = False,
               preload_pages: int | None = None, n_max: int | None = None, host_chunk: bool | None = None,
               ksplit: int | None = None, lazy: bool | None = None, fuse_merge: bool | None = None,
               plan_out: dict | None = None):
    """Launch the split kernel (and the merge when partials > 1 and merge=True, unless fuse_merge: the split's last
    programs merge, `_tail_merge`; None: DEFAULT_FUSE_MERGE, else `default_fuse_merge`). plan_out: a dict the resolved
    settings are written into (block_m, row groups, block_n, ksplit, preloaded pages, warps, stages), for the
    caller's record of what ran. lazy: the lazy rescale of the running max (`_attend_rows`; None: DEFAULT_LAZY,
    else `default_lazy`).

    q_lat [B,T,H,C], q_rope [B,T,H,Dr] (bf16, or fp16/fp32 rounded to bf16 in the kernel; last dim
    contiguous, any other strides); kv: contiguous cache [B, S_max, C+Dr] or, with block_table
    [B, max_pages] int32, the page pool [n_pages, PAGE, C+Dr]; bf16 or float8_e4m3fn (then kv_scale: 0-d
    per-tensor or per-token [B, S_max] / [n_pages, PAGE] fp32); lengths [B] int32/int64 (positions cached
    before this step).
    o_lat [B,T,H,C] fp32 and lse [B,T,H] fp32 are written (allocated when None). merge=False returns
    the partials (o [B,K,T,H,C], lse [B,K,T,H]) instead, K = dcp * partitions (`parts` = buffers for
    them; default a cached workspace). pdl=True: the split lets its dependent start early (programmatic
    dependent launch) and the merge is launched with PDL, waiting on the split's results at its top; a
    kernel that consumes the partials (merge=False) must do the same. The caller validates; this wrapper
    only asserts the layout. preload_pages: page indices loaded that many at a time before the block loop
    (paged cache, page a multiple of block_n, no DCP; 0 = one index load per block in the loop; None =
    `default_preload`, from n_max = the longest visible history when the caller knows it). With n_max given
    (host_chunk None or True) the pieces are ceil(n_max / dcp / partitions) positions for every sequence, known
    before lengths is read, so each program loads its first page indices at once. ksplit: the latent columns'
    pieces, 1 or 4 (DEFAULT_KSPLIT, else `default_ksplit`, when None; 4 only where `ksplit_takes(C)`: the rule's
    4 elsewhere runs one piece, an explicit 4 there is refused by the component)."""
    B, T, H, C = q_lat.shape
    DR = q_rope.shape[-1]
    W = C + DR
    assert q_lat.stride(-1) == 1 and q_rope.stride(-1) == 1 and kv.is_contiguous() and kv.shape[-1] == W
    assert dcp_layout in DCP_LAYOUTS and 1 <= partitions and 1 <= dcp
    paged = block_table is not None
    # the row tile's rule reads the longest history: n_max where the caller knows it, else the cache's capacity (as
    # the component sizes the automatic partitions)
    HR, BM, G = rows_per_program(T, H, pad_heads, block_m, B,
                                 n_max or (block_table.shape[1] * kv.shape[1] if paged else kv.shape[1]))
    page = kv.shape[1] if paged else 1
    streamed = streamed_rows(paged, BM, dcp, page, preload_pages, B)
    BN = block_n or default_block_n(BM, B, streamed)
    K = dcp * partitions
    dev = q_lat.device
    direct = K == 1 and merge
    if direct:
        o_dst = o_lat if o_lat is not None else torch.empty(B, T, H, C, dtype=torch.float32, device=dev)
        l_dst = lse if lse is not None else torch.empty(B, T, H, dtype=torch.float32, device=dev)
    elif parts is not None:
        o_dst, l_dst = parts
    else:
        o_dst, l_dst = workspace(dev, B, K, T, H, C)
    if kv_scale is None:
        mode = 0
    else:
        mode = 1 if kv_scale.dim() == 0 else 2
    s_sb = kv_scale.stride(0) if mode == 2 and not paged else 0
    bt = block_table if paged else lengths  # a placeholder pointer when contiguous
    pdl = pdl_on(pdl)
    wait = chain_pdl(None)  # the split itself launched with PDL inside a pdl_chain (the step's `pdl` switch)
    page_rows = paged and dcp == 1 and page % BN == 0
    if not page_rows:
        npg = 0
    elif preload_pages is not None:
        npg = preload_pages
    else:
        npg = default_preload(n_max if n_max else block_table.shape[1] * page, dcp * partitions, BN)
    hc = bool(n_max) and (DEFAULT_HOST_CHUNK if host_chunk is None else host_chunk)
    shard = -(-int(n_max or 1) // dcp)  # positions one shard holds at most
    piece = -(-shard // partitions)
    chunk = -(-piece // BN) * BN if hc else 0
    ks = ksplit or DEFAULT_KSPLIT or default_ksplit(npg, -(-piece // BN), BM)
    assert ks in KSPLIT_ALLOWED and (ksplit in (None, 1) or ksplit_takes(C)), "the caller validates ksplit"
    if not ksplit_takes(C):  # the rule's (or DEFAULT_KSPLIT's) 4 where the widths do not allow it: one piece
        ks = 1
    grid = (G * partitions * dcp, B)
    warps, stages = num_warps or default_num_warps(BM), num_stages or default_num_stages(npg, streamed and not paged)
    lz = bool(lazy) if lazy is not None else default_lazy(T, B) if DEFAULT_LAZY is None else DEFAULT_LAZY
    fuse = K > 1 and merge and (bool(fuse_merge) if fuse_merge is not None else
                                default_fuse_merge(K, B, T) if DEFAULT_FUSE_MERGE is None else DEFAULT_FUSE_MERGE)
    if not direct and merge:  # the merged results (written by the split's mergers or by the merge kernel)
        o_out = o_lat if o_lat is not None else torch.empty(B, T, H, C, dtype=torch.float32, device=dev)
        l_out = lse if lse is not None else torch.empty(B, T, H, dtype=torch.float32, device=dev)
    else:
        o_out, l_out = o_dst, l_dst
    if fuse:
        sms = torch.cuda.get_device_properties(dev).multi_processor_count if dev.type == "cuda" else NOMINAL_SMS
        NM, ME, MKB = fuse_plan(K, C, min(BM, T * H), sms, dot_f32(), B * G)
        tk = tickets(dev, B * G)
    else:
        NM, ME, MKB, tk = 1, 16, 1, lengths  # tk: an unused pointer
    if plan_out is not None:
        plan_out.update(block_m=BM, groups=G, block_n=BN, ksplit=ks, preload_pages=npg, num_warps=warps,
                        num_stages=stages, lazy=lz, fuse_merge=fuse)
    _mla_split_kernel[grid](
        q_lat, q_rope, kv, kv_scale if mode else lengths, bt, lengths, o_dst, l_dst, o_out, l_out, tk,
        float(scale) * LOG2E,
        q_lat.stride(0), q_lat.stride(1), q_lat.stride(2), q_rope.stride(0), q_rope.stride(1), q_rope.stride(2),
        0 if paged else kv.shape[1], s_sb, block_table.stride(0) if paged else 0,
        T, H, partitions, dcp, G, chunk, block_table.shape[1] if paged else 0, NM,
        C=C, DR=DR, CP=_pow2(C), DRP=max(16, _pow2(DR)), W=W, HR=HR, BM=BM, BN=BN,
        PAGED=paged, PAGE=page, SCALE_MODE=mode, CONTIG_SHARDS=dcp_layout == "contiguous", DOT_F32=dot_f32(),
        PAGE_ROWS=page_rows, NPG=npg, HOST_CHUNK=hc, PDL=pdl, WAIT=wait, KS=ks, LAZY=lz,
        FUSE=fuse, ME=ME, MKB=MKB, num_warps=warps, num_stages=stages,
        **launch_kw(wait),
    )
    if direct or not merge:
        return o_dst, l_dst
    if not fuse:
        merge_partials(o_dst, l_dst, o_out, l_out, pdl=pdl)
    return o_out, l_out


def merge_partials(o_part: torch.Tensor, lse_part: torch.Tensor, o_lat: torch.Tensor, lse: torch.Tensor,
                   *, rows: int | None = None, block_c: int | None = None, block_k: int | None = None,
                   num_warps: int = 4, pdl: bool = False) -> None:
    """The log-sum-exp merge of contiguous partials o [B,K,T,H,C] / lse [B,K,T,H] into o_lat [B,T,H,C] /
    lse [B,T,H] (fp32, contiguous). GPU default: one (b, t, h) row and MERGE_BLOCK_C columns a program, up
    to 256 partials in one step (B*T*H*C/32 programs: 192 at batch 1, 12 heads, each one round trip for
    K <= 256); the interpreter takes 16 rows and all columns a program (its cost is per program)."""
    B, K, T, H, C = o_part.shape
    interp = dot_f32()
    if rows is not None and (rows < 1 or rows & (rows - 1)):
        raise ValueError(f"merge_partials: rows must be a power of two (rows a program), got {rows}")
    RB = rows or (16 if interp else 1)
    BC = min(block_c or (C if interp else MERGE_BLOCK_C), _pow2(C))
    KB = min(block_k or (64 if interp else max(32, 8192 // BC)), _pow2(K))
    NR = B * T * H
    _mla_merge_kernel[(triton.cdiv(NR, RB), triton.cdiv(C, BC))](o_part, lse_part, o_lat, lse, K, T * H, NR, C=C,
                                                               RB=RB, BC=_pow2(BC), KB=KB, EVEN=C % _pow2(BC) == 0,
                                                               PDL=pdl_on(pdl), num_warps=num_warps,
                                                               **launch_kw(pdl))
