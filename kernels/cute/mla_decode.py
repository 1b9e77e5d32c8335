"""Gated-MLA decode attention over the latent cache in CuTe DSL (the twin of kernels/triton/mla_decode.py's split
kernel for one new position): split-KV over a thread-block cluster, the cluster's partials merged in distributed
shared memory, so a sequence hands the merge P partials instead of P x cluster.

    score[h, s] = (q_lat[b,h] . c_s + q_rope[b,h] . kr_s) * scale          (the cache row [c (512) | kr (64)])
    o_lat[b,h]  = softmax_s(score) . c_s  (fp32),  lse[b,h] = log sum_s exp(score)
over positions s <= lengths[b] (k3lab.ref.mla.mla_attend at T = 1, all heads of a sequence over one read of its
rows).

Layout. Grid [CL, P, B], cluster [CL, 1, 1]: CTA (r, p, b) owns piece j = p CL + r of sequence b, positions
[j PL, (j + 1) PL) of its n = lengths[b] + 1 (PL host-sized from the longest history: ceil(n_max / (CL P))). A CTA of
256 threads (8 warps) walks its piece in chunks of 32 positions:
  1. copy: lane l < 4 of warp w brings row 4 w + l of a chunk (1152 bytes, the page table looked up per row:
     contiguous, or any page size) into shared memory with one bulk copy (cp.async.bulk, completing on the stage's
     mbarrier, one arrival a warp, waited for by a test_wait spin); STAGES chunks in flight (a ring); rows past the
     piece repeat its last row (finite, masked below). Rows are 296 words apart (8 mod 32 banks: the score loads
     below are conflict-free).
  2. scores on tensor cores: the 12 (or fewer) heads padded to the MMA's 16 rows; S [16, 32] = Q [16, 576] K^T with
     mma.sync m16n8k16 bf16 -> fp32; warp w owns the features 144 (w % 4) .. + 143 (9 k-steps, its Q fragments loaded
     once into 36 registers) of positions 16 (w / 4) .. + 15 (two n-tiles); the four quarters' partial S summed through
     shared memory. The features of a k-step are permuted (lane t's k {2t, 2t+1, 2t+8, 2t+9} <-> features 4t .. 4t+3,
     the same for Q and K: a dot product does not depend on the order) so a lane's K operand is one 8-byte load.
  3. online softmax in fp32 (exp2, scores times scale log2 e), a row's 32 scores over 16 lanes; P rounded to bf16.
  4. o [16, 512] += P [16, 32] V [32, 512] on tensor cores (V = the rows' first 512 values): warp w owns columns
     64 w .. 64 w + 63 (8 n-tiles, 32 fp32 accumulators), V's operands by ldmatrix .trans (one x4: two n-tiles'
     pairs).
  5. after the last chunk: each CTA pushes its unnormalized o (columns of CTA r's slice 512 / CL) and its (max, sum)
     into CTA r's shared memory (st.shared::cluster), one cluster barrier, and CTA r merges the CL pieces of its slice
     (log-sum-exp weights) into partial p of sequence b: o [B, P, 1, H, 512] normalized, lse [B, P, 1, H] (natural
     log; rank 0 writes it). An empty piece has (max, sum) = (-inf, 0) and weighs 0; an all-empty cluster writes
     o = 0, lse = -inf.
With P > 1 k3lab_kernels.triton.mla_decode.merge_partials merges the P partials; P = 1 writes o_lat / lse directly.
pipe=True (the default from 16K positions, `default_loop`): the loop computes chunk c + 1's scores (even and odd
k-steps in two MMA chains) in the same stretch of code as chunk c's P V, then the softmax of c + 1: two CTA barriers a
chunk instead of three, and two independent MMA streams for the scheduler.

Floor: the cache rows (n x 1152 bytes a sequence) at the read bandwidth, plus the partials (P B H 513 x 4 bytes written
and read back): k3lab.ops.mla.decode_bytes counts the cache, queries and outputs (9.4 MB at 8K, batch 1: ~2.1 us on
the H200). Tolerance: the Triton kernel's (bf16 operands, fp32 accumulation, P rounded to bf16).

Contract: mla_decode(q_lat, q_rope, kv, lengths, o_lat=None, lse=None, *, scale, block_table=None, partitions=None,
cluster=None, stages=None, merge=True, pdl=None, n_max=None, pipe=None) -> (o_lat [B,1,H,512], lse [B,1,H]) fp32, or
with merge=False the partials (o [B,P,1,H,512], lse [B,P,1,H]) in a workspace. T = 1, H <= 16, bf16 queries and cache
(contiguous [B, S_max, 576] or a page pool [n_pages, PAGE, 576] with block_table [B, max_pages] int32; the queries
any batch and head strides that are multiples of 4 elements, the last dimension contiguous), lengths [B]
int32 or int64 (positions cached before the new one; its row is already written). n_max: the longest visible history
max(lengths) + 1 when the caller knows it (else the cache capacity). pdl=True: the kernel waits for the one before
(griddepcontrol.wait) before any read and the merge is a PDL launch; None: the enclosing pdl_chain's setting. Refused
with the argument named (MLADecodeCuteError). `supports(shape)` says why a shape is refused (None when it runs).
None picks the measured shape: cluster `default_cluster(B)`, partitions `default_partitions` (clusters a sequence),
stages 4.
"""
from typing import Any

import torch

from .kda_decode import gmem_ptr as _ptr  # the one host pointer helper

