"""AttnRes + RMSNorm as one CuTe DSL launch: the partial-sum update, the softmax mix over the block list and
the partial, and the RMSNorm of the mix (k3lab.ref.attnres; the update modes of kernels/triton/attnres_norm.py).

    p       = prefix | bf16(prefix + new) | new          update "none" | "add" | "fresh" (written to partial_out)
    score_i = dot(s_i, w_norm * w_proj) / sqrt(mean(s_i^2) + eps)   over s = blocks + [p] (NS = n_blocks + 1)
    alpha   = softmax(score);  mix = sum_i alpha_i s_i (fp32, registers only)
    out     = mix / sqrt(mean(mix^2) + eps) * norm_w                  (bf16, rounded once)

"add" rounds the fp32 sum of the two bf16 values once to nearest even (torch's bf16 add: the same bits), and
the mix reads that rounded p, as the layer reference does.

Layout. One thread-block cluster of `cluster` CTAs per row (grid [cluster, B], portable size <= 8); CTA rank r
owns the columns [r W, (r + 1) W), W = D / cluster, and its thread t the `vec` contiguous columns r W + t vec
(one vector load per source: 16 B at vec 8). THREADS = W / vec rounded up to a warp (and to at least the K
partial sums below); threads past W / vec load nothing and hold zeros. Every source is read once, into
registers; nothing but out and partial_out is written.

The two full-row reductions (the scores' sums, then the mix's sum of squares) become ONE exchange: every sum
the row needs is a sum of per-thread partials over its columns, sw_i = sum s_i w and the Gram matrix
G_ij = sum s_i s_j (i <= j; G_ii is the score's sum of squares and sum mix^2 = alpha^T G alpha), K = NS +
NS (NS + 1) / 2 values (65 at 9 blocks, 2 at none):
  1. each thread stores its K partials into shared memory column-wise ([K][THREADS + 4]: conflict-free
     stores and 16-byte row reads); CTA barrier;
  2. thread k < K sums row k over the CTA's threads and stores it into slot [rank][k] of every CTA of the
     cluster (st.shared::cluster through mapa); one cluster barrier (arrive.release / wait.acquire);
  3. thread k < K sums the cluster's slots in rank order: every CTA of a row gets the same fp32 totals and so
     the same alpha and norm (deterministic); CTA barrier;
  4. every thread reads the K totals, forms alpha and 1 / rms(mix), and writes its columns of out from the
     sources still in its registers (alpha "threads": the K totals held in registers beside the NS x vec
     sources, at 9 blocks about NS vec + K + 18 registers). (git history at 9add8c8: alpha "warp", warp 0 alone
     forming alpha and the norm from the Gram totals, slower than "twopass" at every batch measured on the H200:
     docs/NOTES_trunk.md, thirty-sixth session.)
alpha "twopass" trades the Gram matrix for a second exchange (for large batches, where the SM's issue rate and not
the exchange's latency bounds the kernel): K = 2 NS partials (sw_i and sum s_i^2), each partial row summed by L lanes
(`row_lanes`: 16 at 448 threads) joined by a butterfly, one cluster exchange, warp 0 forms alpha; every thread then
mixes its columns (kept in registers), their sum of squares goes through a butterfly a warp, the warps' sums in order
and a second cluster exchange (thread r < C stores into CTA r's slot [rank]; every CTA sums the slots in rank order).
Offline at cluster 2 vec 8 (448 threads): 896 SASS instructions a thread against 1,968 with the Gram matrix, 124
registers, 36 KB of shared memory instead of 118; cluster 8 vec 4: 720 against 1,336, 66 registers (four CTAs an SM).
A first relaxed cluster arrive at entry, waited for before step 2, keeps the DSMEM stores behind every peer's
start. Numerics: alpha^T G alpha equals sum mix^2 up to the fp32 rounding of the partial sums (the Triton
split path's argument; checked against fp64 with the output tolerance 4e-3).

Options: cluster (1, 2, 4, 8; None: the largest that fits D, 8 at D = 7168, at every batch: unmeasured), vec
(1, 2, 4, 8; None: the widest the alignment allows that fills whole warps, else the widest) and alpha
("threads", "twopass"; None = "twopass", the fastest at every batch measured alone on the H200: docs/NOTES_trunk.md,
thirty-sixth session; inside the decode step "threads" may lead: the thirty-seventh session's A/B fold
`attnres_form` decides).
D = 7168 takes cluster 8 with vec 2 / 4 / 8 (448 / 224 / 128 threads a CTA) and cluster 4 with vec 4 / 8 (448 /
224), and with alpha "twopass" also cluster 2 vec 8 (448).
Registers at 9 blocks (sm_90a): 104 / 123 / 168 at vec 2 / 4 / 8 with "threads", so there vec 8 is capped at 256
threads (MAX_THREADS_VEC: cluster 2 vec 8, 448 threads, spilled); 124-126 at vec 8 with "twopass" (no spills at
448 threads: MAX_THREADS_VEC_TWOPASS). Refused with the argument named: D not a multiple of cluster * vec, more
threads a CTA than allowed (cluster 1 at D = 7168, cluster 2 with "threads"), a vec the pointers or row strides
do not align to, an alpha not in ALPHAS.

Floor (bytes, k3lab.ops.trunk.attnres_bytes): sources (n + 1 + [add]) * B * D * 2 + the three weight vectors +
out B*D*2 (+ partial_out B*D*2) at the read bandwidth: 9 blocks, "add", batch 1: 0.19 MB (latency-bound);
batch 64: 10.1 MB = 2.2 us at 4.6 TB/s.

Contract (torch tensors on one CUDA device, torch's current stream, CUDA-graph safe once a shape has compiled;
compiled once per (n_blocks, update, D, cluster, vec, alpha, eps): the batch and the row strides are runtime
values):

    attnres_norm(blocks, prefix, new, w_norm, w_proj, norm_w, out, partial_out, *, update="none", eps=1e-6,
                 cluster=None, vec=None, alpha=None, pdl=None) -> out

pdl (None: the enclosing k3lab_kernels.triton.pdl.pdl_chain's setting, the decode step's `pdl` switch):
launched with programmatic dependent launch, each CTA loads the three weight vectors, waits for the previous
kernel (griddepcontrol.wait: it wrote the sources), lets the next one launch, then loads the sources. With the
module setting EARLY (on) the blocks and the prefix load before the wait too and the blocks' partial sums are formed
there; only `new` waits (its precondition: below, at EARLY).

blocks: 0..MAX_BLOCKS bf16 [B, D] (each its own row stride, unit stride along D); prefix [B, D] (unused for
"fresh"); new [B, D] (None for "none"); partial_out [B, D] for "add" / "fresh" (may be prefix itself); out
[B, D]; w_norm, w_proj, norm_w bf16 [D] contiguous. All bf16.
"""
from typing import Any

