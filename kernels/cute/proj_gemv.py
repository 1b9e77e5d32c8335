"""Trunk projections at small batch as one CuTe DSL kernel (the twin of kernels/triton/proj_gemv.py's GEMV paths,
without its Triton prologues): y_i = x W_i^T over the row ranges of one weight, bf16 or fp8 weights.

    y[b, n] = sum_k x[b, k] * W[n, k] (* scale[n])  (+ residual[b, n])   fp32 accumulation, stored in out_i's dtype
    out_i[b, n - start_i] = y[b, n]  for start_i <= n < end_i     (up to MAX_OUTPUTS outputs: a fused group)

fp8 weights (float8_e4m3fn, one fp32 scale a row: the Triton kernels' scheme, W_true[n, :] = W[n, :] scale[n]): a
lane's 16 bytes of a step are 16 columns (a step 512 columns), each word of four codes widened to fp32 exactly (two
cvt.rn.f16x2.e4m3x2, then the halves), the row's scale times the fp32 sum before the residual; plain outputs and the
residual only (not with select, chain, rmsp or glu). At batch 1 ahead of the Triton GEMV over >= 768 output rows,
behind over fewer; at batch 2 ahead on a few shapes only, behind from 4 (the fp32 FMAs a token). bf16 at batch 1: ahead
over short inputs and >= 3584 rows over the model width. The trunk's rules (data/trunk_defaults.json,
docs/NOTES_trunk.md).

Layout. x [B, K] bf16 (unit stride along K, a row stride of 8 elements), W [N, K] bf16 contiguous (nn.Linear), K a
multiple of 8 (a last partial step of 256 columns is masked by lane); B = 1..MAX_BATCH. A CTA of 128 threads (4
warps); warp w of CTA c owns output row n = 4 c + w over all of K: lane l reads columns 256 s + 8 l .. + 7 of step s
(one 16-byte load of W and one of each batch row of x, the x rows from L1 / L2), the steps unrolled UNROLL deep so
that each warp keeps UNROLL x 512 bytes of its row in flight, the first PRE steps' W loaded first (before the wait
under pdl: the weight streams while the kernel before finishes; inputs of K <= SHORT_K take UNROLL_SHORT / PRE_SHORT,
fewer registers so more of their CTAs are resident); the batch rows' dot products are summed over the warp
by shuffles and lane b stores row b. No split-K and no shared memory: a 576-row projection is 144 CTAs of four
warps (two rows a warp, one wave for the wide groups, won alone and lost inside the decode step:
docs/NOTES_trunk.md, twentieth session; code at f17621a). Outputs: each out_i [B, N_i] bf16 or fp32 with unit inner
stride (any row stride: a column slice of a wider buffer); a residual [B, N] bf16 (one output only) is added in fp32
before the store.

Fused router selection (`select`, batch <= SELECT_MAX_BATCH; the MoE input group, whose output 0 is the router's
fp32 logits [B, E] over rows 0..E-1, the grid's first RC = ceil(E / 4) CTAs): each of those CTAs, once its rows are
stored (CTA barrier), counts itself on a per-device arrival counter (fence.acq_rel.gpu, atom.add.acq_rel.gpu);
the last to arrive resets the counter and selects every batch row, one after another, with its four warps
(router_topk's Selector: sigmoid, the selection-only bias, top-k, the renormalized weights; the stand-alone kernel's
operations, order and tie rule, so idx and weights are bit-equal to it). The router's CTAs are the grid's first,
so the selection runs while the later rows still stream; the dependent kernel (the experts, under pdl) waits for the
whole grid, selection included. One launch fewer a MoE layer. The counter is one per device: calls with `select`
must not run concurrently on two streams.

Chained projection (`chain`, the KDA input group: f = W_fb fa): output 0 (bf16 [B, R], R <= K_STEP a multiple of 8)
also feeds f = out_0 W2^T [B, NF] in the same launch. Output 0's rows are the grid's first RCF = ceil(R / 4) CTAs;
each counts itself on counter word 2 once its rows are stored (fence.acq_rel.gpu, a release add). NCC = ceil(NF / 4)
chain CTAs after the main grid load their W2 rows (one warp a row of f, R / 8 lanes, the rest zeros), then thread 0
spins on that count (acquire loads) while the other warps wait at a barrier, and every warp forms its row for every
batch row from the stored (bf16) output 0, so f is the value the two-launch path computes; the last chain CTA (word 3)
zeroes both words. Correct whatever order the CTAs start in as long as the counted CTAs make progress, which they do
when the whole grid is resident (the KDA group at TP8: 1,571 + 384 CTAs of four warps) or when CTAs start in index
order. One pair of counter words a device: calls with `chain` must not run concurrently on two streams.

The MoE output's glue folded (k3lab.step.moe_glue_fold): `glu` = (b1, b2) stores the last output as situ(g, u) over
W's last 2 I rows [g | u] (the MoE input group's shared w1 / w3: a CTA takes g_i, g_i+1, u_i, u_i+1 and exchanges
them through shared memory; g and u rounded to bf16 first, as the stand-alone glue reads them); `rmsp` = (ssp, K0,
eps) multiplies the sum over x's first K0 columns by rsqrt(sum_p ssp[b, p] / K0 + eps) (the MoE output's input
[bf16(y gamma) | situ(g, u)], the routed norm's factor from the P partial sums of y^2 the experts' down kernel wrote;
each warp sums the P partials of its batch rows).

Floor (bytes, k3lab.ops.trunk.proj_bytes): weights N*K*2 + x B*K*2 + outputs B*N*e_out (+ residual B*N*2), at the
read bandwidth.

Contract (torch tensors on one CUDA device, torch's current stream, CUDA-graph safe once a shape has compiled):
proj(x, w, outs, *, residual=None, pdl=None) -> outs. pdl=True (programmatic dependent launch): each warp loads its
first PRE steps of W, then waits for the kernel before (griddepcontrol.wait) before reading x or the residual (W must
not be written by that kernel);
None: the enclosing k3lab_kernels.triton.pdl.pdl_chain's setting, as in Triton.
"""
from typing import Any