C_LATENT = 512
D_ROPE = 64
D = C_LATENT + D_ROPE
W_ROW = D // 2             # 32-bit words a cache row (bf16 pairs)
RS = W_ROW + 8             # words between rows in shared memory (296 = 8 mod 32 banks)
ROW_BYTES = D * 2
BN = 32                    # positions a chunk
RPW = 4                    # rows of a chunk each warp copies
HR = 16                    # query rows: the heads padded to the MMA's M
_THREADS = 256
_WARPS = _THREADS // 32
KQ = 4                     # feature quarters of the scores (a warp owns one quarter and two n-tiles)
KS = D // 16 // KQ         # k-steps of 16 features in a quarter (9)
SROW = 40                  # partial-score row pitch (floats; 8 mod 32)
PROW = 20                  # P row pitch (words; conflict-free A-operand loads)
CLUSTERS = (1, 2, 4, 8)
STAGES_ALLOWED = (2, 3, 4)
LONG_HISTORY = 16384       # from here on (cache capacity or n_max) two stages and the pipelined loop: default_loop
MAX_PARTITIONS = 256
NOMINAL_SMS = 132
LN2 = 0.6931471805599453
LOG2E = 1.4426950408889634

MMA_PTX = ("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {$0, $1, $2, $3}, {$4, $5, $6, $7}, {$8, $9}, "
           "{$10, $11, $12, $13};")
LDSM_PTX = "ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {$0, $1, $2, $3}, [$4];"
PACK_PTX = "cvt.rn.bf16x2.f32 $0, $1, $2;"   # $0 = {hi: $1, lo: $2}

__all__ = ["CLUSTERS", "STAGES_ALLOWED", "MLADecodeCuteError", "default_partitions", "mla_decode", "supports"]


def smem_bytes(cluster: int, stages: int, heads: int = HR) -> int:
    """Shared memory a CTA: the row ring, the peers' columns of the real heads and (max, sum), the partial scores, P,
    alpha, mbarriers."""
    return (stages * BN * RS * 4 + heads * C_LATENT * 4 + cluster * 2 * HR * 4
            + KQ * HR * SROW * 4 + HR * PROW * 4 + HR * 4 + stages * 8 + 5 * 128)


SMEM_PER_SM = 228 * 1024   # the H100 / H200 SM's shared memory (a CTA's reserve of 1 KB counted in ctas_per_sm)


def ctas_per_sm(cluster: int, stages: int, heads: int = HR) -> int:
    """CTAs an SM holds by shared memory (the kernel's 256 threads at <= 128 registers allow two): two where a CTA
    needs at most half the SM (two stages at 12 heads: ~110 KB), else one."""
    return 2 if 2 * (smem_bytes(cluster, stages, heads) + 1024) <= SMEM_PER_SM else 1


_KERNEL_CLS = None


