"""Trunk projections of a few tokens on tensor cores, straight from the stored weights (CuTe DSL): path "mma" of the
cute projection (kernels/cute/proj_gemv.py's `proj(..., path="mma")`), for the batches where the GEMV's fp32 FMAs,
one a weight and token, become the cost (its fp8 form well behind Triton from batch 4: docs/NOTES_trunk.md,
thirty-first session).

    y[b, n] = sum_k x[b, k] W[n, k] (* scale[n])  (+ residual[b, n])   fp32 accumulation, stored in out_i's dtype
    out_i[b, n - start_i] = y[b, n]  for start_i <= n < end_i          (up to MAX_OUTPUTS outputs: a fused group)

Fragments without a copy (kernels/cute/moe_dense.py's grouped kernels): the m16n8k16 MMA's lane (g, t) holds k = 2t,
2t+1, 2t+8, 2t+9 of A rows g, g + 8 and of B column g; a dot product does not care which column a k is, so k-step s
of a chunk of 4 CW columns takes lane t's columns CW t + 4 s .. + 3 of the weight rows and of x alike. One 16-byte
load of a weight row (CW = 8 bf16 or 16 e4m3 columns) is CW / 4 k-steps of A registers: bf16 pairs as stored on bf16
MMAs; e4m3 words widened by cvt.rn.f16x2.e4m3x2 on f16 MMAs, x then rounded to f16 (exact for 2^-17 <= |x| < 65520,
the Triton fp8 path's `f16` range). B is x's row 8 j + g for n-tile j < NT = ceil(B / 8) (a lane past the batch
reads row 0; those columns are never stored).

Grid [C, ceil(N / tile_m)]: a tile of tile_m = 16 RG output rows is one cluster of C CTAs of four warps; warp w
takes row group w % RG (MMA rows g, g + 8 = rows 16 (m RG + w % RG) + g, + 8; rows past N re-read row N - 1 and are
not stored) and K part w // RG of its CTA, so the RG warps of a part read the same x columns (L1 hits after the
first) and the tile's NCH = K / (4 CW) chunks are cut into C KW contiguous ranges (KW = 4 / RG; rank r, part p:
range KW r + p). A warp takes its range in rounds of UNROLL chunks (the weights' loads of a round issued before its
MMAs, the round's MMAs over CHAINS independent accumulators; the last round's chunks past the range re-read the
range's last chunk with x zeroed, so every round has UNROLL loads in flight). x (X_SMEM, the default): after the pdl
wait one thread bulk-copies the CTA's columns of every token row into shared memory (one mbarrier) while the first
round's weights stream, and the rounds read it with LDS. The warps' fragments meet in shared memory (thread i sums
element i over its row group's KW warps in order), the cluster's at rank 0 through distributed shared memory (one
cluster barrier; rank 0 adds the ranks in order): deterministic, no atomics, no workspace. Rank 0's threads apply the
row scale (fp8) and the residual and store. tile_m and C (`tile_m`, `cluster`; None: `plan`,
the largest tile with the smallest cluster giving MIN_CTAS_PER_SM CTAs an SM). pdl: a warp loads its first round's
weights, then waits (griddepcontrol.wait) before it reads x or the residual.

Layout: x [B, K] bf16, unit stride along K, a row stride of 8 elements, 16-byte aligned; W [N, K] bf16 or
float8_e4m3fn (one fp32 scale a row, w_scale [N]) contiguous, K a multiple of 4 CW (32 bf16, 64 fp8 columns);
outputs [B, N_i] bf16 or fp32 with unit inner stride (any row stride); a residual [B, N] bf16 contiguous (one output).

Floor (k3lab.ops.trunk.proj_bytes): the weights N K e (+ 4 N scale bytes) + x + outputs (+ residual) at the read
bandwidth. Measured against the GEMV, Triton and cuBLAS in docs/NOTES_trunk.md (thirty-sixth session): ahead only with
fp8 weights at few outputs (mla_dkv); not in the `auto` rule.

Contract: proj_mma(x, w, outs, *, residual=None, w_scale=None, pdl=None, cluster=None, tile_m=None) -> outs on
torch's current stream, CUDA-graph safe once a shape has compiled; pdl None: the enclosing pdl_chain's setting.
"""
from typing import Any

import torch

from .proj_gemv import MAX_OUTPUTS, _fail, check_args