import torch

from .router_topk import MAX_EXPERTS, MAX_TOPK, selector_class

MAX_BATCH = 16
MAX_OUTPUTS = 6
PATHS = (None, "gemv", "mma")  # "mma": the few-token tensor-core kernel, kernels/cute/proj_mma.py
SELECT_MAX_BATCH = 4  # the fused selection: one CTA selects every row, one after another
K_STEP = 256      # columns a warp reads a step (32 lanes x 8 bf16; fp8 weights: 2 K_STEP, 32 lanes x 16 e4m3)
# UNROLL / PRE: 16 / 16 made single projections faster alone and the batch-1 decode step slower (docs/NOTES_trunk.md)
UNROLL = 8        # steps a warp keeps in flight
PRE = 8           # steps of W a warp loads before anything else (before griddepcontrol.wait under pdl)
SHORT_K = 2048    # inputs up to this long take UNROLL_SHORT / PRE_SHORT instead (0: none)
UNROLL_SHORT = 4  # (the batch-1 step faster than at 8 / 8: the output projections' K 1536; docs/NOTES_trunk.md)
PRE_SHORT = 2
_THREADS = 128
_WARPS = _THREADS // 32
# four e4m3 codes (a 32-bit word, byte 0 the lowest column) -> four fp32: two cvt.rn.f16x2.e4m3x2 (each .b16 source's
# upper byte to the upper half), then each half widened; exact (every e4m3 value is an f16 value)
E4M3_PTX = "\n".join(["{", ".reg .b16 lo, hi, a0, a1, a2, a3;", ".reg .b32 h0, h1;", "mov.b32 {lo, hi}, $4;",
                       "cvt.rn.f16x2.e4m3x2 h0, lo;", "cvt.rn.f16x2.e4m3x2 h1, hi;", "mov.b32 {a0, a1}, h0;",
                       "mov.b32 {a2, a3}, h1;", "cvt.f32.f16 $0, a0;", "cvt.f32.f16 $1, a1;", "cvt.f32.f16 $2, a2;",
                       "cvt.f32.f16 $3, a3;", "}"])

__all__ = ["K_STEP", "MAX_BATCH", "MAX_OUTPUTS", "proj"]

_KERNEL_CLS = None
# the e4m3 widening the fp8 path is written with, for the one-token dense experts (kernels/cute/moe_dense.py): set by
# _kernel_class()
E4M3_WORD = None