import torch

MAX_BLOCKS = 9
UPDATES = ("none", "add", "fresh")
ALPHAS = ("threads", "twopass")
CLUSTERS = (1, 2, 4, 8)
VECS = (1, 2, 4, 8)
MAX_THREADS = 512  # a CTA's threads (shared memory: K x (threads + 4) fp32 partials, 134 KB at 512 and 9 blocks)
# vec 8 takes 168 registers a thread at 9 blocks (compile_offline --only attnres): at most 256 threads (448 spill)
MAX_THREADS_VEC = {1: MAX_THREADS, 2: MAX_THREADS, 4: MAX_THREADS, 8: 256}
# alpha "twopass": 124-126 registers at vec 8 (no K totals in registers), so 448 threads compile without spills
MAX_THREADS_VEC_TWOPASS = {1: MAX_THREADS, 2: MAX_THREADS, 4: MAX_THREADS, 8: MAX_THREADS}
# under pdl, also read the blocks and the prefix before griddepcontrol.wait and form the blocks' partial sums there
# (only `new` after it). Valid where neither was written by the kernel launched just before: in the decode step's pdl
# chain they are written two or more kernels back, and every kernel of the chain lets the next launch only after its
# own wait, so those writers have completed. The batch-1 step faster, outputs bit-identical (docs/NOTES_step.md,
# thirty-first session); without pdl it changes nothing.
EARLY = True

__all__ = ["ALPHAS", "CLUSTERS", "MAX_BLOCKS", "VECS", "attnres_norm", "plan"]


class AttnResCuteError(ValueError):
    """An argument the CuTe AttnRes kernel cannot take (the message names it)."""