MAX_BATCH = 16
UNROLL = 4        # chunks a warp's round: their loads issued before their MMAs
CHAINS = 2        # independent accumulator chains a warp and n-tile (k-steps taken round-robin, summed at the end)
CLUSTERS = (1, 2, 4, 8)
TILES_M = (16, 32, 64)  # output rows a CTA: its four warps over 1, 2 or 4 row groups of 16 (the rest split K)
MIN_CTAS_PER_SM = 2     # the automatic (tile_m, cluster): at least this many CTAs an SM where the chunks allow
# x's columns of the CTA's K range staged in shared memory by one bulk copy a token row (one mbarrier), read from
# there by every warp: x's loads no longer wait on L2 round trips in the rounds. On: the form the path was timed in
# (docs/NOTES_trunk.md, thirty-sixth and fifty-second sections) and the cleaner one in the offline SASS (the weights'
# loads of a round together, x by LDS, 72 registers at fp8 / 8 tokens against 80); off (x from global memory in the
# rounds) is not timed
X_SMEM = True
_WARPS = 4
_THREADS = 32 * _WARPS
SMEM_LIMIT = 232448  # a CTA's shared memory on sm_90 (227 KB): x staged for 16 tokens of K = 7168 in a cluster of one
                     # needs 235528 bytes (the H200 refused that launch: docs/NOTES_trunk.md, thirty-sixth session)
# a word of two bf16 (the low half the lower column) -> the same two values as f16x2 (round to nearest even)
BF16_F16_PTX = "\n".join(["{", ".reg .b32 a, b;", "shl.b32 a, $1, 16;", "and.b32 b, $1, 0xFFFF0000;",
                          "cvt.rn.f16x2.f32 $0, b, a;", "}"])

__all__ = ["CLUSTERS", "MAX_BATCH", "TILES_M", "plan", "proj_mma", "sm_count"]

_KERNEL_CLS = None