def _kernel_class():
    """The GEMV generator (built once; importing this module never needs cutlass)."""
    global _KERNEL_CLS, E4M3_WORD
    if _KERNEL_CLS is not None:
        return _KERNEL_CLS
    import cuda.bindings.driver as cuda
    import cutlass
    from cutlass import Float32, Int32, cute
    from cutlass._mlir.dialects import llvm as _llvm
    from cutlass.cutlass_dsl import dsl_user_op

    def vec(ptr, off, n):
        return cute.make_tensor(ptr + off, cute.make_layout(n))

    @dsl_user_op
    def e4m3_word(w, *, loc=None, ip=None):
        """Four e4m3 codes (bytes 0..3 of a 32-bit word, byte 0 the lowest column) -> their four fp32 values."""
        res = _llvm.inline_asm(_llvm.StructType.get_literal([Float32.mlir_type] * 4),
                               [Int32(w).ir_value(loc=loc, ip=ip)], E4M3_PTX, "=f,=f,=f,=f,r",
                               has_side_effects=False, is_align_stack=False, asm_dialect=_llvm.AsmDialect.AD_ATT,
                               loc=loc, ip=ip)
        return [Float32(_llvm.extractvalue(Float32.mlir_type, res, [i], loc=loc, ip=ip)) for i in range(4)]

    class ProjGemvKernel:
        """One warp per output row over all of K; four rows a CTA."""

        def __init__(self, B: int, N: int, K: int, ends: tuple, residual: bool, pdl: bool = False,
                     top_k: int = 0, chain: tuple | None = None, rms: tuple | None = None, glu: tuple | None = None,
                     fp8: bool = False):
            assert 1 <= B <= MAX_BATCH and K % (16 if fp8 else 8) == 0 and 1 <= len(ends) <= MAX_OUTPUTS
            assert ends[-1] == N and not (fp8 and (top_k or chain is not None or rms is not None or glu is not None))
            self.B, self.N, self.K = B, N, K
            # fp8 weights (e4m3 codes, one fp32 scale a row): a lane's 16 bytes of a step are 16 columns, not 8
            self.fp8 = bool(fp8)
            self.KS = 2 * K_STEP if fp8 else K_STEP  # columns a warp reads a step
            # the module's settings when built (part of the compile key); short: a row of at most SHORT_K bf16 bytes
            short = K * (1 if fp8 else 2) <= 2 * SHORT_K
            self.unroll, self.pre = (UNROLL_SHORT, PRE_SHORT) if short else (UNROLL, PRE)
            self.ends = tuple(int(e) for e in ends)   # the outputs' row ranges: [ends[i-1], ends[i])
            # the rms-scaled segment (rms = (K0, P)): the sum over x's first K0 columns times rsqrt(sum of the row's
            # P partial sums of squares / K0 + eps); the rest as it is
            self.rms_k, self.NPART = rms if rms is not None else (0, 0)
            assert self.rms_k % K_STEP == 0 and 0 <= self.rms_k <= K
            # the GLU output (glu = (b1, b2)): the last output's 2 I W rows are [g (I rows) | u (I rows)], stored as
            # situ(g_i, u_i); a CTA takes g_i, g_i+1, u_i, u_i+1 (i even), so I is even
            self.glu = glu
            if glu is not None:
                self.glo = self.ends[-2] if len(ends) > 1 else 0
                assert self.glo % _WARPS == 0 and (N - self.glo) % _WARPS == 0 and chain is None and B <= 16
            self.GC = (N + _WARPS - 1) // _WARPS   # the main rows' CTAs
            # the chained projection (chain = (NF, RK)): f = W2 out_0 over RK = out_0's width, NF rows, one warp a
            # row in NCC CTAs after the main grid, once the RCF CTAs of out_0's rows have counted themselves
            self.chain = chain
            self.NCC = 0
            if chain is not None:
                NF, RK = chain
                assert top_k == 0 and not residual and RK == ends[0] and RK % 8 == 0 and RK <= K_STEP
                self.NF, self.RK = NF, RK
                self.NCC = (NF + _WARPS - 1) // _WARPS
                self.RCF = (RK + _WARPS - 1) // _WARPS
            self.residual = bool(residual)
            self.pdl = bool(pdl)
            # the fused selection (top_k > 0): output 0 is the router's fp32 logits over E = ends[0] experts, its
            # rows the first RC CTAs; the last of them to finish selects (router_topk's Selector, this CTA's warps)
            self.sel = None
            if top_k:
                assert B <= SELECT_MAX_BATCH and not residual
                self.sel = selector_class()(self.ends[0], top_k, _WARPS, lean=True)
                self.top_k = top_k
                self.RC = -(-self.ends[0] // _WARPS)

        @cute.jit
        def __call__(self, p_x: cute.Pointer, p_w: cute.Pointer, p_res: cute.Pointer, p_o0: cute.Pointer,
                     p_o1: cute.Pointer, p_o2: cute.Pointer, p_o3: cute.Pointer, p_o4: cute.Pointer,
                     p_o5: cute.Pointer, s_x: Int32, s_o0: Int32, s_o1: Int32, s_o2: Int32, s_o3: Int32,
                     s_o4: Int32, s_o5: Int32, p_bias: cute.Pointer, p_idx: cute.Pointer, p_wk: cute.Pointer,
                     p_cnt: cute.Pointer, scaling: Float32, p_w2: cute.Pointer, p_f: cute.Pointer, s_f: Int32,
                     p_ssp: cute.Pointer, eps: Float32, p_scale: cute.Pointer, stream: cuda.CUstream):
            self.kernel(p_x, p_w, p_res, p_o0, p_o1, p_o2, p_o3, p_o4, p_o5, s_x, s_o0, s_o1, s_o2, s_o3, s_o4,
                        s_o5, p_bias, p_idx, p_wk, p_cnt, scaling, p_w2, p_f, s_f, p_ssp, eps, p_scale).launch(
                grid=[self.GC + self.NCC, 1, 1], block=[_THREADS, 1, 1], stream=stream,
                use_pdl=self.pdl)

        @cute.jit
        def chained(self, c: Int32, tid: Int32, warp: Int32, lane: Int32, p_o0: cute.Pointer, s_o0: Int32,
                    p_cnt: cute.Pointer, p_w2: cute.Pointer, p_f: cute.Pointer, s_f: Int32):
            """The chained projection f = W2 out_0: out_0's CTAs count themselves on p_cnt[2] once their rows are
            stored; a chain CTA's thread 0 spins on that count (acquire loads; the counted CTAs precede it in the
            grid), then warp w forms row (c - GC) 4 + w of f for every batch row; the last chain CTA to finish
            (p_cnt[3]) zeroes both counts for the next call."""
            B, RK, GC, NCC, RCF = self.B, self.RK, self.GC, self.NCC, self.RCF
            if c < RCF:
                cute.arch.sync_threads()  # this CTA's rows of out_0 are stored
                if tid == 0:
                    cute.arch.fence_acq_rel_gpu()
                    cute.arch.atomic_add(p_cnt + 2, Int32(1), sem="release", scope="gpu")
            if c >= GC:
                nf = (c - GC) * _WARPS + warp
                live = lane * 8 < RK
                w2v = cute.make_rmem_tensor((8,), p_w2.dtype)
                av = cute.make_rmem_tensor((8,), p_o0.dtype)
                w2v.fill(0.0)
                if nf < self.NF:
                    if live:
                        cute.autovec_copy(vec(p_w2, cute.assume(nf * RK + 8 * lane, divby=8), 8), w2v)
                if tid == 0:
                    cur = cute.arch.load(p_cnt + 2, Int32, sem="acquire", scope="gpu")
                    while cur < RCF:
                        cur = cute.arch.load(p_cnt + 2, Int32, sem="acquire", scope="gpu")
                    cute.arch.fence_acq_rel_gpu()
                cute.arch.sync_threads()
                acc = cute.make_rmem_tensor((B,), Float32)
                acc.fill(0.0)
                for b in cutlass.range_constexpr(B):
                    av.fill(0.0)
                    if live:
                        cute.autovec_copy(vec(p_o0, cute.assume(b * s_o0 + 8 * lane, divby=8), 8), av)
                    for j in cutlass.range_constexpr(8):
                        acc[b] = acc[b] + w2v[j].to(Float32) * av[j].to(Float32)
                for b in cutlass.range_constexpr(B):
                    for sh in cutlass.range_constexpr(5):
                        acc[b] = acc[b] + cute.arch.shuffle_sync_bfly(acc[b], offset=16 >> sh)
                if nf < self.NF:
                    for b in cutlass.range_constexpr(B):
                        if lane == b:
                            vec(p_f, b * s_f + nf, 1)[0] = acc[b].to(p_f.dtype)
                cute.arch.sync_threads()
                if tid == 0:
                    old = cute.arch.atomic_add(p_cnt + 3, Int32(1), sem="acq_rel", scope="gpu")
                    if old == NCC - 1:  # every chain CTA is past its spin: zero both counts
                        cute.arch.atomic_add(p_cnt + 2, Int32(-RCF), sem="relaxed", scope="gpu")
                        cute.arch.atomic_add(p_cnt + 3, Int32(-NCC), sem="relaxed", scope="gpu")

        @cute.jit
        def step(self, wv, s, lane, p_x, s_x, xv, acc):
            """One step: acc[b] += sum_j w_j x[b, KS s + e lane + j] over the batch rows (bf16: KS 256, e = 8 weights
            in wv; fp8: KS 512, e = 16 columns, wv four words of four e4m3 codes, xv 16 wide)."""
            if cutlass.const_expr(self.fp8):
                wf = cute.make_rmem_tensor((16,), Float32)
                for j in cutlass.range_constexpr(4):
                    f = e4m3_word(wv[j])
                    for i in cutlass.range_constexpr(4):
                        wf[4 * j + i] = f[i]
                for b in cutlass.range_constexpr(self.B):
                    for h in cutlass.range_constexpr(2):
                        cute.autovec_copy(vec(p_x, cute.assume(b * s_x + s * self.KS + 16 * lane + 8 * h, divby=8), 8),
                                          cute.make_tensor(xv.iterator + 8 * h, cute.make_layout(8)))
                    for j in cutlass.range_constexpr(16):
                        acc[b] = acc[b] + wf[j] * xv[j].to(Float32)
            else:
                for b in cutlass.range_constexpr(self.B):
                    cute.autovec_copy(vec(p_x, cute.assume(b * s_x + s * self.KS + 8 * lane, divby=8), 8), xv)
                    for j in cutlass.range_constexpr(8):
                        acc[b] = acc[b] + wv[j].to(Float32) * xv[j].to(Float32)

        @cute.jit
        def glu_store(self, g: Float32, u: Float32, po: cute.Pointer, off: Int32):
            """po[off] = b1 tanh(g / b1) sigmoid(g) * b2 tanh(u / b2) in fp32 (tanh(x) = 2 sigmoid(2x) - 1)."""
            b1, b2 = self.glu
            sg = 1.0 / (1.0 + cute.math.exp(-g))
            t1 = 2.0 / (1.0 + cute.math.exp(g * (-2.0 / b1))) - 1.0
            t2 = 2.0 / (1.0 + cute.math.exp(u * (-2.0 / b2))) - 1.0
            vec(po, off, 1)[0] = ((b1 * t1 * sg) * (b2 * t2)).to(po.dtype)

        @cute.kernel
        def kernel(self, p_x: cute.Pointer, p_w: cute.Pointer, p_res: cute.Pointer, p_o0: cute.Pointer,
                   p_o1: cute.Pointer, p_o2: cute.Pointer, p_o3: cute.Pointer, p_o4: cute.Pointer,
                   p_o5: cute.Pointer, s_x: Int32, s_o0: Int32, s_o1: Int32, s_o2: Int32, s_o3: Int32,
                   s_o4: Int32, s_o5: Int32, p_bias: cute.Pointer, p_idx: cute.Pointer, p_wk: cute.Pointer,
                   p_cnt: cute.Pointer, scaling: Float32, p_w2: cute.Pointer, p_f: cute.Pointer, s_f: Int32,
                   p_ssp: cute.Pointer, eps: Float32, p_scale: cute.Pointer):
            B, N, K = self.B, self.N, self.K
            KS = self.KS
            S = K // KS                  # whole steps
            EW = 4 if self.fp8 else 8    # W elements a lane loads a step (int32 words of four codes, or bf16)
            WS = KS // 4 if self.fp8 else KS  # W elements a step advances along a row
            LE = KS // 32                # columns a lane covers a step
            tid, _, _ = cute.arch.thread_idx()
            c, _, _ = cute.arch.block_idx()
            warp = cute.arch.make_warp_uniform(cute.arch.warp_idx())
            lane = tid % 32
            n = c * _WARPS + warp
            if cutlass.const_expr(self.glu is not None):  # a GLU CTA j: rows g_2j, g_2j+1 (warps 0, 1), u_2j, u_2j+1
                GI = (N - self.glo) // 2
                n = cutlass.select_(c * _WARPS >= self.glo,
                                    self.glo + 2 * (c - self.glo // _WARPS) + warp % 2 + (warp // 2) * GI, n)
            outs = (p_o0, p_o1, p_o2, p_o3, p_o4, p_o5)
            strides = (s_o0, s_o1, s_o2, s_o3, s_o4, s_o5)
            smem = cutlass.memory.SmemAllocator()  # one allocator: the selection's buffers, then the GLU exchange
            if cutlass.const_expr(self.sel is not None):
                s_score, s_tmax, s_sup, s_cand, s_sel, s_cnt = self.sel.smem(smem)
            if cutlass.const_expr(self.glu is not None):
                s_glu = smem.allocate_tensor(Float32, cute.make_layout(_WARPS * B), byte_alignment=16)
            S0 = self.rms_k // K_STEP    # steps of the rms-scaled segment (acc0), then the plain one (acc)
            if n < N:
                acc = cute.make_rmem_tensor((B,), Float32)
                acc.fill(0.0)
                acc0 = acc
                if cutlass.const_expr(S0 > 0):
                    acc0 = cute.make_rmem_tensor((B,), Float32)
                    acc0.fill(0.0)
                wv = cute.make_rmem_tensor((EW,), p_w.dtype)
                xv = cute.make_rmem_tensor((LE,), p_x.dtype)
                wrow = n * (K // 4 if self.fp8 else K) + EW * lane
                # the first PRE steps of W in registers before anything else: under pdl they load before the wait
                # (W is no kernel's output), so the row streams while the kernel before finishes
                pre = min(self.pre, S)
                wpre = cute.make_rmem_tensor((max(pre, 1) * EW,), p_w.dtype)
                for s in cutlass.range_constexpr(pre):
                    cute.autovec_copy(vec(p_w, cute.assume(wrow + s * WS, divby=EW), EW),
                                      cute.make_tensor(wpre.iterator + s * EW, cute.make_layout(EW)))
                if cutlass.const_expr(self.pdl):
                    cute.arch.griddepcontrol_wait()  # x (and the residual) come from the kernel before
                    cute.arch.griddepcontrol_launch_dependents()
                for s in cutlass.range_constexpr(pre):
                    self.step(cute.make_tensor(wpre.iterator + s * EW, cute.make_layout(EW)), s, lane, p_x, s_x, xv,
                              acc0 if s < S0 else acc)
                if cutlass.const_expr(S0 > pre):
                    for s in cutlass.range(pre, S0, unroll=self.unroll):
                        cute.autovec_copy(vec(p_w, cute.assume(wrow + s * WS, divby=EW), EW), wv)
                        self.step(wv, s, lane, p_x, s_x, xv, acc0)
                for s in cutlass.range(max(pre, S0), S, unroll=self.unroll):
                    cute.autovec_copy(vec(p_w, cute.assume(wrow + s * WS, divby=EW), EW), wv)
                    self.step(wv, s, lane, p_x, s_x, xv, acc)
                if cutlass.const_expr(K % KS != 0):  # the last, partial step: lanes past K load nothing
                    if S * KS + LE * lane < K:
                        cute.autovec_copy(vec(p_w, cute.assume(wrow + S * WS, divby=EW), EW), wv)
                        self.step(wv, S, lane, p_x, s_x, xv, acc0 if S < S0 else acc)
                for b in cutlass.range_constexpr(B):
                    for sh in cutlass.range_constexpr(5):
                        acc[b] = acc[b] + cute.arch.shuffle_sync_bfly(acc[b], offset=16 >> sh)
                if cutlass.const_expr(S0 > 0):  # the segment's sum times its rms factor, from the row's partials
                    for b in cutlass.range_constexpr(B):
                        ss = Float32(0.0)
                        for i in cutlass.range_constexpr((self.NPART + 31) // 32):
                            if i * 32 + lane < self.NPART:
                                ss = ss + vec(p_ssp, b * self.NPART + i * 32 + lane, 1)[0]
                        for sh in cutlass.range_constexpr(5):
                            acc0[b] = acc0[b] + cute.arch.shuffle_sync_bfly(acc0[b], offset=16 >> sh)
                            ss = ss + cute.arch.shuffle_sync_bfly(ss, offset=16 >> sh)
                        acc[b] = acc[b] + acc0[b] * cute.math.rsqrt(ss / Float32(self.rms_k) + eps)
                for b in cutlass.range_constexpr(B):
                    if lane == b:
                        y = acc[b]
                        if cutlass.const_expr(self.fp8):  # the row's scale: W_true[n, :] = W_e4m3[n, :] scale[n]
                            y = y * vec(p_scale, n, 1)[0]
                        if cutlass.const_expr(self.residual):
                            y = y + vec(p_res, b * N + n, 1)[0].to(Float32)
                        n_plain = len(self.ends) - (0 if self.glu is None else 1)
                        for i in cutlass.range_constexpr(n_plain):
                            lo = 0 if i == 0 else self.ends[i - 1]
                            if n >= lo:
                                if n < self.ends[i]:
                                    vec(outs[i], b * strides[i] + n - lo, 1)[0] = y.to(outs[i].dtype)
                        if cutlass.const_expr(self.glu is not None):
                            if n >= self.glo:  # g or u of the GLU output, rounded as a stored bf16 value
                                s_glu[warp * B + b] = y.to(cutlass.BFloat16).to(Float32)
            if cutlass.const_expr(self.glu is not None):
                if c * _WARPS >= self.glo:  # CTA-uniform: this CTA's rows are g_i, g_i+1, u_i, u_i+1 (i = 2j)
                    cute.arch.sync_threads()
                    if tid < 2 * B:
                        gpr = tid // B
                        gb = tid % B
                        self.glu_store(s_glu[gpr * B + gb], s_glu[(2 + gpr) * B + gb], outs[len(self.ends) - 1],
                                       gb * strides[len(self.ends) - 1] + (c * _WARPS - self.glo) // 2 + gpr)
            if cutlass.const_expr(self.pdl):
                if n >= N:
                    cute.arch.griddepcontrol_wait()  # a warp past N waits too (it may still select)
            if cutlass.const_expr(self.sel is not None):
                if c < self.RC:  # a CTA of router rows (CTA-uniform): count it; the last one selects every row
                    cute.arch.sync_threads()  # the CTA's logits are stored
                    if tid == 0:
                        cute.arch.fence_acq_rel_gpu()
                        old = cute.arch.atomic_add(p_cnt, Int32(1), sem="acq_rel", scope="gpu")
                        last = Int32(0)
                        if old == self.RC - 1:
                            last = Int32(1)
                            cute.arch.atomic_add(p_cnt, Int32(-self.RC), sem="relaxed", scope="gpu")  # zero again
                        cute.arch.fence_acq_rel_gpu()
                        s_cnt[1] = last
                    cute.arch.sync_threads()
                    if s_cnt[1] == 1:  # every router row's logits are visible: select row after row
                        for b in cutlass.range_constexpr(B):
                            self.sel.row(p_o0 + b * s_o0, p_bias, p_idx + b * self.top_k, p_wk + b * self.top_k,
                                         scaling, s_score, s_tmax, s_sup, s_cand, s_sel, s_cnt, tid)
                            cute.arch.sync_threads()
            if cutlass.const_expr(self.chain is not None):
                self.chained(c, tid, warp, lane, p_o0, s_o0, p_cnt, p_w2, p_f, s_f)

    _KERNEL_CLS = ProjGemvKernel
    E4M3_WORD = e4m3_word
    return ProjGemvKernel


# ---------------------------------------------------------------------------------------------
# Host wrapper
# ---------------------------------------------------------------------------------------------

_COMPILED: dict[tuple, Any] = {}


class ProjGemvError(ValueError):
    """An argument of the CuTe projection has the wrong type, shape, dtype, layout or device."""


def _fail(name: str, msg: str):
    raise ProjGemvError(f"proj cute: {name!r} {msg}")


def _ptr(t: torch.Tensor, align: int):
    import cutlass
    from cutlass import cute
    from cutlass.cute.runtime import make_ptr
    dt = {torch.float32: cutlass.Float32, torch.bfloat16: cutlass.BFloat16, torch.int64: cutlass.Int64,
          torch.int32: cutlass.Int32}[t.dtype]
    return make_ptr(dt, t.data_ptr(), cute.AddressSpace.gmem, assumed_align=align)


def _check(name, t, device, dtypes, dim=2):
    if not isinstance(t, torch.Tensor):
        _fail(name, f"must be a torch.Tensor, got {type(t).__name__}")
    if t.device.type != "cuda" or (device is not None and t.device != device):
        _fail(name, f"must be on the CUDA device of x, got {t.device}")
    if t.dtype not in dtypes:
        _fail(name, f"must have dtype in {[str(d).replace('torch.', '') for d in dtypes]}, got {t.dtype}")
    if t.dim() != dim:
        _fail(name, f"must have {dim} dims, got shape {tuple(t.shape)}")


def check_args(x, w, w_scale, outs, residual, pdl, *, kq: tuple, path: str = "", glu: bool = False):
    """The arguments both cute projection paths take, checked by name: pdl (None: the enclosing pdl_chain's), x, w
    (K a multiple of kq[0] for bf16, kq[1] for fp8), w_scale, outs (the GLU output counting twice) and the residual.
    Returns (pdl, B, K, N, fp8, ends: the outputs' row ends)."""
    if pdl is None:
        from k3lab_kernels.triton.pdl import chain_pdl

        pdl = chain_pdl(None)
    if not isinstance(pdl, bool):
        _fail("pdl", f"must be None or a bool, got {pdl!r}")
    _check("x", x, None, (torch.bfloat16,))
    dev = x.device
    B, K = x.shape
    if not 1 <= B <= MAX_BATCH or x.stride(1) != 1 or x.stride(0) % 8 or x.data_ptr() % 16:
        _fail("x", f"must be [1..{MAX_BATCH}, K] with unit stride along K, a row stride of 8 elements and a 16-byte "
                   f"aligned base{path}, got {tuple(x.shape)} strides {x.stride()}")
    _check("w", w, dev, (torch.bfloat16, torch.float8_e4m3fn))
    N = w.shape[0]
    fp8 = w.dtype == torch.float8_e4m3fn
    k = kq[1] if fp8 else kq[0]
    if w.shape[1] != K or K % k or not w.is_contiguous() or w.data_ptr() % 16:
        _fail("w", f"must be a contiguous 16-byte aligned [N, {K}] {'fp8' if fp8 else 'bf16'} weight (x's K, a "
                   f"multiple of {k}{path}), got {tuple(w.shape)}")
    if fp8:
        _check("w_scale", w_scale, dev, (torch.float32,), dim=1)
        if w_scale.shape[0] != N or not w_scale.is_contiguous():
            _fail("w_scale", f"must be a contiguous [{N}] fp32 tensor (one scale a row of w), got "
                             f"{tuple(w_scale.shape)}")
    elif w_scale is not None:
        _fail("w_scale", "is taken with fp8 weights only (one fp32 scale a row); these are bf16")
    if not isinstance(outs, (list, tuple)) or not 1 <= len(outs) <= MAX_OUTPUTS:
        _fail("outs", f"must be a list of 1..{MAX_OUTPUTS} tensors, got {outs!r:.60}")
    ends, total = [], 0
    for i, o in enumerate(outs):
        _check(f"outs[{i}]", o, dev, (torch.bfloat16, torch.float32))
        if o.shape[0] != B or o.shape[1] < 1 or o.stride(1) != 1:
            _fail(f"outs[{i}]", f"must be [{B}, N_i >= 1] with unit inner stride, got {tuple(o.shape)} strides "
                                f"{o.stride()}")
        total += o.shape[1] * (2 if glu and i == len(outs) - 1 else 1)
        ends.append(total)
    if total != N:
        _fail("outs", f"widths must add up to w's {N} rows{' (the GLU output counting twice)' if glu else ''}, got "
                      f"{total}")
    if residual is not None:
        if len(outs) != 1:
            _fail("residual", "is an epilogue of a single projection, not of a group")
        _check("residual", residual, dev, (torch.bfloat16,))
        if tuple(residual.shape) != (B, N) or not residual.is_contiguous():
            _fail("residual", f"must be a contiguous [{B}, {N}] bf16 tensor, got {tuple(residual.shape)}")
    return pdl, B, K, N, fp8, ends


_COUNTERS: dict[int, torch.Tensor] = {}  # per device: the fused selection's arrival counter, zero between calls


def _counter(dev: torch.device) -> torch.Tensor:
    c = _COUNTERS.get(dev.index)
    if c is None:
        c = _COUNTERS[dev.index] = torch.empty(4, dtype=torch.int32, device=dev).zero_()
    return c


def proj(x: torch.Tensor, w: torch.Tensor, outs: list, *, w_scale: torch.Tensor | None = None,
         residual: torch.Tensor | None = None, pdl: bool | None = None, select: tuple | None = None,
         chain: tuple | None = None, rmsp: tuple | None = None, glu: tuple | None = None, path: str | None = None,
         cluster: int | None = None, tile_m: int | None = None) -> list:
    """outs[i] = x W_i^T (+ residual) over the row ranges of w (module doc). select None or (e_bias [E] fp32, idx
    [B, k] int64, weights [B, k] fp32, scaling): the router's selection over outs[0] (fp32 logits [B, E]) fused
    (module doc), B <= SELECT_MAX_BATCH. chain None or (w2 [NF, R] bf16, f [B, NF] bf16): also f = outs[0] w2^T,
    outs[0] bf16 [B, R], R <= K_STEP a multiple of 8 (module doc). rmsp None or (ssp [B, P] fp32, K0, eps): the sum
    over x's first K0 columns (a multiple of K_STEP) times rsqrt(sum_p ssp[b, p] / K0 + eps) (module doc). glu None
    or (b1, b2): the last output [B, I] is situ(g, u) over W's last 2 I rows [g | u] (I even, the rows starting at a
    multiple of 4). w float8_e4m3fn [N, K] (K a multiple of 16) with w_scale [N] fp32 (W_true[n, :] = w[n, :]
    w_scale[n], applied to the fp32 sum): the plain outputs and the residual only. path None / "gemv": this
    kernel; "mma": kernels/cute/proj_mma.py (tensor cores, the plain outputs and the residual only; cluster and
    tile_m: its split of K and rows a CTA, None its own choice). Returns outs."""
    if path not in PATHS:
        _fail("path", f"must be one of {PATHS}, got {path!r}")
    if path == "mma":
        for name, v in (("select", select), ("chain", chain), ("rmsp", rmsp), ("glu", glu)):
            if v is not None:
                _fail(name, "is not taken by path 'mma' (the plain outputs and the residual are); use path 'gemv'")
        from .proj_mma import proj_mma

        return proj_mma(x, w, outs, residual=residual, w_scale=w_scale, pdl=pdl, cluster=cluster, tile_m=tile_m)
    for name, v in (("cluster", cluster), ("tile_m", tile_m)):
        if v is not None:
            _fail(name, "is an option of path 'mma' (the GEMV splits no K, one warp a row); pass None")
    if isinstance(w, torch.Tensor) and w.dtype == torch.float8_e4m3fn:
        for name, v in (("select", select), ("chain", chain), ("rmsp", rmsp), ("glu", glu)):
            if v is not None:
                _fail(name, "is not taken with fp8 weights (the plain outputs and the residual are)")
    pdl, B, K, N, fp8, ends = check_args(x, w, w_scale, outs, residual, pdl, kq=(8, 16), glu=glu is not None)
    dev = x.device
    scale_arg = _ptr(w_scale, 4) if fp8 else _ptr(x, 4)  # x: never read as the scales without fp8 weights
    rms_key, rms_args = None, [_ptr(x, 4), 0.0]  # x: never read as the partials without rmsp
    if rmsp is not None:
        if not isinstance(rmsp, (tuple, list)) or len(rmsp) != 3:
            _fail("rmsp", f"must be None or (ssp, k0, eps), got {rmsp!r:.60}")
        ssp, K0, eps = rmsp
        if isinstance(K0, bool) or not isinstance(K0, int) or not K_STEP <= K0 <= K or K0 % K_STEP:
            _fail("rmsp.k0", f"must be a multiple of {K_STEP} in {K_STEP}..{K} (whole steps of x's columns), got "
                             f"{K0!r}")
        _check("rmsp.ssp", ssp, dev, (torch.float32,))
        if ssp.shape[0] != B or not ssp.is_contiguous() or ssp.shape[1] < 1:
            _fail("rmsp.ssp", f"must be a contiguous fp32 [{B}, P] tensor (P partial sums of squares a row), got "
                              f"{tuple(ssp.shape)}")
        if isinstance(eps, bool) or not isinstance(eps, (int, float)) or not eps > 0:
            _fail("rmsp.eps", f"must be a positive number, got {eps!r}")
        rms_key, rms_args = (K0, ssp.shape[1]), [_ptr(ssp, 4), float(eps)]
    glu_key = None
    if glu is not None:
        if (not isinstance(glu, (tuple, list)) or len(glu) != 2
                or not all(isinstance(v, (int, float)) and not isinstance(v, bool) and v > 0 for v in glu)):
            _fail("glu", f"must be None or (b1, b2), two positive numbers, got {glu!r:.60}")
        lo = ends[-2] if len(ends) > 1 else 0
        if lo % _WARPS or (N - lo) % _WARPS:
            _fail("outs", f"the GLU output's rows must start at a multiple of {_WARPS} and number a multiple of "
                          f"{_WARPS} (whole CTAs: its width even), got rows {lo}..{N}")
        if chain is not None:
            _fail("glu", "is not taken with chain")
        glu_key = (float(glu[0]), float(glu[1]))
    top_k, sel_args = 0, [_ptr(x, 2), _ptr(x, 2), _ptr(x, 2), _ptr(x, 2), 1.0]  # x: never read without select
    if select is not None:
        if not isinstance(select, (tuple, list)) or len(select) != 4:
            _fail("select", f"must be None or (e_bias, idx, weights, scaling), got {select!r:.60}")
        e_bias, idx, wk, scaling = select
        E = outs[0].shape[1]
        if not 1 <= B <= SELECT_MAX_BATCH:
            _fail("select", f"is fused at batch <= {SELECT_MAX_BATCH} (one CTA selects every row), got {B}")
        if outs[0].dtype != torch.float32 or E > MAX_EXPERTS:
            _fail("outs[0]", f"must be the router's fp32 logits [B, E <= {MAX_EXPERTS}] when select is given, got "
                             f"{outs[0].dtype} {tuple(outs[0].shape)}")
        if residual is not None:
            _fail("residual", "is not taken with select")
        _check("select.e_bias", e_bias, dev, (torch.float32,), dim=1)
        if e_bias.shape[0] != E or not e_bias.is_contiguous():
            _fail("select.e_bias", f"must be a contiguous [{E}] fp32 tensor, got {tuple(e_bias.shape)}")
        _check("select.idx", idx, dev, (torch.int64,))
        top_k = idx.shape[1]
        if idx.shape[0] != B or not 1 <= top_k <= min(E, MAX_TOPK) or not idx.is_contiguous():
            _fail("select.idx", f"must be a contiguous [{B}, k] int64 tensor, 1 <= k <= {min(E, MAX_TOPK)}, got "
                                f"{tuple(idx.shape)}")
        _check("select.weights", wk, dev, (torch.float32,))
        if tuple(wk.shape) != (B, top_k) or not wk.is_contiguous():
            _fail("select.weights", f"must be a contiguous [{B}, {top_k}] fp32 tensor, got {tuple(wk.shape)}")
        if isinstance(scaling, bool) or not isinstance(scaling, (int, float)):
            _fail("select.scaling", f"must be a number, got {scaling!r}")
        sel_args = [_ptr(e_bias, 4), _ptr(idx, 8), _ptr(wk, 4), _ptr(_counter(dev), 4), float(scaling)]
    chain_key, chain_args = None, [_ptr(x, 16), _ptr(x, 2), 0]  # x: never read without chain
    if chain is not None:
        if not isinstance(chain, (tuple, list)) or len(chain) != 2:
            _fail("chain", f"must be None or (w2, f), got {chain!r:.60}")
        if select is not None or residual is not None:
            _fail("chain", "is not taken with select or residual")
        w2, f = chain
        R = outs[0].shape[1]
        if outs[0].dtype != torch.bfloat16 or R % 8 or R > K_STEP:
            _fail("outs[0]", f"must be bf16 [B, R] with R a multiple of 8 up to {K_STEP} when chain is given (the "
                             f"chained projection's input), got {outs[0].dtype} {tuple(outs[0].shape)}")
        if outs[0].stride(0) % 8 or outs[0].data_ptr() % 16:
            _fail("outs[0]", "must be 16-byte aligned with a row stride of 8 elements when chain is given")
        _check("chain.w2", w2, dev, (torch.bfloat16,))
        if w2.shape[1] != R or not w2.is_contiguous() or w2.data_ptr() % 16:
            _fail("chain.w2", f"must be a contiguous 16-byte aligned [NF, {R}] bf16 weight, got {tuple(w2.shape)}")
        _check("chain.f", f, dev, (torch.bfloat16,))
        if tuple(f.shape) != (B, w2.shape[0]) or f.stride(1) != 1:
            _fail("chain.f", f"must be [{B}, {w2.shape[0]}] bf16 with unit inner stride, got {tuple(f.shape)}")
        chain_key = (w2.shape[0], R)
        chain_args = [_ptr(w2, 16), _ptr(f, 2), f.stride(0)]
        sel_args = sel_args[:3] + [_ptr(_counter(dev), 4)] + sel_args[4:]
    pad = [outs[0]] * (MAX_OUTPUTS - len(outs))  # pointers past the outputs given: never written
    o_ptrs = [_ptr(o, o.element_size()) for o in list(outs) + pad]
    o_str = [o.stride(0) for o in list(outs) + pad]
    import cutlass

    args = [_ptr(x, 16), _ptr(w.view(torch.int32) if fp8 else w, 16), _ptr(residual if residual is not None else x, 2),
            *o_ptrs, x.stride(0), *o_str, *sel_args[:4], cutlass.Float32(sel_args[4]), *chain_args, rms_args[0],
            cutlass.Float32(rms_args[1]), scale_arg]
    key = (B, N, K, tuple(ends), tuple(o.dtype for o in outs), residual is not None, pdl, top_k, chain_key, rms_key,
           glu_key, fp8, UNROLL, PRE, SHORT_K, UNROLL_SHORT, PRE_SHORT, dev.index)
    with torch.cuda.device(dev):
        import cuda.bindings.driver as cuda

        stream = cuda.CUstream(torch.cuda.current_stream(dev).cuda_stream)
        fn = _COMPILED.get(key)
        if fn is None:
            from cutlass import cute

            fn = cute.compile(_kernel_class()(B, N, K, tuple(ends), residual is not None, pdl, top_k, chain_key,
                                              rms_key, glu_key, fp8), *args, stream)
            _COMPILED[key] = fn
        fn(*args, stream)
    return outs