def _ceil(x: int, m: int) -> int:
    return -(-x // m) * m


def n_partials(n_blocks: int, alpha: str | None = None) -> int:
    """K: the per-thread partial sums of a row exchanged at once: sw_i and the Gram matrix's upper triangle over NS
    sources (alpha "threads"; also None here), or (alpha "twopass") sw_i and sum s_i^2 only."""
    ns = n_blocks + 1
    return 2 * ns if alpha == "twopass" else ns + ns * (ns + 1) // 2


def threads(D: int, n_blocks: int, cluster: int, vec: int, alpha: str | None = None) -> int:
    return max(_ceil(D // (cluster * vec), 32), _ceil(n_partials(n_blocks, alpha), 32))


def row_lanes(T: int, K: int) -> int:
    """alpha "twopass": the lanes that sum one of the K partial rows of a CTA of T threads (a power of two <= 16
    dividing T / 4, L * K <= T): each reads T / L of the row's entries, 4 at a time, and a butterfly joins them."""
    return next(L for L in (16, 8, 4, 2, 1) if L * K <= T and T % (4 * L) == 0)


def plan(B: int, D: int, n_blocks: int, cluster: int | None = None, vec: int | None = None,
         align: int = 16, alpha: str | None = None) -> tuple[int, int]:
    """(cluster, vec) for a call: the given values checked, None chosen (module doc). `align`: the bytes every
    source / output pointer and row stride is a multiple of (bounds vec); `alpha` (None = "twopass") sets the
    threads a CTA vec 8 may take."""
    if alpha is not None and alpha not in ALPHAS:
        raise AttnResCuteError(f"attnres cute: 'alpha' must be one of {ALPHAS} or None, got {alpha!r}")
    caps = MAX_THREADS_VEC if alpha == "threads" else MAX_THREADS_VEC_TWOPASS
    if cluster is not None and (isinstance(cluster, bool) or cluster not in CLUSTERS):
        raise AttnResCuteError(f"attnres cute: 'cluster' must be one of {CLUSTERS} or None, got {cluster!r}")
    if vec is not None and (isinstance(vec, bool) or vec not in VECS):
        raise AttnResCuteError(f"attnres cute: 'vec' must be one of {VECS} or None, got {vec!r}")
    if cluster is None:
        cands = [c for c in (8, 4, 2, 1) if D % c == 0]
        cluster = next((c for c in cands if any(D % (c * v) == 0 and D // (c * v) <= caps[v]
                                                for v in VECS if 2 * v <= align)), None)
        if cluster is None:
            raise AttnResCuteError(f"attnres cute: 'dim' D={D} fits no cluster of {CLUSTERS} (needs D divisible by "
                                   f"the cluster and at most {MAX_THREADS} threads a CTA)")
        given = "dim"
    else:
        given = "cluster"
    if D % cluster:
        raise AttnResCuteError(f"attnres cute: 'cluster'={cluster} does not divide 'dim' D={D}")
    W = D // cluster
    if vec is None:
        ok = [v for v in VECS if W % v == 0 and 2 * v <= align and W // v <= caps[v]]
        if not ok:
            raise AttnResCuteError(f"attnres cute: {given!r}: D={D} with cluster={cluster} fits no vec of {VECS} "
                                   f"(at most {MAX_THREADS} threads a CTA, {caps[8]} at vec 8; "
                                   f"{align}-byte aligned tensors)")
        vec = max(ok, key=lambda v: ((W // v) % 32 == 0, v))
    if 2 * vec > align:
        raise AttnResCuteError(f"attnres cute: 'vec'={vec} needs {2 * vec}-byte aligned tensors and row strides; "
                               f"these are {align}-byte aligned")
    if W % vec:
        raise AttnResCuteError(f"attnres cute: 'dim' D={D} is not a multiple of cluster * vec = {cluster * vec}")
    if W // vec > caps[vec]:
        raise AttnResCuteError(f"attnres cute: 'cluster'={cluster} with vec={vec} needs {W // vec} threads a CTA "
                               f"at D={D} (at most {caps[vec]} at vec {vec} with alpha "
                               f"{alpha or 'twopass'!r}): take another cluster or vec")
    return cluster, vec


# ---------------------------------------------------------------------------------------------
# The kernel (built lazily so importing this module never needs cutlass)
# ---------------------------------------------------------------------------------------------

_KERNEL_CLS = None


def _kernel_class():
    """The AttnRes + RMSNorm generator (built once)."""
    global _KERNEL_CLS
    if _KERNEL_CLS is not None:
        return _KERNEL_CLS
    from . import kda_decode

    d = kda_decode._dsl()  # the CuTe modules and the shared device helpers (vec, st_cluster_f32)
    cuda, cutlass, Float32, Int32, cute = d.cuda, d.cutlass, d.Float32, d.Int32, d.cute
    vec, st_cluster_f32 = d.vec, d.st_cluster_f32
    BF16 = cutlass.BFloat16

    class AttnResNormKernel:
        """One cluster of C CTAs per row (module doc)."""

        def __init__(self, D: int, n_blocks: int, update: str, cluster: int, vec_: int, eps: float,
                     alpha: str = "threads", pdl: bool = False, early: bool = False):
            assert update in UPDATES and 0 <= n_blocks <= MAX_BLOCKS and cluster in CLUSTERS and vec_ in VECS
            assert D % (cluster * vec_) == 0 and alpha in ALPHAS
            self.TW = alpha == "twopass"           # two exchanges: the scores' sums, then the mix's (module doc)
            self.pdl = bool(pdl)                   # weights before griddepcontrol.wait, the sources after
            self.early = bool(early) and self.pdl  # EARLY: the blocks and the prefix before the wait too
            self.D, self.NB, self.U = D, n_blocks, UPDATES.index(update)
            self.NS = n_blocks + 1                 # sources of the mix: the blocks, then p
            self.K = n_partials(n_blocks, alpha)   # partial sums per thread (exchanged at once)
            self.C, self.V = cluster, vec_
            self.W = D // cluster                  # columns a CTA
            self.N = self.W // vec_                # threads that own columns
            self.T = threads(D, n_blocks, cluster, vec_, alpha)
            self.NW = self.T // 32
            self.L = row_lanes(self.T, self.K)     # "twopass": lanes a partial row
            self.LOGL = self.L.bit_length() - 1
            self.NR = _ceil(self.L * self.K, 32)   # "twopass": the threads (whole warps) summing the rows
            self.TP = self.T + 4                   # row pitch of the partials (16-byte rows, no bank conflicts)
            self.eps = float(eps)
            # (i, j) of the Gram entries in partial order, after the NS sw_i
            self.pairs = tuple((i, j) for i in range(self.NS) for j in range(i, self.NS))

        @cute.jit
        def __call__(self, b0: cute.Pointer, b1: cute.Pointer, b2: cute.Pointer, b3: cute.Pointer,
                     b4: cute.Pointer, b5: cute.Pointer, b6: cute.Pointer, b7: cute.Pointer, b8: cute.Pointer,
                     p_pre: cute.Pointer, p_new: cute.Pointer, p_wn: cute.Pointer, p_wp: cute.Pointer,
                     p_nw: cute.Pointer, p_out: cute.Pointer, p_po: cute.Pointer,
                     t0: Int32, t1: Int32, t2: Int32, t3: Int32, t4: Int32, t5: Int32, t6: Int32, t7: Int32,
                     t8: Int32, s_pre: Int32, s_new: Int32, s_po: Int32, s_out: Int32, B: Int32,
                     stream: cuda.CUstream):
            cluster = {} if self.C == 1 else {"cluster": [self.C, 1, 1]}  # one CTA a row: no cluster launch
            self.kernel(b0, b1, b2, b3, b4, b5, b6, b7, b8, p_pre, p_new, p_wn, p_wp, p_nw, p_out, p_po,
                        t0, t1, t2, t3, t4, t5, t6, t7, t8, s_pre, s_new, s_po, s_out).launch(
                grid=[self.C, B, 1], block=[self.T, 1, 1], stream=stream, use_pdl=self.pdl, **cluster)

        def load_old(self, bptr, o_blk, p_pre, o_pre, r_src, r_p, r_a):
            """The sources no kernel of the step has just written: the blocks, and the prefix ("none": p itself;
            "add": the term new is added to)."""
            for i in range(self.NB):
                cute.autovec_copy(vec(bptr[i], o_blk[i], self.V), r_src[i])
            if self.U == 0:
                cute.autovec_copy(vec(p_pre, o_pre, self.V), r_p)
            if self.U == 1:
                cute.autovec_copy(vec(p_pre, o_pre, self.V), r_a)

        def floats(self, srcs, n):
            """The first n sources' columns as fp32, a list a source."""
            return [[srcs[i][e].to(Float32) for e in range(self.V)] for i in range(n)]

        def weights(self, r_wn, r_wp):
            return [r_wn[e].to(Float32) * r_wp[e].to(Float32) for e in range(self.V)]

        def partials(self, x, wv, s_part, tid, blocks_only):
            """sw_i and G_ij of the thread's columns into s_part: every one (blocks_only None), those of the blocks
            alone (True: i, j < NB), or those with p (False: i or j == NB)."""
            NB, NS, TP = self.NB, self.NS, self.TP

            def want(*ij):
                return blocks_only is None or (max(ij) < NB) == blocks_only

            if self.TW:  # sw_i at row i, sum s_i^2 at row NS + i
                for i in range(NS):
                    if want(i):
                        acc = x[i][0] * wv[0]
                        sq = x[i][0] * x[i][0]
                        for e in range(1, self.V):
                            acc = acc + x[i][e] * wv[e]
                            sq = sq + x[i][e] * x[i][e]
                        s_part[i * TP + tid] = acc
                        s_part[(NS + i) * TP + tid] = sq
                return
            for i in range(NS):
                if want(i):
                    acc = x[i][0] * wv[0]
                    for e in range(1, self.V):
                        acc = acc + x[i][e] * wv[e]
                    s_part[i * TP + tid] = acc
            for k in range(len(self.pairs)):
                i, j = self.pairs[k]
                if want(i, j):
                    acc = x[i][0] * x[j][0]
                    for e in range(1, self.V):
                        acc = acc + x[i][e] * x[j][e]
                    s_part[(NS + k) * TP + tid] = acc

        @cute.jit
        def warp_softmax(self, sc: Float32, lane: Int32) -> Float32:
            """Lane i < NS: the softmax weight of score sc among the NS lanes' (butterfly max and sum; the other
            lanes pass -3e38 and get 0)."""
            m = sc
            for sh in cutlass.range_constexpr(5):
                m = cute.arch.fmax(m, cute.arch.shuffle_sync_bfly(m, offset=16 >> sh))
            ex = Float32(0.0)
            if lane < self.NS:
                ex = cute.math.exp(sc - m)
            den = ex
            for sh in cutlass.range_constexpr(5):
                den = den + cute.arch.shuffle_sync_bfly(den, offset=16 >> sh)
            return ex / den

        @cute.jit
        def alpha_scores(self, s_tot, s_al, lane: Int32):
            """Warp 0 (alpha "twopass"): alpha from the totals sw_i, sum s_i^2 into s_al (32 lanes call it)."""
            NS = self.NS
            live = lane < NS
            sc = Float32(-3.0e38)
            if live:
                sc = s_tot[lane] * cute.math.rsqrt(s_tot[NS + lane] * (1.0 / self.D) + self.eps)
            a = self.warp_softmax(sc, lane)
            if live:
                s_al[lane] = a

        @cute.kernel
        def kernel(self, b0: cute.Pointer, b1: cute.Pointer, b2: cute.Pointer, b3: cute.Pointer,
                   b4: cute.Pointer, b5: cute.Pointer, b6: cute.Pointer, b7: cute.Pointer, b8: cute.Pointer,
                   p_pre: cute.Pointer, p_new: cute.Pointer, p_wn: cute.Pointer, p_wp: cute.Pointer,
                   p_nw: cute.Pointer, p_out: cute.Pointer, p_po: cute.Pointer,
                   t0: Int32, t1: Int32, t2: Int32, t3: Int32, t4: Int32, t5: Int32, t6: Int32, t7: Int32,
                   t8: Int32, s_pre: Int32, s_new: Int32, s_po: Int32, s_out: Int32):
            NB, NS, K, V, T, TP, C, W, N = (self.NB, self.NS, self.K, self.V, self.T, self.TP, self.C, self.W,
                                            self.N)
            tid, _, _ = cute.arch.thread_idx()
            rank, row, _ = cute.arch.block_idx()  # grid x = the cluster: the CTA's rank in it
            col = cute.assume(rank * W + tid * V, divby=V)
            active = tid < N

            smem = cutlass.memory.SmemAllocator()
            s_part = smem.allocate_tensor(Float32, cute.make_layout(K * TP), byte_alignment=16)
            s_clu = smem.allocate_tensor(Float32, cute.make_layout(C * K), byte_alignment=16)
            s_tot = smem.allocate_tensor(Float32, cute.make_layout(K), byte_alignment=16)
            if cutlass.const_expr(self.TW):  # alpha_0..alpha_{NS-1}
                s_al = smem.allocate_tensor(Float32, cute.make_layout(NS), byte_alignment=16)
            if cutlass.const_expr(self.TW):  # the warps' sums of mix^2, then the cluster's [C]
                s_ws = smem.allocate_tensor(Float32, cute.make_layout(self.NW), byte_alignment=16)
                s_clu2 = smem.allocate_tensor(Float32, cute.make_layout(C), byte_alignment=16)
            if cutlass.const_expr(C > 1):
                cute.arch.cluster_arrive_relaxed()  # the peers' shared memory must exist before DSMEM stores

            # ---- every load first: the three weight vectors (before a PDL wait), the sources, p's inputs -------
            bptr = (b0, b1, b2, b3, b4, b5, b6, b7, b8)
            bstr = (t0, t1, t2, t3, t4, t5, t6, t7, t8)
            r_src = []
            for _i in cutlass.range_constexpr(NS):
                r_src.append(cute.make_rmem_tensor((V,), BF16))
            r_a = cute.make_rmem_tensor((V,), BF16)  # "add": the prefix (p's own registers take new)
            r_wn = cute.make_rmem_tensor((V,), BF16)
            r_wp = cute.make_rmem_tensor((V,), BF16)
            r_nw = cute.make_rmem_tensor((V,), BF16)
            if cutlass.const_expr(N < T):  # idle threads hold zeros: their partials are 0
                for i in cutlass.range_constexpr(NS):
                    r_src[i].fill(0.0)
                r_a.fill(0.0)
                r_wn.fill(0.0)
                r_wp.fill(0.0)
                r_nw.fill(0.0)
            # (inside a dynamic `if` the DSL passes locals as region arguments: constants are read off self)
            o_blk = []
            for i in cutlass.range_constexpr(NB):
                o_blk.append(cute.assume(row * bstr[i] + col, divby=V))
            o_pre = cute.assume(row * s_pre + col, divby=V)
            o_new = cute.assume(row * s_new + col, divby=V)
            o_po = cute.assume(row * s_po + col, divby=V)
            o_out = cute.assume(row * s_out + col, divby=V)
            r_p = r_src[NB]
            if active:  # the weights: no kernel of the step writes them (read before the PDL wait)
                cute.autovec_copy(vec(p_wn, col, self.V), r_wn)
                cute.autovec_copy(vec(p_wp, col, self.V), r_wp)
                cute.autovec_copy(vec(p_nw, col, self.V), r_nw)
                if cutlass.const_expr(self.early):  # EARLY: the blocks and the prefix too (module doc)
                    self.load_old(bptr, o_blk, p_pre, o_pre, r_src, r_p, r_a)
            wv = []
            x = []
            if cutlass.const_expr(self.early):  # the blocks' partials while the kernel before ends
                wv = self.weights(r_wn, r_wp)
                x = self.floats(r_src, NB)
                self.partials(x, wv, s_part, tid, True)
            if cutlass.const_expr(self.pdl):
                cute.arch.griddepcontrol_wait()
                cute.arch.griddepcontrol_launch_dependents()
            if active:
                if cutlass.const_expr(not self.early):
                    self.load_old(bptr, o_blk, p_pre, o_pre, r_src, r_p, r_a)
                if cutlass.const_expr(self.U != 0):
                    cute.autovec_copy(vec(p_new, o_new, self.V), r_p)
                # the partial update: p = bf16(prefix + new) (one rounding) or new, written for add / fresh
                if cutlass.const_expr(self.U == 1):
                    for e in cutlass.range_constexpr(self.V):
                        r_p[e] = (r_a[e].to(Float32) + r_p[e].to(Float32)).to(BF16)
                if cutlass.const_expr(self.U != 0):
                    cute.autovec_copy(r_p, vec(p_po, o_po, self.V))

            # ---- the thread's partial sums: sw_i = sum s_i w, G_ij = sum s_i s_j over its columns -------------
            if cutlass.const_expr(self.early):  # the blocks' were formed before the wait: p's now
                x = x + self.floats(r_src[NB:], 1)
                self.partials(x, wv, s_part, tid, False)
            else:
                x = self.floats(r_src, NS)
                wv = self.weights(r_wn, r_wp)
                self.partials(x, wv, s_part, tid, None)
            cute.arch.sync_threads()

            # ---- thread k < K: row k over the CTA, into every cluster CTA's slot [rank][k] --------------------
            if cutlass.const_expr(C > 1):
                cute.arch.cluster_wait()
            if cutlass.const_expr(self.TW):
                # L lanes a row (row k = tid / L): lane j sums entries (c L + j) * 4 .. + 3 of row k in 4 chains, a
                # butterfly over the L lanes joins them (the same bits in every lane); lane 0 of the row stores
                if tid < self.NR:
                    k = tid // self.L
                    j = tid % self.L
                    acq = cute.make_rmem_tensor((4,), Float32)
                    rq = cute.make_rmem_tensor((4,), Float32)
                    acq.fill(0.0)
                    if k < self.K:
                        for c in cutlass.range_constexpr(self.T // (4 * self.L)):
                            cute.autovec_copy(vec(s_part.iterator, cute.assume(k * self.TP + (c * self.L + j) * 4,
                                                                               divby=4), 4), rq)
                            for q in cutlass.range_constexpr(4):
                                acq[q] = acq[q] + rq[q]
                    tq = (acq[0] + acq[1]) + (acq[2] + acq[3])
                    for sh in cutlass.range_constexpr(self.LOGL):
                        tq = tq + cute.arch.shuffle_sync_bfly(tq, offset=self.L >> (sh + 1))
                    if k < self.K:
                        if j == 0:
                            if cutlass.const_expr(self.C == 1):
                                s_tot[k] = tq
                            else:
                                for r in cutlass.range_constexpr(self.C):
                                    st_cluster_f32(s_clu.iterator + (rank * self.K + k), r, tq)
            else:
                if tid < K:  # in 4 chains, or 16 from 256 threads (448 partials: 28 dependent adds each, not 112)
                    NA = 16 if self.T >= 256 else 4
                    acs = cute.make_rmem_tensor((NA,), Float32)
                    r4 = cute.make_rmem_tensor((4,), Float32)
                    acs.fill(0.0)
                    for j in cutlass.range_constexpr(self.T // 4):
                        cute.autovec_copy(vec(s_part.iterator, cute.assume(tid * self.TP + j * 4, divby=4), 4), r4)
                        for q in cutlass.range_constexpr(4):
                            acs[(j % (NA // 4)) * 4 + q] = acs[(j % (NA // 4)) * 4 + q] + r4[q]
                    if cutlass.const_expr(NA == 16):  # a fixed tree: the same order in every CTA
                        for w in (8, 4):
                            for q in cutlass.range_constexpr(w):
                                acs[q] = acs[q] + acs[q + w]
                    tot = (acs[0] + acs[1]) + (acs[2] + acs[3])
                    if cutlass.const_expr(self.C == 1):
                        s_tot[tid] = tot
                    else:
                        for r in cutlass.range_constexpr(self.C):
                            st_cluster_f32(s_clu.iterator + (rank * self.K + tid), r, tot)
            if cutlass.const_expr(self.C > 1):
                cute.arch.cluster_arrive()
                cute.arch.cluster_wait()
                if tid < K:  # the cluster's slots in rank order: the same totals in every CTA of the row
                    tot2 = s_clu[tid]
                    for r in cutlass.range_constexpr(1, self.C):
                        tot2 = tot2 + s_clu[r * self.K + tid]
                    s_tot[tid] = tot2
            cute.arch.sync_threads()

            # ---- alpha, the norm of the mix, and this thread's columns of out ----------------------------------
            inv_d = 1.0 / self.D
            alpha = []
            r_out = cute.make_rmem_tensor((V,), p_out.dtype)
            if cutlass.const_expr(self.TW):
                # warp 0 forms alpha; every thread its columns of the mix and their sum of squares, a butterfly a
                # warp, the warps' sums in order (thread r < C: into slot [rank] of cluster CTA r; one more cluster
                # barrier), the cluster's slots in rank order: the same norm in every CTA of the row
                if tid < 32:
                    self.alpha_scores(s_tot, s_al, tid)
                cute.arch.sync_threads()
                for i in cutlass.range_constexpr(NS):
                    alpha.append(s_al[i])
                mixv = []
                ss = Float32(0.0)
                for e in cutlass.range_constexpr(V):
                    mx = alpha[0] * x[0][e]
                    for i in cutlass.range_constexpr(1, NS):
                        mx = mx + alpha[i] * x[i][e]
                    mixv.append(mx)
                    ss = ss + mx * mx
                for sh in cutlass.range_constexpr(5):
                    ss = ss + cute.arch.shuffle_sync_bfly(ss, offset=16 >> sh)
                if tid % 32 == 0:
                    s_ws[tid // 32] = ss
                cute.arch.sync_threads()
                if cutlass.const_expr(self.C == 1):
                    tw = s_ws[0]
                    for w in cutlass.range_constexpr(1, self.NW):
                        tw = tw + s_ws[w]
                else:
                    if tid < self.C:
                        tc = s_ws[0]
                        for w in cutlass.range_constexpr(1, self.NW):
                            tc = tc + s_ws[w]
                        st_cluster_f32(s_clu2.iterator + rank, tid, tc)
                    cute.arch.cluster_arrive()
                    cute.arch.cluster_wait()
                    tw = s_clu2[0]
                    for r in cutlass.range_constexpr(1, self.C):
                        tw = tw + s_clu2[r]
                inv2 = cute.math.rsqrt(tw * inv_d + self.eps)
                for e in cutlass.range_constexpr(V):
                    r_out[e] = (mixv[e] * inv2 * r_nw[e].to(Float32)).to(p_out.dtype)
            else:
                g = {}
                for k in cutlass.range_constexpr(len(self.pairs)):
                    g[self.pairs[k]] = s_tot[NS + k]
                sc = []
                for i in cutlass.range_constexpr(NS):
                    sc.append(s_tot[i] * cute.math.rsqrt(g[(i, i)] * inv_d + self.eps))
                m = sc[0]
                for i in cutlass.range_constexpr(1, NS):
                    m = -cute.arch.fmin(-m, -sc[i])  # fmax
                ex = []
                den = Float32(0.0)
                for i in cutlass.range_constexpr(NS):
                    ex.append(cute.math.exp(sc[i] - m))
                    den = den + ex[i]
                for i in cutlass.range_constexpr(NS):
                    alpha.append(ex[i] / den)
                ms = Float32(0.0)
                for k in cutlass.range_constexpr(len(self.pairs)):
                    i, j = self.pairs[k]
                    if cutlass.const_expr(i == j):
                        ms = ms + alpha[i] * alpha[i] * g[(i, j)]
                    else:
                        ms = ms + 2.0 * alpha[i] * alpha[j] * g[(i, j)]
                inv = cute.math.rsqrt(ms * inv_d + self.eps)
            if cutlass.const_expr(not self.TW):
                for e in cutlass.range_constexpr(V):
                    mix = alpha[0] * x[0][e]
                    for i in cutlass.range_constexpr(1, NS):
                        mix = mix + alpha[i] * x[i][e]
                    r_out[e] = (mix * inv * r_nw[e].to(Float32)).to(p_out.dtype)
            if active:
                cute.autovec_copy(r_out, vec(p_out, o_out, self.V))

    _KERNEL_CLS = AttnResNormKernel
    return AttnResNormKernel


# ---------------------------------------------------------------------------------------------
# Host wrapper
# ---------------------------------------------------------------------------------------------

_COMPILED: dict[tuple, Any] = {}


def _fail(name: str, what: str):
    raise AttnResCuteError(f"attnres cute: {name!r} {what}")


def _check_rows(name: str, t, B: int, D: int, dev) -> None:
    if not isinstance(t, torch.Tensor):
        _fail(name, f"must be a torch.Tensor, got {type(t).__name__}")
    if t.device.type != "cuda" or t.device != dev:
        _fail(name, f"must be on the CUDA device {dev}, got {t.device}")
    if t.dim() != 2 or tuple(t.shape) != (B, D) or t.dtype != torch.bfloat16:
        _fail(name, f"must be a bf16 [{B}, {D}] tensor, got {t.dtype} {tuple(t.shape)}")
    if D > 1 and t.stride(1) != 1:
        _fail(name, f"must have unit stride along D, got strides {t.stride()}")


def _check_vec(name: str, t, D: int, dev) -> None:
    if not isinstance(t, torch.Tensor) or t.device != dev or tuple(t.shape) != (D,) or t.dtype != torch.bfloat16 \
            or not t.is_contiguous():
        _fail(name, f"must be a contiguous bf16 [{D}] tensor on {dev}, got "
                    f"{getattr(t, 'dtype', type(t).__name__)} {tuple(getattr(t, 'shape', ()))}")


def _align(ts, strided) -> int:
    """The bytes (<= 16) every pointer of `ts` and every row stride of `strided` is a multiple of."""
    a = 16
    for t in ts:
        p = t.data_ptr()
        while p % a:
            a //= 2
    for t in strided:
        s = t.stride(0) * 2 if t.shape[0] > 1 else 16
        while s % a:
            a //= 2
    return a


def _ptr(t: torch.Tensor, align: int):
    import cutlass
    from cutlass import cute
    from cutlass.cute.runtime import make_ptr
    return make_ptr(cutlass.BFloat16, t.data_ptr(), cute.AddressSpace.gmem, assumed_align=align)


def attnres_norm(blocks: list, prefix: torch.Tensor, new: torch.Tensor | None, w_norm: torch.Tensor,
                 w_proj: torch.Tensor, norm_w: torch.Tensor, out: torch.Tensor, partial_out: torch.Tensor | None,
                 *, update: str = "none", eps: float = 1e-6, cluster: int | None = None,
                 vec: int | None = None, alpha: str | None = None, pdl: bool | None = None) -> torch.Tensor:
    """The partial update + mix + RMSNorm of one layer side (module doc). Returns out."""
    if pdl is None:
        from k3lab_kernels.triton.pdl import chain_pdl

        pdl = chain_pdl(None)
    if not isinstance(pdl, bool):
        _fail("pdl", f"must be a bool or None, got {pdl!r}")
    if update not in UPDATES:
        _fail("update", f"must be one of {UPDATES}, got {update!r}")
    if not isinstance(blocks, (list, tuple)) or len(blocks) > MAX_BLOCKS:
        _fail("blocks", f"must be a list of 0..{MAX_BLOCKS} tensors, got {type(blocks).__name__} of "
                        f"{len(blocks) if isinstance(blocks, (list, tuple)) else '?'}")
    if not isinstance(out, torch.Tensor) or out.dim() != 2:
        _fail("out", f"must be a bf16 [B, D] tensor, got {getattr(out, 'shape', type(out).__name__)}")
    B, D = out.shape
    dev = out.device
    _check_rows("out", out, B, D, dev)
    for i, b in enumerate(blocks):
        _check_rows(f"blocks[{i}]", b, B, D, dev)
    if update != "fresh":
        _check_rows("prefix", prefix, B, D, dev)
    if update == "none":
        if new is not None or partial_out is not None:
            _fail("new", "and 'partial_out' must be None for update='none'")
    else:
        _check_rows("new", new, B, D, dev)
        _check_rows("partial_out", partial_out, B, D, dev)
    for name, v in (("w_norm", w_norm), ("w_proj", w_proj), ("norm_w", norm_w)):
        _check_vec(name, v, D, dev)
    if isinstance(eps, bool) or not isinstance(eps, (int, float)) or not eps > 0:
        _fail("eps", f"must be a positive float, got {eps!r}")
    used = list(blocks) + ([prefix] if update != "fresh" else []) + ([new, partial_out] if update != "none" else [])
    used.append(out)
    al = _align(used + [w_norm, w_proj, norm_w], used)
    C, V = plan(B, D, len(blocks), cluster, vec, al, alpha)
    A = alpha or "twopass"
    if B == 0:
        return out
    a = 2 * V
    po = _ptr(out, a)  # the stand-in for pointers the kernel never reads (absent blocks, new, partial_out)
    bp = [_ptr(b, a) for b in blocks] + [po] * (MAX_BLOCKS - len(blocks))
    bs = [b.stride(0) for b in blocks] + [0] * (MAX_BLOCKS - len(blocks))
    pre = prefix if update != "fresh" else out
    nw = new if update != "none" else out
    pout = partial_out if update != "none" else out
    args = bp + [_ptr(pre, a), _ptr(nw, a), _ptr(w_norm, a), _ptr(w_proj, a), _ptr(norm_w, a), po,
                 _ptr(pout, a)] + bs + [pre.stride(0), nw.stride(0), pout.stride(0), out.stride(0), B]
    early = bool(EARLY) and pdl
    key = (len(blocks), update, D, C, V, A, float(eps), pdl, early, dev.index)
    import cuda.bindings.driver as cuda
    with torch.cuda.device(dev):
        stream = cuda.CUstream(torch.cuda.current_stream(dev).cuda_stream)
        fn = _COMPILED.get(key)
        if fn is None:
            from cutlass import cute
            fn = cute.compile(_kernel_class()(D, len(blocks), update, C, V, eps, A, pdl, early), *args, stream)
            _COMPILED[key] = fn
        fn(*args, stream)
    return out