def _kernel_class():
    """The kernel's generator (built once; importing this module never needs cutlass)."""
    global _KERNEL_CLS
    if _KERNEL_CLS is not None:
        return _KERNEL_CLS
    import cuda.bindings.driver as cuda
    import cutlass
    from cutlass import Float32, Int32, cute
    from cutlass.cutlass_dsl import dsl_user_op

    from . import kda_decode, moe_dense as md

    md._grouped_classes()
    mo = md.MMA_OPS
    st_cluster_f32, bulk_load = kda_decode._dsl().st_cluster_f32, kda_decode._dsl().bulk_load

    def vec(ptr, off, n):
        return cute.make_tensor(ptr + off, cute.make_layout(n))

    @dsl_user_op
    def bf16_f16(w, *, loc=None, ip=None):
        return Int32(mo.asm(Int32.mlir_type, [Int32(w).ir_value(loc=loc, ip=ip)], BF16_F16_PTX, "=r,r", loc, ip))

    class ProjMma:
        """A cluster of C CTAs (four warps each) per tile of 16 output rows, split along K."""

        def __init__(self, B: int, N: int, K: int, ends: tuple, residual: bool, pdl: bool, fp8: bool, C: int,
                     unroll: int, chains: int, tile_m: int = 16, x_smem: bool = False):
            self.B, self.N, self.K, self.ends = B, N, K, tuple(int(e) for e in ends)
            self.residual, self.pdl, self.fp8, self.C = bool(residual), bool(pdl), bool(fp8), C
            self.CW = 16 if self.fp8 else 8          # columns a lane's 16-byte load of a row
            self.NCH = K // (4 * self.CW)            # chunks of 4 CW columns a row
            self.NT = (B + 7) // 8                   # n-tiles of 8 tokens
            self.RG = tile_m // 16                   # row groups of 16 a CTA (warp w: row group w % RG)
            self.KW = _WARPS // self.RG              # K parts a CTA (warp w: part w // RG)
            self.T = (N + tile_m - 1) // tile_m      # tiles of tile_m output rows
            self.WR = K * (1 if self.fp8 else 2) // 4  # int32 words a weight row
            self.NE = 128 * self.NT                  # fragment elements a tile: 4 a lane and n-tile
            self.UNR, self.CH, self.x_smem = unroll, chains, bool(x_smem)
            # X_SMEM: a staged token row's words (the CTA's at most ceil(NCH / C) chunks, 2 CW words each), padded by
            # 16 words so that rows g and g + 1 fall in different bank halves
            self.XS = -(-self.NCH // C) * 2 * self.CW + 16
            assert 1 <= B <= MAX_BATCH and K % (4 * self.CW) == 0 and C in CLUSTERS and tile_m in TILES_M
            assert 1 <= len(self.ends) <= MAX_OUTPUTS and self.ends[-1] == N

        @cute.jit
        def __call__(self, p_x: cute.Pointer, p_w: cute.Pointer, p_scale: cute.Pointer, p_res: cute.Pointer,
                     p_o0: cute.Pointer, p_o1: cute.Pointer, p_o2: cute.Pointer, p_o3: cute.Pointer,
                     p_o4: cute.Pointer, p_o5: cute.Pointer, s_x: Int32, s_o0: Int32, s_o1: Int32, s_o2: Int32,
                     s_o3: Int32, s_o4: Int32, s_o5: Int32, stream: cuda.CUstream):
            cluster = {} if self.C == 1 else {"cluster": [self.C, 1, 1]}
            self.kernel(p_x, p_w, p_scale, p_res, p_o0, p_o1, p_o2, p_o3, p_o4, p_o5, s_x, s_o0, s_o1, s_o2, s_o3,
                        s_o4, s_o5).launch(grid=[self.C, self.T, 1], block=[_THREADS, 1, 1], stream=stream,
                                           use_pdl=self.pdl, **cluster)

        def load_w(self, p_w, wv, u, ra, rb, c, t):
            """Chunk c of rows ra (MMA row g) and rb (g + 8): this lane's 16 bytes of each into wv[8 u ..]."""
            for h in range(2):
                off = cute.assume((ra if h == 0 else rb) * self.WR + 16 * c + 4 * t, divby=4)
                cute.autovec_copy(vec(p_w, off, 4), cute.make_tensor(wv.iterator + 8 * u + 4 * h, cute.make_layout(4)))

        def load_x(self, p_x, xv, u, xrow, c, t, valid):
            """Chunk c of each n-tile's x row (words from xrow[j] of p_x: global memory, or the staged rows with c
            counted from the CTA's first chunk): this lane's CW columns into xv (CW / 2 words an n-tile and chunk),
            zeros where not `valid` (a round's chunk past the warp's range: its MMAs add 0)."""
            XW = self.CW // 2
            for j in range(self.NT):
                base = (u * self.NT + j) * XW
                for h in range(XW // 4):
                    off = cute.assume(xrow[j] + (2 * self.CW) * c + XW * t + 4 * h, divby=4)
                    cute.autovec_copy(vec(p_x, off, 4), cute.make_tensor(xv.iterator + base + 4 * h,
                                                                         cute.make_layout(4)))
                for k in range(XW):
                    xv[base + k] = cutlass.select_(valid, xv[base + k], Int32(0))

        def round_mma(self, wv, xv, acc, n_chunks):
            """The MMAs of n_chunks loaded chunks: k-step s of chunk u into chain (u KS + s) % CHAINS. (The helpers are
            plain Python, unrolled when traced: the DSL's preprocessor reads only the kernel's own body.)"""
            KS, XW, NT = self.CW // 4, self.CW // 2, self.NT
            mma = mo.mma["f16" if self.fp8 else "bf16"]
            for u in range(n_chunks):
                for s in range(KS):
                    pa = mo.a_pairs(self.fp8, wv, 8 * u, s)
                    pb = mo.a_pairs(self.fp8, wv, 8 * u + 4, s)
                    for j in range(NT):
                        b0 = xv[(u * NT + j) * XW + 2 * s]
                        b1 = xv[(u * NT + j) * XW + 2 * s + 1]
                        if self.fp8:
                            b0, b1 = bf16_f16(b0), bf16_f16(b1)
                        k0 = 4 * (j * self.CH + (u * KS + s) % self.CH)
                        d = mma(pa[0], pb[0], pa[1], pb[1], b0, b1, acc[k0], acc[k0 + 1], acc[k0 + 2], acc[k0 + 3])
                        for v in range(4):
                            acc[k0 + v] = d[v]

        @cute.kernel
        def kernel(self, p_x: cute.Pointer, p_w: cute.Pointer, p_scale: cute.Pointer, p_res: cute.Pointer,
                   p_o0: cute.Pointer, p_o1: cute.Pointer, p_o2: cute.Pointer, p_o3: cute.Pointer,
                   p_o4: cute.Pointer, p_o5: cute.Pointer, s_x: Int32, s_o0: Int32, s_o1: Int32, s_o2: Int32,
                   s_o3: Int32, s_o4: Int32, s_o5: Int32):
            B, N, C, NT, NE, UNR, RG, KW = self.B, self.N, self.C, self.NT, self.NE, self.UNR, self.RG, self.KW
            tid, _, _ = cute.arch.thread_idx()
            rank, m, _ = cute.arch.block_idx()  # grid x = the cluster: the CTA's rank in it; y = the tile
            warp = cute.arch.make_warp_uniform(cute.arch.warp_idx())
            lane = tid % 32
            g = lane // 4
            t = lane % 4
            smem = cutlass.memory.SmemAllocator()
            s_red = smem.allocate_tensor(Float32, cute.make_layout(_WARPS * NE), byte_alignment=16)
            s_clu = smem.allocate_tensor(Float32, cute.make_layout(max(C - 1, 1) * RG * NE), byte_alignment=16)
            if cutlass.const_expr(self.x_smem):
                s_xs = smem.allocate_tensor(Int32, cute.make_layout(B * self.XS), byte_alignment=128)  # x staged
                mbar = smem.allocate_array(cutlass.Int64, 1, byte_alignment=8)
                if tid == 0:
                    cute.arch.mbarrier_init(mbar, 1)
                    cute.arch.mbarrier_init_fence()
                cute.arch.sync_threads()
            if cutlass.const_expr(C > 1):
                cute.arch.cluster_arrive_relaxed()  # the peers' shared memory must exist before DSMEM stores
            rg = warp % RG                       # this warp's row group, and its K part among the cluster's C KW
            q = rank * KW + warp // RG
            lo = q * self.NCH // (C * KW)        # this warp's chunks [lo, hi)
            hi = (q + 1) * self.NCH // (C * KW)
            nround = (hi - lo + UNR - 1) // UNR  # rounds of UNR chunks; the last one's chunks past hi add 0
            ra = 16 * (m * RG + rg) + g          # MMA rows g and g + 8; past N: row N - 1, never stored
            rb = ra + 8
            ra = cutlass.select_(ra < N, ra, Int32(N - 1))
            rb = cutlass.select_(rb < N, rb, Int32(N - 1))
            xrow = []                            # n-tile j's x row 8 j + g in words (past the batch: row 0)
            for j in cutlass.range_constexpr(NT):
                tok = 8 * j + g
                xrow.append(cutlass.select_(tok < B, tok, Int32(0)) * (self.XS if self.x_smem else s_x // 2))
            acc = cute.make_rmem_tensor((4 * NT * self.CH,), Float32)
            acc.fill(0.0)
            wv = cute.make_rmem_tensor((8 * UNR,), Int32)
            xv = cute.make_rmem_tensor((UNR * NT * (self.CW // 2),), Int32)
            last = hi - 1                        # a round's chunks past the range re-read the last one
            if cutlass.const_expr(self.pdl):
                if nround > 0:                   # the first round's weights before the wait: W is no kernel's output
                    for u in cutlass.range_constexpr(UNR):
                        self.load_w(p_w, wv, u, ra, rb, cutlass.select_(lo + u < hi, lo + u, last), t)
                cute.arch.griddepcontrol_wait()  # x (and the residual) come from the kernel before
                cute.arch.griddepcontrol_launch_dependents()
            xsrc, xoff = p_x, Int32(0)           # where x's chunks are read, and the chunk they count from
            if cutlass.const_expr(self.x_smem):  # the CTA's chunks [c_lo, c_hi) of every token row, one bulk copy each
                c_lo = rank * self.NCH // C
                nb = (rank + 1) * self.NCH // C * (8 * self.CW) - c_lo * (8 * self.CW)
                if tid == 0:
                    cute.arch.mbarrier_arrive_and_expect_tx(mbar, self.B * nb)
                    if nb > 0:
                        for bb in cutlass.range_constexpr(self.B):
                            bulk_load(s_xs.iterator + bb * self.XS, p_x + (bb * (s_x // 2) + c_lo * 2 * self.CW), mbar,
                                      nb)
                ok = cute.arch.mbarrier_test_wait(mbar, 0)
                while not ok:
                    ok = cute.arch.mbarrier_test_wait(mbar, 0)
                xsrc, xoff = s_xs.iterator, c_lo
            for i in cutlass.range(nround, unroll=1):
                c0 = lo + i * UNR
                if cutlass.const_expr(self.pdl):
                    if i > 0:
                        for u in cutlass.range_constexpr(UNR):
                            self.load_w(p_w, wv, u, ra, rb, cutlass.select_(c0 + u < hi, c0 + u, last), t)
                else:
                    for u in cutlass.range_constexpr(UNR):
                        self.load_w(p_w, wv, u, ra, rb, cutlass.select_(c0 + u < hi, c0 + u, last), t)
                for u in cutlass.range_constexpr(UNR):
                    self.load_x(xsrc, xv, u, xrow, cutlass.select_(c0 + u < hi, c0 + u, last) - xoff, t,
                                c0 + u < hi)
                self.round_mma(wv, xv, acc, UNR)
            # the chains summed; fragment element (4 j + v) 32 + lane into this warp's slot
            for j in cutlass.range_constexpr(NT):
                for v in cutlass.range_constexpr(4):
                    a = acc[4 * j * self.CH + v]
                    for k in cutlass.range_constexpr(1, self.CH):
                        a = a + acc[4 * (j * self.CH + k) + v]
                    s_red[warp * NE + (4 * j + v) * 32 + lane] = a
            cute.arch.sync_threads()
            # thread tid: element tid + 128 i of the CTA, i = rg NT + j (row group rg, n-tile j; v = warp), summed
            # over the KW warps of its row group in order
            tot = cute.make_rmem_tensor((RG * NT,), Float32)
            for i in cutlass.range_constexpr(RG * NT):
                a = s_red[(i // NT) * NE + 128 * (i % NT) + tid]
                for kw in cutlass.range_constexpr(1, KW):
                    a = a + s_red[(kw * RG + i // NT) * NE + 128 * (i % NT) + tid]
                tot[i] = a
            if cutlass.const_expr(C > 1):
                cute.arch.cluster_wait()         # every peer has started
                if rank > 0:
                    for i in cutlass.range_constexpr(RG * NT):
                        st_cluster_f32(s_clu.iterator + (((rank - 1) * RG * NT + i) * 128 + tid), 0, tot[i])
                cute.arch.cluster_arrive()
                cute.arch.cluster_wait()
            if rank == 0:
                outs = (p_o0, p_o1, p_o2, p_o3, p_o4, p_o5)
                strides = (s_o0, s_o1, s_o2, s_o3, s_o4, s_o5)
                for i in cutlass.range_constexpr(RG * NT):
                    j = i % NT
                    row = 16 * (m * RG + i // NT) + g + 8 * (warp // 2)
                    y = tot[i]
                    for r in cutlass.range_constexpr(1, C):
                        y = y + s_clu[((r - 1) * RG * NT + i) * 128 + tid]
                    b = 8 * j + 2 * t + warp % 2
                    if row < N:
                        if b < B:
                            if cutlass.const_expr(self.fp8):  # W_true[n, :] = W_e4m3[n, :] scale[n]
                                y = y * vec(p_scale, row, 1)[0]
                            if cutlass.const_expr(self.residual):
                                y = y + vec(p_res, b * N + row, 1)[0].to(Float32)
                            for o in cutlass.range_constexpr(len(self.ends)):
                                lo_o = 0 if o == 0 else self.ends[o - 1]
                                if row >= lo_o:
                                    if row < self.ends[o]:
                                        vec(outs[o], b * strides[o] + row - lo_o, 1)[0] = y.to(outs[o].dtype)

    _KERNEL_CLS = ProjMma
    return _KERNEL_CLS


# ---------------------------------------------------------------------------------------------
# Host wrapper
# ---------------------------------------------------------------------------------------------

_COMPILED: dict[tuple, Any] = {}
_SMS: dict[int, int] = {}  # per device index: its SM count (for plan)


def sm_count(dev: torch.device) -> int:
    """The device's SM count, asked once a device (what `plan` sizes the grid by; the component's record asks it
    too)."""
    n = _SMS.get(dev.index)
    if n is None:
        n = _SMS[dev.index] = torch.cuda.get_device_properties(dev).multi_processor_count
    return n


def smem_bytes(B: int, K: int, fp8: bool, tile_m: int, cluster: int, x_smem: bool | None = None) -> int:
    """A CTA's shared memory (the kernel's allocations in order, each aligned): the warps' fragments, the cluster's
    slots and (X_SMEM) x's columns of the CTA's K range for every token row, then its mbarrier."""
    x_smem = X_SMEM if x_smem is None else x_smem
    cw = 16 if fp8 else 8
    ne = 128 * ((B + 7) // 8)

    def at(off, a):
        return -(-off // a) * a

    off = at(0, 16) + 4 * _WARPS * ne
    off = at(off, 16) + 4 * max(cluster - 1, 1) * (tile_m // 16) * ne
    if x_smem:
        off = at(off, 128) + 4 * B * (-(-(K // (4 * cw)) // cluster) * 2 * cw + 16)
        off = at(off, 8) + 8
    return off


def plan(N: int, K: int, fp8: bool, sms: int, tile_m: int | None = None, cluster: int | None = None,
         B: int = 1) -> tuple:
    """(tile_m, cluster) for a call of B tokens, None chosen: the largest tile (the most warps reading the same x
    columns from L1) with the smallest cluster that gives MIN_CTAS_PER_SM CTAs an SM with a chunk a warp; where none
    does, the most CTAs (ties: the larger tile, the smaller cluster). A cluster of one always fits the chunks (warps
    past them add nothing); every choice fits a CTA's shared memory (SMEM_LIMIT: x staged for B tokens)."""
    nch = K // (64 if fp8 else 32)
    cands = [(tm, c) for tm in (TILES_M[::-1] if tile_m is None else (tile_m,))
             for c in (CLUSTERS if cluster is None else (cluster,)) if (c == 1 or 4 // (tm // 16) * c <= nch)
             and smem_bytes(B, K, fp8, tm, c) <= SMEM_LIMIT]
    if not cands:  # both given: take them as they are
        return tile_m, cluster
    ctas = {tc: (N + tc[0] - 1) // tc[0] * tc[1] for tc in cands}
    enough = [tc for tc in cands if ctas[tc] >= MIN_CTAS_PER_SM * sms]
    if enough:
        return enough[0]
    return max(cands, key=lambda tc: (ctas[tc], tc[0], -tc[1]))


def proj_mma(x, w, outs, *, residual=None, w_scale=None, pdl=None, cluster=None, tile_m=None):
    """outs[i] = x W_i^T (* w_scale) (+ residual) over the row ranges of w on tensor cores (module doc). Returns outs.
    Arguments are checked by name (ProjGemvError)."""
    import cutlass

    from .kda_decode import gmem_ptr

    pdl, B, K, N, fp8, ends = check_args(x, w, w_scale, outs, residual, pdl, kq=(32, 64), path=" for path 'mma'")
    dev = x.device
    if cluster is not None and (isinstance(cluster, bool) or cluster not in CLUSTERS):
        _fail("cluster", f"must be None or one of {CLUSTERS}, got {cluster!r}")
    if tile_m is not None and (isinstance(tile_m, bool) or tile_m not in TILES_M):
        _fail("tile_m", f"must be None or one of {TILES_M}, got {tile_m!r}")
    tile_m, cluster = plan(N, K, fp8, sm_count(dev), tile_m, cluster, B)
    need = smem_bytes(B, K, fp8, tile_m, cluster)
    if need > SMEM_LIMIT:
        _fail("cluster", f"={cluster} with tile_m={tile_m} stages x for {B} tokens of K={K} in {need} bytes of shared "
                         f"memory, more than a CTA's {SMEM_LIMIT}: take a larger cluster (or None)")
    pad = list(outs) + [outs[0]] * (MAX_OUTPUTS - len(outs))  # pointers past the outputs given: never written
    o_dt = {torch.float32: cutlass.Float32, torch.bfloat16: cutlass.BFloat16}
    I32, F32 = cutlass.Int32, cutlass.Float32
    args = [gmem_ptr(x.view(torch.int32), I32, 16), gmem_ptr(w.view(torch.int32), I32, 16),
            gmem_ptr(w_scale if fp8 else x, F32, 4),  # x: never read as the scales without fp8 weights
            gmem_ptr(residual if residual is not None else x, cutlass.BFloat16, 2),
            *[gmem_ptr(o, o_dt[o.dtype], o.element_size()) for o in pad], x.stride(0), *[o.stride(0) for o in pad]]
    key = (B, N, K, tuple(ends), tuple(o.dtype for o in outs), residual is not None, pdl, fp8, cluster, tile_m,
           UNROLL, CHAINS, X_SMEM, dev.index)
    with torch.cuda.device(dev):
        import cuda.bindings.driver as cuda

        stream = cuda.CUstream(torch.cuda.current_stream(dev).cuda_stream)
        fn = _COMPILED.get(key)
        if fn is None:
            from cutlass import cute

            fn = cute.compile(_kernel_class()(B, N, K, tuple(ends), residual is not None, pdl, fp8, cluster, UNROLL,
                                              CHAINS, tile_m, X_SMEM), *args, stream)
            _COMPILED[key] = fn
        fn(*args, stream)
    return outs