def _kernel_class():
    """The decode generator (built once; importing this module never needs cutlass)."""
    global _KERNEL_CLS
    if _KERNEL_CLS is not None:
        return _KERNEL_CLS
    from . import kda_decode

    d = kda_decode._dsl()
    cuda, cutlass, Float32, Int32, cute = d.cuda, d.cutlass, d.Float32, d.Int32, d.cute
    vec, st_cluster_f32, bulk_load = d.vec, d.st_cluster_f32, d.bulk_load
    from cutlass._mlir.dialects import llvm as _llvm
    from cutlass.cutlass_dsl import dsl_user_op

    def _asm(res, ops, text, cons, loc, ip):
        return _llvm.inline_asm(res, ops, text, cons, has_side_effects=False, is_align_stack=False,
                                asm_dialect=_llvm.AsmDialect.AD_ATT, loc=loc, ip=ip)

    @dsl_user_op
    def mma4(a0, a1, a2, a3, b0, b1, c0, c1, c2, c3, *, loc=None, ip=None):
        """One m16n8k16 bf16 MMA with fp32 accumulation: (d0..d3) = A B + C (the PTX fragment layouts)."""
        ops = ([Int32(x).ir_value(loc=loc, ip=ip) for x in (a0, a1, a2, a3, b0, b1)]
               + [Float32(x).ir_value(loc=loc, ip=ip) for x in (c0, c1, c2, c3)])
        res = _asm(_llvm.StructType.get_literal([Float32.mlir_type] * 4), ops, MMA_PTX,
                   "=f,=f,=f,=f,r,r,r,r,r,r,f,f,f,f", loc, ip)
        return [Float32(_llvm.extractvalue(Float32.mlir_type, res, [i], loc=loc, ip=ip)) for i in range(4)]

    @dsl_user_op
    def ldsm_x4_t(addr, *, loc=None, ip=None):
        """ldmatrix .x4 .trans: four 8x8 b16 matrices whose rows start at the shared addresses of lanes 8 i .. 8 i + 7;
        lane (g, t) gets matrix i's (row 2t, col g) and (row 2t + 1, col g) in word i."""
        res = _asm(_llvm.StructType.get_literal([Int32.mlir_type] * 4), [Int32(addr).ir_value(loc=loc, ip=ip)],
                   LDSM_PTX, "=r,=r,=r,=r,r", loc, ip)
        return [Int32(_llvm.extractvalue(Int32.mlir_type, res, [i], loc=loc, ip=ip)) for i in range(4)]

    @dsl_user_op
    def pack_bf16x2(hi, lo, *, loc=None, ip=None):
        return Int32(_asm(Int32.mlir_type, [Float32(hi).ir_value(loc=loc, ip=ip), Float32(lo).ir_value(loc=loc, ip=ip)],
                          PACK_PTX, "=r,f,f", loc, ip))

    def mma_acc(acc, o, a0, a1, a2, a3, b0, b1):
        r = mma4(a0, a1, a2, a3, b0, b1, acc[o], acc[o + 1], acc[o + 2], acc[o + 3])
        for i in range(4):  # a plain helper (not preprocessed): a Python loop
            acc[o + i] = r[i]

    def row_of(pos, b, bt_g, s_bt, s_max, PAGE: int):
        """The cache row of position pos of sequence b: its page's row (PAGE > 0), else b S_max + pos."""
        if cutlass.const_expr(PAGE > 0):
            return bt_g[b * s_bt + pos // PAGE] * PAGE + pos % PAGE
        return b * s_max + pos

    @cute.jit
    def issue(c: Int32, row: Int32, lane: Int32, warp: Int32, s_kv: cute.Tensor, p_kv: cute.Pointer,
              mbar: cute.Pointer, STG: cutlass.Constexpr):
        """Every warp: its RPW rows of chunk c into the chunk's stage (lane l < RPW: row RPW w + l), completing on the
        stage's mbarrier (one arrival a warp). A warp's bulk copies issue one lane at a time (a uniform-datapath
        loop), so the rows are spread over the warps."""
        st = c % STG
        if lane == 0:
            cute.arch.mbarrier_arrive_and_expect_tx(mbar + st, RPW * ROW_BYTES)
        cute.arch.sync_warp()
        if lane < RPW:
            bulk_load(s_kv.iterator + (st * BN + RPW * warp + lane) * RS, p_kv + row * W_ROW, mbar + st, ROW_BYTES)

    def chunk_scores(rsc, kb, rq, s_kv, s_S, base, npr, kq, g, t, split: bool):
        """This warp's partial scores of the chunk in stage offset `base` (its feature quarter kq, n-tiles 2 npr and
        2 npr + 1) into s_S. split: even and odd k-steps accumulate apart (two MMA chains of 5 and 4 instead of one of
        9 an n-tile), summed at the store. A plain helper (Python loops)."""
        rsc.fill(0.0)
        for jj in range(2):
            roff = base + (16 * npr + 8 * jj + g) * RS + kq * (KS * 8) + 2 * t
            for s in range(KS):  # the n-tile's 9 loads first, then its 9 products
                cute.autovec_copy(vec(s_kv.iterator, cute.assume(roff + 8 * s, divby=2), 2), kb[s])
            for s in range(KS):
                o = 4 * jj + (8 if split and s % 2 else 0)
                mma_acc(rsc, o, rq[2 * s][0], rq[2 * s + 1][0], rq[2 * s][1], rq[2 * s + 1][1], kb[s][0], kb[s][1])
        for jj in range(2):
            for hh in range(2):
                o = (kq * HR + g + 8 * hh) * SROW + 16 * npr + 8 * jj + 2 * t
                for e in range(2):
                    v = rsc[4 * jj + 2 * hh + e]
                    if split:
                        v = v + rsc[8 + 4 * jj + 2 * hh + e]
                    s_S[o + e] = v

    def chunk_softmax(c, start, end, rr, qq, qk_scale, rml, s_S, s_P, s_al):
        """The online softmax of chunk c, row rr, positions 2 qq, 2 qq + 1: the four quarters' scores summed, the
        running (max, sum) rescaled, P (bf16 pairs) and the row's alpha to shared memory (every thread of the row
        writes the same alpha). A plain helper."""
        pos0 = start + c * BN + 2 * qq
        sv = cute.make_rmem_tensor((2,), Float32)
        mx = Float32(-float("inf"))
        for e in range(2):
            o = rr * SROW + 2 * qq + e
            v = ((s_S[o] + s_S[HR * SROW + o]) + (s_S[2 * HR * SROW + o] + s_S[3 * HR * SROW + o])) * qk_scale
            v = cutlass.select_(pos0 + e < end, v, Float32(-float("inf")))
            sv[e] = v
            mx = cute.arch.fmax(mx, v)
        for sh in range(4):
            mx = cute.arch.fmax(mx, cute.arch.shuffle_sync_bfly(mx, offset=1 << sh))
        m_old = rml[0]
        m_new = cute.arch.fmax(m_old, mx)
        al = cute.math.exp2(m_old - m_new, approx=True, ftz=True)
        tot = Float32(0.0)
        for e in range(2):
            sv[e] = cute.math.exp2(sv[e] - m_new, approx=True, ftz=True)
            tot = tot + sv[e]
        for sh in range(4):
            tot = tot + cute.arch.shuffle_sync_bfly(tot, offset=1 << sh)
        rml[1] = rml[1] * al + tot
        rml[0] = m_new
        s_P[rr * PROW + qq] = pack_bf16x2(sv[1], sv[0])
        s_al[rr] = al

    def chunk_pv(ro, s_P, s_al, kv_addr, st, warp, lane, g, t):
        """o = alpha o + P V over this warp's 64 columns, V from stage st (ldmatrix .trans). A plain helper."""
        a_lo = s_al[g]
        a_hi = s_al[g + 8]
        for j in range(8):
            ro[4 * j] = ro[4 * j] * a_lo
            ro[4 * j + 1] = ro[4 * j + 1] * a_lo
            ro[4 * j + 2] = ro[4 * j + 2] * a_hi
            ro[4 * j + 3] = ro[4 * j + 3] * a_hi
        for ks in range(2):
            pa0 = s_P[g * PROW + 8 * ks + t]
            pa1 = s_P[(g + 8) * PROW + 8 * ks + t]
            pa2 = s_P[g * PROW + 8 * ks + 4 + t]
            pa3 = s_P[(g + 8) * PROW + 8 * ks + 4 + t]
            # lane l addresses row l % 8 of matrix l / 8: positions 16 ks + 8 (l / 8 % 2) + l % 8, the 8 columns of
            # n-tile 2 jp + l / 16; the four words: (b0b1, b2b3) of n-tiles 2 jp and 2 jp + 1
            lrow = ((st * BN + 16 * ks + 8 * ((lane // 8) % 2) + lane % 8) * RS + warp * 32 + 4 * (lane // 16)) * 4
            for jp in range(4):
                bw = ldsm_x4_t(kv_addr + lrow + jp * 32)
                mma_acc(ro, 8 * jp, pa0, pa1, pa2, pa3, bw[0], bw[1])
                mma_acc(ro, 8 * jp + 4, pa0, pa1, pa2, pa3, bw[2], bw[3])

    class MLADecodeKernel:
        """One cluster of CL CTAs a (partition, sequence) (module doc)."""

        def __init__(self, H: int, cluster: int, stages: int, page: int, len_step: int, pdl: bool = False,
                     pipe: bool = False):
            assert 1 <= H <= HR and cluster in CLUSTERS and stages in STAGES_ALLOWED and len_step in (1, 2)
            self.H, self.CL, self.STG, self.PAGE, self.LS = H, cluster, stages, page, len_step
            self.pdl, self.pipe = bool(pdl), bool(pipe)
            self.SW = C_LATENT // cluster   # columns a CTA merges

        @cute.jit
        def __call__(self, p_q: cute.Pointer, p_qr: cute.Pointer, p_kv: cute.Pointer, p_bt: cute.Pointer,
                     p_len: cute.Pointer, p_o: cute.Pointer, p_lse: cute.Pointer, B: Int32, P: Int32, PL: Int32,
                     s_bt: Int32, s_max: Int32, sq_b: Int32, sq_h: Int32, sr_b: Int32, sr_h: Int32, qk_scale: Float32,
                     stream: cuda.CUstream):
            cl = {} if self.CL == 1 else {"cluster": [self.CL, 1, 1]}
            self.kernel(p_q, p_qr, p_kv, p_bt, p_len, p_o, p_lse, P, PL, s_bt, s_max, sq_b, sq_h, sr_b, sr_h,
                        qk_scale).launch(
                grid=[self.CL, P, B], block=[_THREADS, 1, 1], stream=stream, use_pdl=self.pdl, **cl)

        @cute.kernel
        def kernel(self, p_q: cute.Pointer, p_qr: cute.Pointer, p_kv: cute.Pointer, p_bt: cute.Pointer,
                   p_len: cute.Pointer, p_o: cute.Pointer, p_lse: cute.Pointer, P: Int32, PL: Int32, s_bt: Int32,
                   s_max: Int32, sq_b: Int32, sq_h: Int32, sr_b: Int32, sr_h: Int32, qk_scale: Float32):
            H, CL, STG, PAGE, SW = self.H, self.CL, self.STG, self.PAGE, self.SW
            NCOL = SW // 16                     # merged columns a thread
            tid, _, _ = cute.arch.thread_idx()
            rank, p, b = cute.arch.block_idx()
            warp = cute.arch.make_warp_uniform(cute.arch.warp_idx())
            lane = tid % 32
            g = lane // 4
            t = lane % 4
            rr = tid // 16                       # the softmax / merge row of this thread, and its sixteenth of it
            qq = tid % 16
            kq = warp % KQ                       # the scores: feature quarter and n-tile pair of this warp
            npr = warp // KQ

            smem = cutlass.memory.SmemAllocator()
            s_kv = smem.allocate_tensor(Int32, cute.make_layout(STG * BN * RS), byte_alignment=128)
            s_rx = smem.allocate_tensor(Float32, cute.make_layout(CL * H * SW), byte_alignment=16)  # real heads
            s_ml = smem.allocate_tensor(Float32, cute.make_layout(CL * 2 * HR), byte_alignment=16)
            s_S = smem.allocate_tensor(Float32, cute.make_layout(KQ * HR * SROW), byte_alignment=16)
            s_P = smem.allocate_tensor(Int32, cute.make_layout(HR * PROW), byte_alignment=16)
            s_al = smem.allocate_tensor(Float32, cute.make_layout(HR), byte_alignment=16)
            mbar = smem.allocate_array(cutlass.Int64, STG, byte_alignment=8)
            if cutlass.const_expr(CL > 1):
                cute.arch.cluster_arrive_relaxed()  # the peers' shared memory must exist before the DSMEM stores
            if tid == 0:
                for s in cutlass.range_constexpr(STG):
                    cute.arch.mbarrier_init(mbar + s, _WARPS)
                cute.arch.mbarrier_init_fence()
            cute.arch.sync_threads()
            if cutlass.const_expr(self.pdl):
                cute.arch.griddepcontrol_wait()  # queries and the new row come from the kernels before

            len_g = cute.make_tensor(p_len, cute.make_layout(self.LS * (b + 1)))
            bt_g = cute.make_tensor(p_bt, cute.make_layout(s_bt * (b + 1)))
            n_b = len_g[b * self.LS] + 1
            start = (p * CL + rank) * PL
            end = cutlass.select_(start + PL < n_b, start + PL, n_b)
            cnt = cutlass.select_(end > start, end - start, Int32(0))
            nch = (cnt + (BN - 1)) // BN
            last = end - 1                       # a visible position even for an empty piece (end = n_b >= 1)

            # ---- the first chunks' rows: page indices first, then the copies ------------------------------------
            kv_addr = s_kv.iterator.toint()              # the ring's shared address (bytes), for ldmatrix
            rows = cute.make_rmem_tensor((STG,), Int32)
            for s in cutlass.range_constexpr(STG):
                pos = start + s * BN + RPW * warp + lane % RPW
                rows[s] = row_of(cutlass.select_(pos < end, pos, last), b, bt_g, s_bt, s_max, PAGE)
            for s in cutlass.range_constexpr(STG):
                if s < nch:
                    issue(s, rows[s], lane, warp, s_kv, p_kv, mbar, STG)

            # ---- this warp's Q fragments (rows g, g + 8; padded heads zero), features 144 kq + 16 s + 4 t .. + 3 ----
            # one register pair a load (a shared temporary would serialize the loads behind each other's use)
            rq = []
            for s in cutlass.range_constexpr(KS * 2):
                rq.append(cute.make_rmem_tensor((2,), Int32))
                rq[s].fill(0)
            for s in cutlass.range_constexpr(KS):
                f0 = kq * (KS * 16) + s * 16
                for hh in cutlass.range_constexpr(2):
                    h = g + 8 * hh
                    if h < H:
                        if f0 < C_LATENT:
                            cute.autovec_copy(vec(p_q, cute.assume(b * sq_b + h * sq_h + f0 // 2 + 2 * t, divby=2), 2),
                                              rq[2 * s + hh])
                        if f0 >= C_LATENT:
                            cute.autovec_copy(vec(p_qr, cute.assume(b * sr_b + h * sr_h + (f0 - C_LATENT) // 2 + 2 * t,
                                                                    divby=2), 2), rq[2 * s + hh])
            kb = []
            for _s in cutlass.range_constexpr(KS):
                kb.append(cute.make_rmem_tensor((2,), Int32))

            ro = cute.make_rmem_tensor((32,), Float32)   # o: n-tile j's (row g, cols 2t, 2t+1), (row g + 8, ...)
            ro.fill(0.0)
            rsc = cute.make_rmem_tensor((16,), Float32)  # this warp's partial scores: its two n-tiles of 8 positions
            # (entries 8..15: the odd k-steps' chains under pipe)
            rml = cute.make_rmem_tensor((2,), Float32)   # (running max in log2 units, running sum) of row rr
            rml[0] = Float32(-float("inf"))
            rml[1] = Float32(0.0)

            if cutlass.const_expr(not self.pipe):
                for c in cutlass.range(nch):
                    st = c % STG
                    # the cache row this lane copies for chunk c + STAGES: its page index loaded now, used after
                    pos = start + (c + STG) * BN + RPW * warp + lane % RPW
                    nrow = row_of(cutlass.select_(pos < end, pos, last), b, bt_g, s_bt, s_max, PAGE)
                    # the chunk's rows: mbarrier test_wait in a loop (try_wait compiles to a suspending NANOSLEEP)
                    ph = (c // STG) % 2
                    ok = cute.arch.mbarrier_test_wait(mbar + st, ph)
                    while not ok:
                        ok = cute.arch.mbarrier_test_wait(mbar + st, ph)
                    chunk_scores(rsc, kb, rq, s_kv, s_S, st * (BN * RS), npr, kq, g, t, False)
                    cute.arch.sync_threads()
                    chunk_softmax(c, start, end, rr, qq, qk_scale, rml, s_S, s_P, s_al)
                    cute.arch.sync_threads()
                    chunk_pv(ro, s_P, s_al, kv_addr, st, warp, lane, g, t)
                    cute.arch.sync_threads()  # the stage and s_P are free again
                    if c + STG < nch:
                        issue(c + STG, nrow, lane, warp, s_kv, p_kv, mbar, STG)
            else:
                # pipelined: chunk c + 1's scores and chunk c's P V in one stretch of code (two independent MMA streams
                # for the scheduler), two barriers a chunk instead of three. In the final iteration the scores are of
                # chunk c's stage again and never used (no branch around them: one basic block for the scheduler).
                if nch > 0:
                    ok0 = cute.arch.mbarrier_test_wait(mbar, 0)
                    while not ok0:
                        ok0 = cute.arch.mbarrier_test_wait(mbar, 0)
                    chunk_scores(rsc, kb, rq, s_kv, s_S, 0, npr, kq, g, t, True)
                    cute.arch.sync_threads()
                    chunk_softmax(Int32(0), start, end, rr, qq, qk_scale, rml, s_S, s_P, s_al)
                    cute.arch.sync_threads()
                for c in cutlass.range(nch):
                    st = c % STG
                    st1 = (c + 1) % STG
                    pos = start + (c + STG) * BN + RPW * warp + lane % RPW
                    nrow = row_of(cutlass.select_(pos < end, pos, last), b, bt_g, s_bt, s_max, PAGE)
                    if c + 1 < nch:
                        ph1 = ((c + 1) // STG) % 2
                        ok = cute.arch.mbarrier_test_wait(mbar + st1, ph1)
                        while not ok:
                            ok = cute.arch.mbarrier_test_wait(mbar + st1, ph1)
                    # past the last chunk: the scores of chunk c's own stage again (written; never used)
                    sst = cutlass.select_(c + 1 < nch, st1, st)
                    chunk_scores(rsc, kb, rq, s_kv, s_S, sst * (BN * RS), npr, kq, g, t, True)
                    chunk_pv(ro, s_P, s_al, kv_addr, st, warp, lane, g, t)
                    cute.arch.sync_threads()  # chunk c + 1's scores visible; stage st, P and alpha read
                    if c + STG < nch:
                        issue(c + STG, nrow, lane, warp, s_kv, p_kv, mbar, STG)
                    if c + 1 < nch:
                        chunk_softmax(c + 1, start, end, rr, qq, qk_scale, rml, s_S, s_P, s_al)
                    cute.arch.sync_threads()  # chunk c + 1's P and alpha visible

            # ---- the cluster merge: o columns and (max, sum) pushed to the CTA that merges them -------------------
            if cutlass.const_expr(CL > 1):
                cute.arch.cluster_wait()
            for j in cutlass.range_constexpr(8):
                col = warp * 64 + 8 * j + 2 * t
                dst = col // SW
                for hh in cutlass.range_constexpr(2):
                    o = (rank * H + g + 8 * hh) * SW + col % SW
                    if g + 8 * hh < H:  # the padded rows' columns are never merged: not sent
                        for e in cutlass.range_constexpr(2):
                            if cutlass.const_expr(CL > 1):
                                st_cluster_f32(s_rx.iterator + (o + e), dst, ro[4 * j + 2 * hh + e])
                            else:
                                s_rx[o + e] = ro[4 * j + 2 * hh + e]
            if qq == 0:
                for k in cutlass.range_constexpr(CL):
                    for e in cutlass.range_constexpr(2):
                        if cutlass.const_expr(CL > 1):
                            st_cluster_f32(s_ml.iterator + ((rank * 2 + e) * HR + rr), k, rml[e])
                        else:
                            s_ml[(rank * 2 + e) * HR + rr] = rml[e]
            if cutlass.const_expr(CL > 1):
                cute.arch.cluster_arrive()
                cute.arch.cluster_wait()
            else:
                cute.arch.sync_threads()
            mm = Float32(-float("inf"))
            for k in cutlass.range_constexpr(CL):
                mm = cute.arch.fmax(mm, s_ml[2 * k * HR + rr])
            mref = cutlass.select_(mm == Float32(-float("inf")), Float32(0.0), mm)
            wk = cute.make_rmem_tensor((CL,), Float32)
            ll = Float32(0.0)
            for k in cutlass.range_constexpr(CL):
                wk[k] = cute.math.exp2(s_ml[2 * k * HR + rr] - mref, approx=True, ftz=True)
                ll = ll + wk[k] * s_ml[(2 * k + 1) * HR + rr]
            inv = cutlass.select_(ll > Float32(0.0), Float32(1.0) / ll, Float32(0.0))
            if rr < H:
                four = cute.make_rmem_tensor((4,), Float32)
                for v4 in cutlass.range_constexpr(NCOL // 4):
                    cc = qq * NCOL + 4 * v4
                    for e in cutlass.range_constexpr(4):
                        acc = Float32(0.0)
                        for k in cutlass.range_constexpr(CL):
                            acc = acc + wk[k] * s_rx[(k * H + rr) * SW + cc + e]
                        four[e] = acc * inv
                    cute.autovec_copy(four, vec(p_o, cute.assume(((b * P + p) * H + rr) * C_LATENT + rank * SW + cc,
                                                                 divby=4), 4))
                if rank == 0:
                    if qq == 0:
                        lse_g = cute.make_tensor(p_lse, cute.make_layout((b * P + p + 1) * H))
                        lse_g[(b * P + p) * H + rr] = cutlass.select_(
                            ll > Float32(0.0), (mref + cute.math.log2(ll)) * LN2, Float32(-float("inf")))
            if cutlass.const_expr(self.pdl):
                cute.arch.griddepcontrol_launch_dependents()

    _KERNEL_CLS = MLADecodeKernel
    return MLADecodeKernel


# ---------------------------------------------------------------------------------------------
# Host wrapper
# ---------------------------------------------------------------------------------------------

_COMPILED: dict[tuple, Any] = {}
_WS: dict[tuple, tuple[torch.Tensor, torch.Tensor]] = {}


class MLADecodeCuteError(ValueError):
    """An argument of the CuTe MLA decode has the wrong type, shape, dtype, layout or device, or a value it does
    not take."""


def _fail(name: str, msg: str):
    raise MLADecodeCuteError(f"mla_decode cute: {name!r} {msg}")


def supports(shape: dict) -> str | None:
    """Why the kernel refuses a shape (None: it runs): one new position (T = 1), at most 16 heads, C = 512 and
    Dr = 64, a bf16 cache, no DCP and no head padding other than to 16 (the kernel always runs 16 rows)."""
    T, H = shape.get("T", 1), shape.get("H", shape.get("heads", 12))
    C, Dr = shape.get("C", C_LATENT), shape.get("Dr", D_ROPE)
    if T != 1:
        return f"T = {T}: one new position only (the verify path is Triton's)"
    if not 1 <= H <= HR:
        return f"{H} heads: 1..{HR} (one MMA tile of 16 rows)"
    if (C, Dr) != (C_LATENT, D_ROPE):
        return f"C = {C}, Dr = {Dr}: the kernel is built for C = {C_LATENT}, Dr = {D_ROPE}"
    if shape.get("kv_dtype", "bf16") != "bf16":
        return f"kv_dtype {shape.get('kv_dtype')!r}: bf16 caches only"
    if shape.get("dcp", 1) != 1:
        return f"dcp = {shape.get('dcp')}: no DCP emulation (Triton's)"
    if shape.get("pad_heads", 0) not in (0, HR):
        return f"pad_heads = {shape.get('pad_heads')}: the kernel pads to {HR} rows itself (0 or {HR})"
    return None


def default_loop(n: int) -> tuple[int, bool]:
    """(stages, pipe) for a history of up to n positions: four stages and the plain loop below LONG_HISTORY, two
    stages (two CTAs an SM) and the pipelined loop from it (H200, profiles/h200/mla_pipe.json.gz (git history at
    cec0131): ahead at 32K, batch 16 and 64; at 8K the plain four-stage loop wins; between 8K and 32K not measured;
    docs/NOTES_mla.md, twenty-fifth session)."""
    return (2, True) if n >= LONG_HISTORY else (4, False)


def default_cluster(B: int) -> int:
    """CTAs a cluster: 4 at batch 1..2, 2 above (H200,
    experiments/mla_cute/h200/mla_cute_partitions_r3.json.gz (git history at 4bf2f43) and mla_cute_batch_r4.json.gz
    there: cluster 4 with 16 clusters the best swept at batch 1 at 8K and 32K; at batch 4..64 cluster 2 ran faster
    than 4 with the same CTAs; docs/NOTES_mla.md, twenty-third session)."""
    return 4 if B <= 2 else 2


def default_partitions(B: int, n_max: int, cluster: int = 4, sms: int | None = None, per_sm: int = 1) -> int:
    """Clusters a sequence: one CTA an SM (at the default four stages a CTA's ~190 KB of shared memory allows no
    second; `per_sm` = ctas_per_sm(...) where two fit) for clusters of 1..2; for clusters of 4 and 8 only half the SMs'
    worth, since not every SM's worth of such clusters is resident at once (H200, batch 1: 33 clusters of 4 or 16 of 8
    ran slower than 16 of 4 or 8 of 8 at 8K and 32K, as a second wave would); and no piece shorter than one chunk of
    32 positions. Two CTAs an SM (two stages, `default_loop` from 16K positions) double the slots."""
    if sms is None:
        sms = (torch.cuda.get_device_properties(torch.cuda.current_device()).multi_processor_count
               if torch.cuda.is_available() else NOMINAL_SMS)
    slots = per_sm * (sms if cluster <= 2 else sms // 2)
    fill = max(1, slots // (B * cluster))
    enough = max(1, -(-max(1, n_max) // (cluster * BN)))
    return int(min(fill, enough, MAX_PARTITIONS))


def workspace(device, B: int, P: int, H: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The partials' buffers (o [B,P,1,H,512], lse [B,P,1,H] fp32), one pair per shape and device (allocate before a
    CUDA-graph capture)."""
    key = (str(device), B, P, H)
    if key not in _WS:
        _WS[key] = (torch.empty(B, P, 1, H, C_LATENT, dtype=torch.float32, device=device),
                    torch.empty(B, P, 1, H, dtype=torch.float32, device=device))
    return _WS[key]


def _tensor(name, t, device, dtypes, dim=None, contiguous=True):
    if not isinstance(t, torch.Tensor):
        _fail(name, f"must be a torch.Tensor, got {type(t).__name__}")
    if t.device.type != "cuda":
        _fail(name, f"must be on a CUDA device, got {t.device}")
    if device is not None and t.device != device:
        _fail(name, f"is on {t.device}, expected {device} (the device of q_lat)")
    if t.dtype not in dtypes:
        _fail(name, f"must have dtype in {[str(x).replace('torch.', '') for x in dtypes]}, got {t.dtype}")
    if dim is not None and t.dim() != dim:
        _fail(name, f"must have {dim} dimensions, got shape {tuple(t.shape)}")
    if contiguous and not t.is_contiguous():
        _fail(name, "must be contiguous")
    return t


def _queries(name, t, device):
    """q_lat / q_rope: bf16 [B, 1, H, *], the last dimension contiguous, batch and head strides multiples of 4 elements
    and the base 8-byte aligned (each lane loads 8 bytes)."""
    _tensor(name, t, device, (torch.bfloat16,), 4, contiguous=False)
    if t.stride(-1) != 1:
        _fail(name, f"must have its last dimension contiguous, got strides {t.stride()}")
    if t.stride(0) % 4 or t.stride(2) % 4 or t.data_ptr() % 8:
        _fail(name, f"must have batch and head strides that are multiples of 4 elements and an 8-byte aligned base "
                    f"(got strides {t.stride()}, address 0x{t.data_ptr():x})")


def mla_decode(q_lat: torch.Tensor, q_rope: torch.Tensor, kv: torch.Tensor, lengths: torch.Tensor,
               o_lat: torch.Tensor | None = None, lse: torch.Tensor | None = None, *, scale: float,
               block_table: torch.Tensor | None = None, partitions: int | None = None, cluster: int | None = None,
               stages: int | None = None, merge: bool = True, pdl: bool | None = None, n_max: int | None = None,
               pipe: bool | None = None):
    """The attention of one new position (module doc). Returns (o_lat, lse), or the partials with merge=False.
    stages / pipe (None: default_loop of the history): the ring's depth and the pipelined chunk loop (module doc)."""
    from k3lab_kernels.triton.pdl import chain_pdl, pdl_on

    if pdl is None:
        pdl = chain_pdl(None)
    if not isinstance(pdl, bool):
        _fail("pdl", f"must be None or a bool, got {pdl!r}")
    _queries("q_lat", q_lat, None)
    dev = q_lat.device
    B, T, H, C = q_lat.shape
    _queries("q_rope", q_rope, dev)
    why = supports(dict(T=T, H=H, C=C, Dr=q_rope.shape[-1]))
    if why:
        _fail("q_lat", f"shape {tuple(q_lat.shape)} / q_rope {tuple(q_rope.shape)}: {why}")
    if tuple(q_rope.shape[:3]) != (B, T, H):
        _fail("q_rope", f"must be [B={B}, 1, H={H}, {D_ROPE}], got {tuple(q_rope.shape)}")
    _tensor("kv", kv, dev, (torch.bfloat16,), 3)
    if kv.shape[-1] != D:
        _fail("kv", f"rows must hold {D} values (512 latent + 64 rope), got {tuple(kv.shape)}")
    if kv.numel() // 2 >= 2 ** 31:
        _fail("kv", f"holds {kv.numel()} values: the kernel indexes rows with 32 bits (< 2^32 values)")
    _tensor("lengths", lengths, dev, (torch.int32, torch.int64), 1)
    if lengths.shape[0] != B:
        _fail("lengths", f"must have B={B} entries, got {tuple(lengths.shape)}")
    paged = block_table is not None
    if paged:
        _tensor("block_table", block_table, dev, (torch.int32,), 2)
        if block_table.shape[0] != B:
            _fail("block_table", f"must be [B={B}, max_pages], got {tuple(block_table.shape)}")
        page = kv.shape[1]
        capacity = block_table.shape[1] * page
    else:
        if kv.shape[0] != B:
            _fail("kv", f"a contiguous cache must be [B={B}, S_max, {D}], got {tuple(kv.shape)}")
        page, capacity = 0, kv.shape[1]
    CL = default_cluster(B) if cluster is None else cluster
    if isinstance(CL, bool) or CL not in CLUSTERS:
        _fail("cluster", f"must be None or one of {CLUSTERS}, got {cluster!r}")
    if n_max is not None and (isinstance(n_max, bool) or not isinstance(n_max, int) or not 1 <= n_max <= capacity):
        _fail("n_max", f"must be None or an int in 1..{capacity} (the cache capacity), got {n_max!r}")
    n = n_max or capacity
    STG = default_loop(n)[0] if stages is None else stages
    if isinstance(STG, bool) or STG not in STAGES_ALLOWED:
        _fail("stages", f"must be None or one of {STAGES_ALLOWED}, got {stages!r}")
    P = default_partitions(B, n, CL, per_sm=ctas_per_sm(CL, STG, H)) if partitions is None else partitions
    if isinstance(P, bool) or not isinstance(P, int) or not 1 <= P <= MAX_PARTITIONS:
        _fail("partitions", f"must be None or an int in 1..{MAX_PARTITIONS} (clusters a sequence), got {partitions!r}")
    if B * P > 65535:
        _fail("partitions", f"B * partitions = {B * P} exceeds the grid's 65535")
    if not isinstance(merge, bool):
        _fail("merge", f"must be a bool, got {merge!r}")
    pipe = default_loop(n)[1] if pipe is None else pipe
    if not isinstance(pipe, bool):
        _fail("pipe", f"must be None or a bool, got {pipe!r}")
    PL = -(-n // (CL * P))
    direct = P == 1 and merge
    for name, t in (("o_lat", o_lat), ("lse", lse)):
        if t is not None:
            if not merge:
                _fail(name, "is for merged results; with merge=False the partials come back in a workspace")
            _tensor(name, t, dev, (torch.float32,))
            want = (B, 1, H, C_LATENT) if name == "o_lat" else (B, 1, H)
            if tuple(t.shape) != want:
                _fail(name, f"must have shape {want}, got {tuple(t.shape)}")
    if direct:
        o_dst = o_lat if o_lat is not None else torch.empty(B, 1, H, C_LATENT, dtype=torch.float32, device=dev)
        l_dst = lse if lse is not None else torch.empty(B, 1, H, dtype=torch.float32, device=dev)
    else:
        o_dst, l_dst = workspace(dev, B, P, H)
    import cutlass

    ls = 2 if lengths.dtype == torch.int64 else 1
    bt = block_table if paged else lengths
    args = [_ptr(q_lat, cutlass.Int32, 8), _ptr(q_rope, cutlass.Int32, 8), _ptr(kv, cutlass.Int32, 16),
            _ptr(bt, cutlass.Int32, 4), _ptr(lengths, cutlass.Int32, 4), _ptr(o_dst, cutlass.Float32, 16),
            _ptr(l_dst, cutlass.Float32, 4)]
    for name, tt in (("kv", kv), ("o", o_dst)):
        if tt.data_ptr() % 16:
            _fail(name, f"base address must be 16-byte aligned (got 0x{tt.data_ptr():x})")
    key = (H, CL, STG, page, ls, pdl, pipe, dev.index)
    with torch.cuda.device(dev):
        import cuda.bindings.driver as cuda

        stream = cuda.CUstream(torch.cuda.current_stream(dev).cuda_stream)
        rt = [cutlass.Int32(B), cutlass.Int32(P), cutlass.Int32(PL),
              cutlass.Int32(block_table.stride(0) if paged else 0), cutlass.Int32(0 if paged else kv.shape[1]),
              cutlass.Int32(q_lat.stride(0) // 2), cutlass.Int32(q_lat.stride(2) // 2),
              cutlass.Int32(q_rope.stride(0) // 2), cutlass.Int32(q_rope.stride(2) // 2),
              cutlass.Float32(float(scale) * LOG2E)]
        fn = _COMPILED.get(key)
        if fn is None:
            from cutlass import cute

            fn = cute.compile(_kernel_class()(H, CL, STG, page, ls, pdl, pipe), *args, *rt, stream)
            _COMPILED[key] = fn
        fn(*args, *rt, stream)
    if direct or not merge:
        return o_dst, l_dst
    from k3lab_kernels.triton.mla_decode import merge_partials

    o_out = o_lat if o_lat is not None else torch.empty(B, 1, H, C_LATENT, dtype=torch.float32, device=dev)
    l_out = lse if lse is not None else torch.empty(B, 1, H, dtype=torch.float32, device=dev)
    merge_partials(o_dst, l_dst, o_out, l_out, pdl=pdl_on(pdl))
    return o_out, l_out
