"""Latent-MoE routed experts in CuTe DSL, bf16 or fp8 weights: one token (the dense twins of the MXFP4 one-token
kernels of kernels/cute/moe_experts.py: two launches, no atomics, y written) and several tokens (`moe_grouped_dense`,
the twins of kernels/cute/moe_grouped.py: the pairs grouped by expert on the device, tensor cores straight on the
stored weights, fp32 atomics into y; `_grouped_classes` says how the fragments need no weight copy). Both use the
MXFP4 kernels' device helpers.

One token:

    act[k, i] = wk[k] situ(s1_e[i] (W1_e z)[i], s3_e[i] (W3_e z)[i])     e = idx[0, k], k < K (the top-k); fp32
    y[0, l]   = sum_k s2_e[l] sum_i W2_e[l, i] act[k, i]                  (s = 1 for bf16 weights)

  up    a CTA per (pair k, R = UP_ROWS intermediate rows of W1_e and of W3_e); thread j < NC = L / CW owns the 16-byte
        chunk j (CW = 8 bf16 or 16 fp8 columns) of each of the 2R rows: one 16-byte load a row, z's CW columns
        widened to fp32 once, the products in fp32 FMAs (fp8: a word of four codes widened exactly by two
        cvt.rn.f16x2.e4m3x2, the CuTe GEMV's e4m3_word); the 2R row sums reduced over the warp by moe_experts'
        reduce-scatter, then across warps in shared memory; thread r < R scales its two sums (fp8), applies SiTU
        and the routing weight and stores act[k, r0 + r] (fp32). A thread past the last chunk (NC rounded up to whole
        warps) redoes a valid chunk and adds 0.
  down  a CTA per R = DOWN_ROWS latent rows; thread p < K * NCD (NCD = I / CW chunks a W2 row) owns the (pair, chunk)
        product p of every row: its CW activations loaded once, the R rows' chunks of W2_e (fp8: times the pair's row
        scale); per row a reduce-scatter over the warp, then across warps in shared memory; warp 0 stores the R rows of
        y. A PDL launch after `up`: it waits for up's activations before reading anything.

Layout: z [1, L] bf16; idx [1, K] int32 or int64 (the low word read); wk [1, K] fp32; w1, w3 [E, I, L], w2 [E, L, I]
bf16, or float8_e4m3fn with one fp32 scale a row s1, s3 [E, I], s2 [E, L] (k3lab.ref.moe's fp8: W = code x scale);
y [1, L] fp32; a workspace act [K, I] fp32 (cached per device and shape: make the first call outside a CUDA graph
capture). Needs L and I multiples of CW, L / CW <= 1024 and K * I / CW <= 1024 (threads a CTA).
Exactness: bf16 and e4m3 weights and z are exact in fp32; every product and sum is fp32 (the order differs from the
reference's, within the registry's tolerance for the format).

Several tokens (moe_grouped_dense): up, a CTA (4 warps) per (pair, GROUP_ROWS = 32 intermediate rows), the group's
leader only (moe_grouped's ballot listing), members 8 at a time (the MMA's N), each lane reading its member's z
columns from L1 / L2 (no staging: no shared memory but the listing's); warp w's MMA rows g and g + 8 are row r0 + 8 w
+ g of W1 and of W3, so a lane holds g and u of one row for SiTU; UP_UNROLL chunks' loads issued before their MMAs;
CHAINS independent accumulator chains over the k-steps; act stored as bf16 pairs (fp8: f16 of 2^6 act) by the
even rows' lanes (the odd row's value by a shuffle). Down (PDL after up), a CTA per (pair, 64 GROUP_DOWN_TILES latent
rows), the leader only, the members' act as B fragments, W2 straight into A fragments, fp32 atomics into y (zeroed
by up). Needs I a multiple of 32 (fp8: 64), L of 256, B K <= MAX_PAIRS. Tolerance: the registry's (act rounded to
bf16 / f16 for the second product, as the Triton grouped path and moe_grouped do).

Floor (k3lab.ops.moe.experts_bytes): the chosen experts' W1, W3, W2 (and the fp8 scales) at the read bandwidth: one
token at TP8 bf16 16 x 8.26 MB = 132 MB, fp8 66 MB. Contract: moe_experts_dense(z, idx, wk, w1, w3, w2, s1, s3, s2, y,
*, b1, b2, pdl=None) -> y on torch's current stream; pdl=True: `up` waits for the kernel before (griddepcontrol.wait)
before its first read; None: the enclosing k3lab_kernels.triton.pdl.pdl_chain's setting; `up` triggers its dependents
after its loads with or without pdl (down starts during up's tail and waits for it). moe_grouped_dense: the same
arguments, z [B, L]; pdl None is False (moe_grouped's reason). Arguments are checked by name (MoECuteError); the
component (k3lab.components.moe.experts, backend "cute", path "token" / "grouped") passes the stored weights.
"""
from typing import Any

import torch

from .moe_experts import MoECuteError, _fail, _ptr, _tensor, one_token

__all__ = ["MAX_PAIRS", "MoECuteError", "grouped_supports", "moe_experts_dense", "moe_grouped_dense"]

# rows a CTA: intermediate rows (of W1 and of W3) of the up kernel, latent rows of the down kernel (a shape they do
# not divide takes 1); swept one axis at a time on an H100 (DOWN_ROWS 2..16, UP_ROWS 8): 4 / 4 level with the best
# everywhere (figures in docs/NOTES_moe.md, forty-fifth session)
UP_ROWS = 4
DOWN_ROWS = 4

_KERNEL_CLS = None


def _kernel_classes():
    """The two kernels' generators (built once; importing this module never needs cutlass)."""
    global _KERNEL_CLS
    if _KERNEL_CLS is not None:
        return _KERNEL_CLS
    import cuda.bindings.driver as cuda
    import cutlass
    from cutlass import BFloat16, Float32, Int32, cute

    from . import moe_experts as mx, proj_gemv as pg

    mx._kernel_classes()
    pg._kernel_class()
    ops, e4m3_word = mx.DEVICE_OPS, pg.E4M3_WORD
    vec, ids, seg_reduce, sigmoid, tanh = ops.vec, ops.ids, ops.seg_reduce, ops.sigmoid, ops.tanh

    def chunk_dot(fp8, wv, base, xf):
        """sum_j w_j xf[j] over one 16-byte chunk of weights in wv from `base` (fp8: four words of four codes at
        wv[base..base+4), 16 columns; bf16: 8 BFloat16 at wv[base..base+8)), in fp32."""
        a = Float32(0.0)
        if fp8:
            for w in range(4):
                f = e4m3_word(wv[base + w])
                for i in range(4):
                    a = a + f[i] * xf[4 * w + i]
        else:
            for q in range(8):
                a = a + wv[base + q].to(Float32) * xf[q]
        return a

    class DenseUp:
        """A CTA per (pair, R intermediate rows of W1_e and W3_e); thread j < L / CW owns chunk j of every row."""

        def __init__(self, K: int, I: int, L: int, E: int, idx_step: int, b1: float, b2: float, pdl: bool,
                     rows: int, fp8: bool):
            self.K, self.I, self.L, self.E, self.idx_step, self.R = K, I, L, E, idx_step, rows
            self.b1, self.b2, self.pdl, self.fp8 = float(b1), float(b2), bool(pdl), bool(fp8)
            self.CW = 16 if self.fp8 else 8          # columns a 16-byte chunk
            self.NC = L // self.CW                   # chunks a row
            self.NT = (self.NC + 31) // 32 * 32

        @cute.jit
        def __call__(self, p_z: cute.Pointer, p_idx: cute.Pointer, p_wk: cute.Pointer, p_w1: cute.Pointer,
                     p_w3: cute.Pointer, p_s1: cute.Pointer, p_s3: cute.Pointer, p_act: cute.Pointer,
                     stream: cuda.CUstream):
            self.kernel(p_z, p_idx, p_wk, p_w1, p_w3, p_s1, p_s3, p_act).launch(
                grid=[self.K * (self.I // self.R), 1, 1], block=[self.NT, 1, 1], stream=stream, use_pdl=self.pdl)

        @cute.kernel
        def kernel(self, p_z: cute.Pointer, p_idx: cute.Pointer, p_wk: cute.Pointer, p_w1: cute.Pointer,
                   p_w3: cute.Pointer, p_s1: cute.Pointer, p_s3: cute.Pointer, p_act: cute.Pointer):
            I, L, R, NC, NT, CW = self.I, self.L, self.R, self.NC, self.NT, self.CW
            W = NT // 32
            tid, c, lane, warp = ids()
            smem = cutlass.memory.SmemAllocator()
            s_red = smem.allocate_tensor(Float32, cute.make_layout(W * 2 * R), byte_alignment=16)  # [warp, m, r]
            k = c // (I // R)
            r0 = (c % (I // R)) * R
            j = tid % NC                 # a thread past the last chunk redoes a valid one and adds 0
            if cutlass.const_expr(self.pdl):
                cute.arch.griddepcontrol_wait()  # idx, wk and z come from the kernels before
            e = vec(p_idx, k * self.idx_step, 1)[0]
            if cutlass.const_expr(self.fp8):     # 2R rows x four words of four codes
                wv = cute.make_rmem_tensor((2 * R * 4,), Int32)
                for m in cutlass.range_constexpr(2):
                    for r in cutlass.range_constexpr(R):
                        row = e * I + r0 + r
                        cute.autovec_copy(vec(p_w1 if m == 0 else p_w3, cute.assume(row * (L // 4) + 4 * j, divby=4),
                                              4), cute.make_tensor(wv.iterator + (m * R + r) * 4, cute.make_layout(4)))
            else:                                # 2R rows x 8 bf16
                wv = cute.make_rmem_tensor((2 * R * 8,), BFloat16)
                for m in cutlass.range_constexpr(2):
                    for r in cutlass.range_constexpr(R):
                        row = e * I + r0 + r
                        cute.autovec_copy(vec(p_w1 if m == 0 else p_w3, cute.assume(row * L + 8 * j, divby=8), 8),
                                          cute.make_tensor(wv.iterator + (m * R + r) * 8, cute.make_layout(8)))
            # the finishing threads' row scales and routing weight, in flight with the weights (after the sums they
            # would be one more dependent round trip a CTA)
            fin = cute.make_rmem_tensor((3,), Float32)   # [routing weight, s1, s3 (fp8)]
            ti = cutlass.select_(tid < R, tid, Int32(0))
            fin[0] = vec(p_wk, k, 1)[0]
            if cutlass.const_expr(self.fp8):
                fin[1] = vec(p_s1, e * I + r0 + ti, 1)[0]
                fin[2] = vec(p_s3, e * I + r0 + ti, 1)[0]
            zr = cute.make_rmem_tensor((CW,), BFloat16)
            for h in cutlass.range_constexpr(CW // 8):
                cute.autovec_copy(vec(p_z, cute.assume(CW * j + 8 * h, divby=8), 8),
                                  cute.make_tensor(zr.iterator + 8 * h, cute.make_layout(8)))
            zf = cute.make_rmem_tensor((CW,), Float32)
            for q in cutlass.range_constexpr(CW):
                zf[q] = zr[q].to(Float32)
            acc = cute.make_rmem_tensor((2 * R,), Float32)
            for jr in cutlass.range_constexpr(2 * R):
                acc[jr] = cutlass.select_(tid < NC, chunk_dot(self.fp8, wv, jr * (4 if self.fp8 else 8), zf),
                                          Float32(0.0))
            # down may launch now (it waits for this grid before reading act); without pdl this grid has no wait of
            # its own and its predecessor is done, so the trigger is always safe
            cute.arch.griddepcontrol_launch_dependents()
            start, cur, plain = seg_reduce(acc, 2 * R, 32, lane)
            if (lane & plain) == 0:
                for i in cutlass.range_constexpr(cur):
                    s_red[warp * 2 * R + start + i] = acc[i]
            cute.arch.sync_threads()
            if tid < R:                  # intermediate row r0 + tid: its W1 and W3 sums over the warps
                g = s_red[tid]
                u = s_red[R + tid]
                for w in cutlass.range_constexpr(1, W):
                    g = g + s_red[w * 2 * R + tid]
                    u = u + s_red[w * 2 * R + R + tid]
                if cutlass.const_expr(self.fp8):  # W = code x the row's scale
                    g = g * fin[1]
                    u = u * fin[2]
                wt = fin[0]
                vec(p_act, k * I + r0 + tid, 1)[0] = (wt * (self.b1 * tanh(g / self.b1) * sigmoid(g))
                                                      * (self.b2 * tanh(u / self.b2)))

    class DenseDown:
        """A CTA per R latent rows; thread p < K * I / CW owns the (pair k, chunk) product of every row; a PDL launch
        after DenseUp."""

        def __init__(self, K: int, I: int, L: int, E: int, idx_step: int, rows: int, fp8: bool):
            self.K, self.I, self.L, self.E, self.idx_step, self.R, self.fp8 = K, I, L, E, idx_step, rows, bool(fp8)
            self.CW = 16 if self.fp8 else 8
            self.NCD = I // self.CW                  # chunks a W2 row
            self.NP = K * self.NCD                   # (pair, chunk) products a row
            self.NT = (self.NP + 31) // 32 * 32
            assert rows <= 32

        @cute.jit
        def __call__(self, p_idx: cute.Pointer, p_w2: cute.Pointer, p_s2: cute.Pointer, p_act: cute.Pointer,
                     p_y: cute.Pointer, stream: cuda.CUstream):
            self.kernel(p_idx, p_w2, p_s2, p_act, p_y).launch(grid=[self.L // self.R, 1, 1], block=[self.NT, 1, 1],
                                                              stream=stream, use_pdl=True)

        @cute.kernel
        def kernel(self, p_idx: cute.Pointer, p_w2: cute.Pointer, p_s2: cute.Pointer, p_act: cute.Pointer,
                   p_y: cute.Pointer):
            I, L, R, NP, NT, CW, NCD = self.I, self.L, self.R, self.NP, self.NT, self.CW, self.NCD
            W = NT // 32
            tid, c, lane, warp = ids()
            smem = cutlass.memory.SmemAllocator()
            s_red = smem.allocate_tensor(Float32, cute.make_layout(W * R), byte_alignment=16)  # [warp, row]
            q = tid % NP                 # an idle thread redoes a valid product and adds 0
            k = q // NCD
            ch = q % NCD
            cute.arch.griddepcontrol_wait()  # the activations of DenseUp (and idx, from before it)
            cute.arch.griddepcontrol_launch_dependents()
            e = vec(p_idx, k * self.idx_step, 1)[0]
            if cutlass.const_expr(self.fp8):
                wv = cute.make_rmem_tensor((R * 4,), Int32)
                for r in cutlass.range_constexpr(R):
                    row = e * L + c * R + r
                    cute.autovec_copy(vec(p_w2, cute.assume(row * (I // 4) + 4 * ch, divby=4), 4),
                                      cute.make_tensor(wv.iterator + 4 * r, cute.make_layout(4)))
            else:
                wv = cute.make_rmem_tensor((R * 8,), BFloat16)
                for r in cutlass.range_constexpr(R):
                    row = e * L + c * R + r
                    cute.autovec_copy(vec(p_w2, cute.assume(row * I + 8 * ch, divby=8), 8),
                                      cute.make_tensor(wv.iterator + 8 * r, cute.make_layout(8)))
            sc = cute.make_rmem_tensor((R,), Float32)   # fp8: this pair's expert's scales of latent rows c R + r
            if cutlass.const_expr(self.fp8):
                for r in cutlass.range_constexpr(R):
                    sc[r] = vec(p_s2, e * L + c * R + r, 1)[0]
            av = cute.make_rmem_tensor((CW,), Float32)
            for h in cutlass.range_constexpr(CW // 4):
                cute.autovec_copy(vec(p_act, cute.assume(k * I + CW * ch + 4 * h, divby=4), 4),
                                  cute.make_tensor(av.iterator + 4 * h, cute.make_layout(4)))
            acc = cute.make_rmem_tensor((R,), Float32)
            for r in cutlass.range_constexpr(R):
                a = chunk_dot(self.fp8, wv, r * (4 if self.fp8 else 8), av)
                if cutlass.const_expr(self.fp8):  # W = code x the row's scale
                    a = a * sc[r]
                acc[r] = cutlass.select_(tid < NP, a, Float32(0.0))
            start, cur, plain = seg_reduce(acc, R, 32, lane)
            if (lane & plain) == 0:
                for i in cutlass.range_constexpr(cur):
                    s_red[warp * R + start + i] = acc[i]
            cute.arch.sync_threads()
            if tid < R:                  # latent row c R + tid over the warps
                tot = s_red[tid]
                for w in cutlass.range_constexpr(1, W):
                    tot = tot + s_red[w * R + tid]
                vec(p_y, c * R + tid, 1)[0] = tot

    _KERNEL_CLS = (DenseUp, DenseDown)
    return _KERNEL_CLS


# ---------------------------------------------------------------------------------------------
# Several tokens: the pairs grouped by expert, tensor cores (the twins of kernels/cute/moe_grouped.py)
# ---------------------------------------------------------------------------------------------

GROUP_ROWS = 32         # intermediate rows an up CTA (4 warps x 8: MMA rows g / g + 8 = W1 / W3 row g of the warp)
GROUP_DOWN_TILES = 4    # tiles of 16 latent rows a warp of the down kernel (a CTA: 64 x tiles latent rows)
CHAINS = 4              # independent MMA accumulator chains a warp (k-steps taken round-robin, summed at the end)
UP_UNROLL = 4           # chunks of L an up step: their weight and z loads issued before their MMAs
MAX_PAIRS = 4096
# one m16n8k16 MMA with fp32 accumulation on bf16 operands (PTX fragment layouts; the f16 one is moe_grouped's)
MMA_PTX = {"bf16": ("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {$0, $1, $2, $3}, {$4, $5, $6, $7}, "
                    "{$8, $9}, {$10, $11, $12, $13};")}
# a word of four e4m3 codes (byte 0 the lowest column) -> two f16x2 words: columns 0, 1 and 2, 3 (exact)
# two fp32 -> one bf16x2 / f16x2 word ($2 in the low half)
PACK_PTX = {"bf16": "cvt.rn.bf16x2.f32 $0, $1, $2;", "f16": "cvt.rn.f16x2.f32 $0, $1, $2;"}
E4M3_F16_PTX = "\n".join(["{", ".reg .b16 lo, hi;", "mov.b32 {lo, hi}, $2;", "cvt.rn.f16x2.e4m3x2 $0, lo;",
                          "cvt.rn.f16x2.e4m3x2 $1, hi;", "}"])

_GROUPED_CLS = None
# the fragment helpers the grouped kernels are written with (mma by operand type, e4m3_f16, a_pairs), for the
# few-token tensor-core projection (kernels/cute/proj_mma.py): set by _grouped_classes()
MMA_OPS = None


def _grouped_classes():
    """The grouped kernels' generators (built once; importing this module never needs cutlass).

    Fragments without a weight copy: the m16n8k16 A fragment of lane (g, t) holds k = 2t, 2t+1 (register pair 0) and
    2t+8, 2t+9 (pair 1) of rows g and g + 8, the B fragment the same k of column g; a dot product does not care which
    column a k is, so k-step s of a chunk of 4 CW columns takes, for lane t, the columns CW t + 4 s .. + 3 (pair 0 the
    first two) of the weight rows and of the activations alike. A lane's 16-byte load of a row (CW columns) is then
    CW / 4 k-steps of A registers: bf16 pairs as stored, fp8 words widened by cvt.rn.f16x2.e4m3x2 (f16 MMAs, the
    activations as f16 of 2^6 x, moe_grouped's scaling: exact for 2^-20 <= |x| < 1023)."""
    global _GROUPED_CLS, MMA_OPS
    if _GROUPED_CLS is not None:
        return _GROUPED_CLS
    import cuda.bindings.driver as cuda
    import cutlass
    from cutlass import Float32, Int32, cute
    from cutlass._mlir.dialects import llvm as _llvm
    from cutlass.cutlass_dsl import dsl_user_op

    from . import moe_grouped as mg

    mg._kernel_classes()
    ops = mg.DEVICE_OPS
    vec, ids, group, WC, to_f16x2, asm = ops.vec, ops.ids, ops.group, ops.WC, ops.to_f16x2, ops.asm
    sigmoid, tanh = ops.sigmoid, ops.tanh
    THREADS, NMEM = mg._THREADS, mg.NMEM

    def mma_fn(dt):
        @dsl_user_op
        def mma(a0, a1, a2, a3, b0, b1, c0, c1, c2, c3, *, loc=None, ip=None):
            ops_ = ([Int32(x).ir_value(loc=loc, ip=ip) for x in (a0, a1, a2, a3, b0, b1)]
                    + [Float32(x).ir_value(loc=loc, ip=ip) for x in (c0, c1, c2, c3)])
            res = asm(_llvm.StructType.get_literal([Float32.mlir_type] * 4), ops_, MMA_PTX[dt],
                      "=f,=f,=f,=f,r,r,r,r,r,r,f,f,f,f", loc, ip)
            return [Float32(_llvm.extractvalue(Float32.mlir_type, res, [i], loc=loc, ip=ip)) for i in range(4)]
        return mma

    def pack_fn(dt):
        @dsl_user_op
        def pack(hi, lo, *, loc=None, ip=None):
            ops_ = [Float32(hi).ir_value(loc=loc, ip=ip), Float32(lo).ir_value(loc=loc, ip=ip)]
            return Int32(asm(Int32.mlir_type, ops_, PACK_PTX[dt], "=r,f,f", loc, ip))
        return pack

    MMA = {"bf16": mma_fn("bf16"), "f16": ops.mma}  # f16: moe_grouped's own
    PACK = {"bf16": pack_fn("bf16"), "f16": pack_fn("f16")}

    @dsl_user_op
    def e4m3_f16(w, *, loc=None, ip=None):
        res = asm(_llvm.StructType.get_literal([Int32.mlir_type] * 2), [Int32(w).ir_value(loc=loc, ip=ip)],
                  E4M3_F16_PTX, "=r,=r,r", loc, ip)
        return [Int32(_llvm.extractvalue(Int32.mlir_type, res, [i], loc=loc, ip=ip)) for i in range(2)]

    def member_tile(cnt, mt, g):
        """(members in tile mt, this lane's member: g, or member 0 past the last, whose results are discarded)."""
        r = cnt - mt * NMEM
        tc = cutlass.select_(r > NMEM, Int32(NMEM), r)
        return tc, cutlass.select_(g >= tc, Int32(0), g)

    def chain_mma(mma, acc, k0, pa, pb, b0, b1):
        """acc[k0 .. k0 + 4) += the m16n8k16 product of A pairs pa (row g), pb (row g + 8) and B words b0, b1."""
        d = mma(pa[0], pb[0], pa[1], pb[1], b0, b1, acc[k0], acc[k0 + 1], acc[k0 + 2], acc[k0 + 3])
        for v in range(4):
            acc[k0 + v] = d[v]

    def chains_sum(acc):
        """acc[0 .. 4) = the sum of the CHAINS accumulator fragments."""
        for k in range(1, CHAINS):
            for u in range(4):
                acc[u] = acc[u] + acc[4 * k + u]

    def a_pairs(fp8, w, base, s):
        """Register pairs 0 and 1 of k-step s from a row's 16-byte chunk w[base .. base + 4) (module doc)."""
        if fp8:
            return e4m3_f16(w[base + s])
        return [w[base + 2 * s], w[base + 2 * s + 1]]

    class GroupedUp:
        """A CTA per (pair, GROUP_ROWS intermediate rows); the group's leader only; member tiles of 8 (the MMA's N)."""

        def __init__(self, B: int, K: int, I: int, L: int, step: int, b1: float, b2: float, pdl: bool, fp8: bool):
            self.B, self.K, self.I, self.L, self.step = B, K, I, L, step
            self.b1, self.b2, self.pdl, self.fp8 = float(b1), float(b2), bool(pdl), bool(fp8)
            self.N = B * K
            self.RT = I // GROUP_ROWS
            self.CW = 16 if self.fp8 else 8
            self.NCH = L // (4 * self.CW)            # chunks of 4 CW columns
            self.UNR = next(u for u in (UP_UNROLL, 2, 1) if self.NCH % u == 0)
            self.RND = (self.N + THREADS - 1) // THREADS

        @cute.jit
        def __call__(self, p_z: cute.Pointer, p_idx: cute.Pointer, p_wk: cute.Pointer, p_w1: cute.Pointer,
                     p_w3: cute.Pointer, p_s1: cute.Pointer, p_s3: cute.Pointer, p_act: cute.Pointer,
                     p_y: cute.Pointer, stream: cuda.CUstream):
            self.kernel(p_z, p_idx, p_wk, p_w1, p_w3, p_s1, p_s3, p_act, p_y).launch(
                grid=[self.N * self.RT, 1, 1], block=[THREADS, 1, 1], stream=stream, use_pdl=self.pdl)

        @cute.kernel
        def kernel(self, p_z: cute.Pointer, p_idx: cute.Pointer, p_wk: cute.Pointer, p_w1: cute.Pointer,
                   p_w3: cute.Pointer, p_s1: cute.Pointer, p_s3: cute.Pointer, p_act: cute.Pointer,
                   p_y: cute.Pointer):
            K, I, L, N, RT, CW, NCH, UNR = self.K, self.I, self.L, self.N, self.RT, self.CW, self.NCH, self.UNR
            fp8 = self.fp8
            mma, pack = MMA["f16" if fp8 else "bf16"], PACK["f16" if fp8 else "bf16"]
            RWW = L * (1 if fp8 else 2) // 4   # words a weight row
            KS = CW // 4                 # k-steps a chunk
            ZW = CW // 2                 # z words a chunk a lane
            tid, c, lane, warp, g, t = ids()
            smem = cutlass.memory.SmemAllocator()
            s_mem = smem.allocate_tensor(Int32, cute.make_layout(N), byte_alignment=16)
            s_wc = smem.allocate_tensor(Int32, cute.make_layout(WC(self.RND) + 1), byte_alignment=16)
            if cutlass.const_expr(self.pdl):
                cute.arch.griddepcontrol_wait()  # idx, wk and z come from the kernels before; y may be read there
            for i in range(c * THREADS + tid, self.B * L, N * RT * THREADS):
                vec(p_y, i, 1)[0] = Float32(0.0)
            p = c // RT
            r0 = (c % RT) * GROUP_ROWS + 8 * warp
            e = vec(p_idx, p * self.step, 1)[0]
            group(p_idx, e, tid, lane, warp, s_mem, s_wc, N, self.step)
            if s_mem[0] == p:            # the group's leader (CTA-uniform)
                cnt = s_wc[WC(self.RND)]
                row = e * I + r0 + g     # W1 row (MMA row g) and W3 row (MMA row g + 8)
                for mt in range((cnt + NMEM - 1) // NMEM):
                    tc, gz = member_tile(cnt, mt, g)
                    zrow = (s_mem[mt * NMEM + gz] // K) * (L // 2)   # member gz's z row (words), from L1 / L2
                    acc = cute.make_rmem_tensor((4 * CHAINS,), Float32)
                    for u in cutlass.range_constexpr(4 * CHAINS):
                        acc[u] = Float32(0.0)
                    for c0 in range(0, NCH, UNR):  # UNR chunks: every load issued, then the MMAs
                        wv = cute.make_rmem_tensor((UNR * 8,), Int32)
                        zv = cute.make_rmem_tensor((UNR * ZW,), Int32)
                        for u in cutlass.range_constexpr(UNR):
                            col0 = 4 * CW * (c0 + u) + CW * t    # this lane's columns of the chunk
                            for m in cutlass.range_constexpr(2):
                                off = cute.assume(row * RWW + col0 * (1 if fp8 else 2) // 4, divby=4)
                                cute.autovec_copy(vec(p_w1 if m == 0 else p_w3, off, 4),
                                                  cute.make_tensor(wv.iterator + 8 * u + 4 * m, cute.make_layout(4)))
                            for h in cutlass.range_constexpr(ZW // 4):
                                cute.autovec_copy(vec(p_z, cute.assume(zrow + col0 // 2 + 4 * h, divby=4), 4),
                                                  cute.make_tensor(zv.iterator + ZW * u + 4 * h, cute.make_layout(4)))
                        for u in cutlass.range_constexpr(UNR):
                            for s in cutlass.range_constexpr(KS):
                                pa = a_pairs(fp8, wv, 8 * u, s)
                                pb = a_pairs(fp8, wv, 8 * u + 4, s)
                                zb0, zb1 = zv[ZW * u + 2 * s], zv[ZW * u + 2 * s + 1]
                                if cutlass.const_expr(fp8):  # f16 of 2^6 z (moe_grouped's scaling)
                                    zb0, zb1 = to_f16x2(zb0), to_f16x2(zb1)
                                chain_mma(mma, acc, 4 * ((u * KS + s) % CHAINS), pa, pb, zb0, zb1)
                    chains_sum(acc)
                    # acc: W1 row x members 2t, 2t + 1, then W3 row x the same
                    f1, f3 = Float32(1.0), Float32(1.0)
                    if cutlass.const_expr(fp8):  # the rows' scales, and 2^-6 of z's f16
                        f1 = vec(p_s1, row, 1)[0] * 0.015625
                        f3 = vec(p_s3, row, 1)[0] * 0.015625
                    # act of rows r0 + g (this lane) and r0 + g + 1 (lane ^ 4) as one word a member, stored by the
                    # even rows' lanes (fp8: f16 of 2^6 act, moe_grouped's scaling, undone in the down kernel)
                    for col in cutlass.range_constexpr(2):
                        ok = 2 * t + col < tc
                        qi = mt * NMEM + 2 * t + col
                        if not ok:
                            qi = mt * NMEM
                        q = s_mem[qi]
                        gg = acc[col] * f1
                        uu = acc[2 + col] * f3
                        a = vec(p_wk, q, 1)[0] * (self.b1 * tanh(gg / self.b1) * sigmoid(gg)) * (
                            self.b2 * tanh(uu / self.b2))
                        if cutlass.const_expr(fp8):
                            a = a * 64.0
                        o = cute.arch.shuffle_sync_bfly(a, offset=4)
                        if ok and g % 2 == 0:
                            vec(p_act, q * (I // 2) + (r0 + g) // 2, 1)[0] = pack(o, a)
            if cutlass.const_expr(self.pdl):
                cute.arch.griddepcontrol_launch_dependents()

    class GroupedDown:
        """A CTA per (pair, 64 GROUP_DOWN_TILES latent rows); the leader only; PDL after GroupedUp (it waits for up
        before reading anything); fp32 atomics into y (zeroed by up)."""

        def __init__(self, B: int, K: int, I: int, L: int, step: int, fp8: bool, tiles: int):
            self.B, self.K, self.I, self.L, self.step, self.fp8 = B, K, I, L, step, bool(fp8)
            self.N = B * K
            self.DT = tiles
            self.DR = 64 * tiles
            self.LT = L // self.DR
            self.CW = 16 if self.fp8 else 8
            self.RND = (self.N + THREADS - 1) // THREADS

        @cute.jit
        def __call__(self, p_idx: cute.Pointer, p_w2: cute.Pointer, p_s2: cute.Pointer, p_act: cute.Pointer,
                     p_y: cute.Pointer, stream: cuda.CUstream):
            self.kernel(p_idx, p_w2, p_s2, p_act, p_y).launch(grid=[self.N * self.LT, 1, 1], block=[THREADS, 1, 1],
                                                              stream=stream, use_pdl=True)

        @cute.kernel
        def kernel(self, p_idx: cute.Pointer, p_w2: cute.Pointer, p_s2: cute.Pointer, p_act: cute.Pointer,
                   p_y: cute.Pointer):
            K, I, L, N, CW = self.K, self.I, self.L, self.N, self.CW
            fp8 = self.fp8
            mma = MMA["f16" if fp8 else "bf16"]
            RWW = I * (1 if fp8 else 2) // 4   # words a W2 row
            NCH = I // (4 * CW)
            KS = CW // 4
            tid, c, lane, warp, g, t = ids()
            smem = cutlass.memory.SmemAllocator()
            s_mem = smem.allocate_tensor(Int32, cute.make_layout(N), byte_alignment=16)
            s_wc = smem.allocate_tensor(Int32, cute.make_layout(WC(self.RND) + 1), byte_alignment=16)
            cute.arch.griddepcontrol_wait()  # up's act and zeroed y (and idx, from before it)
            p = c // self.LT
            l0 = (c % self.LT) * self.DR + warp * (16 * self.DT) + g
            e = vec(p_idx, p * self.step, 1)[0]
            group(p_idx, e, tid, lane, warp, s_mem, s_wc, N, self.step)
            if s_mem[0] == p:
                cnt = s_wc[WC(self.RND)]
                for mt in range((cnt + NMEM - 1) // NMEM):
                    tc, gz = member_tile(cnt, mt, g)
                    qz = s_mem[mt * NMEM + gz]
                    bw = cute.make_rmem_tensor((NCH * CW // 2,), Int32)   # member gz's act: CW / 2 words a chunk
                    for ch in cutlass.range_constexpr(NCH):
                        for h in cutlass.range_constexpr(CW // 8):
                            off = cute.assume(qz * (I // 2) + (4 * CW * ch + CW * t) // 2 + 4 * h, divby=4)
                            cute.autovec_copy(vec(p_act, off, 4),
                                              cute.make_tensor(bw.iterator + ch * (CW // 2) + 4 * h,
                                                               cute.make_layout(4)))
                    for tile in cutlass.range(self.DT, unroll=1):
                        ra = e * L + l0 + 16 * tile  # MMA rows g (ra) and g + 8 (ra + 8)
                        acc = cute.make_rmem_tensor((4 * CHAINS,), Float32)
                        for u in cutlass.range_constexpr(4 * CHAINS):
                            acc[u] = Float32(0.0)
                        for ch in cutlass.range_constexpr(NCH):
                            col0 = 4 * CW * ch + CW * t
                            wv = cute.make_rmem_tensor((8,), Int32)
                            for h in cutlass.range_constexpr(2):
                                off = cute.assume((ra + 8 * h) * RWW + col0 * (1 if fp8 else 2) // 4, divby=4)
                                cute.autovec_copy(vec(p_w2, off, 4),
                                                  cute.make_tensor(wv.iterator + 4 * h, cute.make_layout(4)))
                            for s in cutlass.range_constexpr(KS):
                                pa = a_pairs(fp8, wv, 0, s)
                                pb = a_pairs(fp8, wv, 4, s)
                                bb = ch * (CW // 2) + 2 * s
                                chain_mma(mma, acc, 4 * ((ch * KS + s) % CHAINS), pa, pb, bw[bb], bw[bb + 1])
                        chains_sum(acc)
                        fa, fb = Float32(1.0), Float32(1.0)
                        if cutlass.const_expr(fp8):  # the rows' scales, and 2^-6 of the staged act
                            fa = vec(p_s2, ra, 1)[0] * 0.015625
                            fb = vec(p_s2, ra + 8, 1)[0] * 0.015625
                        for col in cutlass.range_constexpr(2):
                            if 2 * t + col < tc:
                                b = s_mem[mt * NMEM + 2 * t + col] // K
                                cute.arch.atomic_add(p_y + (b * L + l0 + 16 * tile), acc[col] * fa)
                                cute.arch.atomic_add(p_y + (b * L + l0 + 16 * tile + 8), acc[2 + col] * fb)

    import types

    MMA_OPS = types.SimpleNamespace(mma=MMA, e4m3_f16=e4m3_f16, a_pairs=a_pairs, asm=asm)
    _GROUPED_CLS = (GroupedUp, GroupedDown)
    return _GROUPED_CLS


# ---------------------------------------------------------------------------------------------
# Host wrapper
# ---------------------------------------------------------------------------------------------

_COMPILED: dict[tuple, Any] = {}
_WS: dict[tuple, torch.Tensor] = {}
DTYPES = (torch.bfloat16, torch.float8_e4m3fn)


def rows_of(I: int, L: int) -> tuple[int, int]:
    """The rows a CTA of (up, down) at intermediate size I and latent L: UP_ROWS / DOWN_ROWS where they divide,
    else 1."""
    return (UP_ROWS if I % UP_ROWS == 0 else 1), (DOWN_ROWS if L % DOWN_ROWS == 0 else 1)


def _first(w1):
    """w1 checked as the experts' stored weights; (E, I, fp8)."""
    if not isinstance(w1, torch.Tensor) or w1.dim() != 3 or w1.dtype not in DTYPES:
        _fail("w1", f"must be the experts' [E, I, L] bf16 or float8_e4m3fn weights, got "
                    f"{getattr(w1, 'dtype', type(w1).__name__)} {tuple(getattr(w1, 'shape', ()))}")
    return w1.shape[0], w1.shape[1], w1.dtype == torch.float8_e4m3fn


def _check_all(z, idx, wk, w1, w3, w2, s1, s3, s2, y, B: int, K: int):
    """Both wrappers' tensor checks, by name: z [B, L] bf16, the stored weights of one format, the fp8 row scales
    (None with bf16), ids, routing weights and y."""
    dev, L = z.device, z.shape[1]
    E, I = w1.shape[0], w1.shape[1]
    _tensor("z", z, None, (torch.bfloat16,), (B, L))
    _tensor("w1", w1, dev, (w1.dtype,), (E, I, L))
    _tensor("w3", w3, dev, (w1.dtype,), (E, I, L))
    _tensor("w2", w2, dev, (w1.dtype,), (E, L, I))
    _tensor("idx", idx, dev, (torch.int32, torch.int64), (B, K))
    _tensor("wk", wk, dev, (torch.float32,), (B, K))
    _tensor("y", y, dev, (torch.float32,), (B, L))
    if w1.dtype == torch.float8_e4m3fn:
        _tensor("s1", s1, dev, (torch.float32,), (E, I))
        _tensor("s3", s3, dev, (torch.float32,), (E, I))
        _tensor("s2", s2, dev, (torch.float32,), (E, L))
    else:
        for name, sc in (("s1", s1), ("s3", s3), ("s2", s2)):
            if sc is not None:
                _fail(name, "is the fp8 weights' row scale; these weights are bf16 (pass None)")


def moe_experts_dense(z, idx, wk, w1, w3, w2, s1, s3, s2, y, *, b1: float = 4.0, b2: float = 25.0,
                      pdl: bool | None = None):
    """y [1, L] fp32 = the routed experts of one token, bf16 or fp8 weights (module docstring). Returns y."""
    pdl = one_token(z, pdl)
    E, I, fp8 = _first(w1)
    dev, L = z.device, z.shape[1]
    cw = 16 if fp8 else 8
    if L % cw or I % cw:
        _fail("z", f"L and I must be multiples of {cw} (16-byte chunks of {w1.dtype} rows), got L={L}, I={I}")
    if not isinstance(idx, torch.Tensor) or idx.dim() != 2 or idx.shape[0] != 1:
        _fail("idx", f"must be [1, K] expert ids, got {getattr(idx, 'shape', idx)!r}")
    K = idx.shape[1]
    _check_all(z, idx, wk, w1, w3, w2, s1, s3, s2, y, 1, K)
    if L // cw > 1024:
        _fail("z", f"L / {cw} must be at most 1024 (a thread a chunk in the up kernel), got {L // cw}")
    if K * (I // cw) > 1024:
        _fail("idx", f"top-k x I / {cw} must be at most 1024 (a thread a product in the down kernel), got "
                     f"{K} x {I // cw}")
    step = 2 if idx.dtype == torch.int64 else 1
    key_ws = (dev.index, K, I)
    act = _WS.get(key_ws)
    if act is None:
        act = _WS[key_ws] = torch.empty(K, I, dtype=torch.float32, device=dev)

    def wp(t):
        return _ptr(t.view(torch.int32), 16) if fp8 else _ptr(t, 16)

    def sp(t):
        return _ptr(t, 4) if fp8 else _ptr(y, 4)  # y: never read as a scale with bf16 weights

    up_args = [_ptr(z, 16), _ptr(idx.view(torch.int32), 4), _ptr(wk, 4), wp(w1), wp(w3), sp(s1), sp(s3),
               _ptr(act, 16)]
    down_args = [_ptr(idx.view(torch.int32), 4), wp(w2), sp(s2), _ptr(act, 16), _ptr(y, 4)]
    up_rows, down_rows = rows_of(I, L)
    key = (K, I, L, E, step, float(b1), float(b2), pdl, dev.index, up_rows, down_rows, fp8)
    with torch.cuda.device(dev):
        import cuda.bindings.driver as cuda

        stream = cuda.CUstream(torch.cuda.current_stream(dev).cuda_stream)
        fns = _COMPILED.get(key)
        if fns is None:
            from cutlass import cute

            up_cls, down_cls = _kernel_classes()
            fns = (cute.compile(up_cls(K, I, L, E, step, b1, b2, pdl, up_rows, fp8), *up_args, stream),
                   cute.compile(down_cls(K, I, L, E, step, down_rows, fp8), *down_args, stream))
            _COMPILED[key] = fns
        fns[0](*up_args, stream)
        fns[1](*down_args, stream)
    return y


_GCOMPILED: dict[tuple, Any] = {}
_GWS: dict[tuple, torch.Tensor] = {}


def grouped_supports(B: int, K: int, I: int, L: int, fp8: bool) -> str | None:
    """Why the grouped bf16 / fp8 kernels cannot take these sizes, or None."""
    cw = 16 if fp8 else 8
    if I % GROUP_ROWS or I % (4 * cw):
        return (f"the grouped cute {'fp8' if fp8 else 'bf16'} experts need the per-GPU intermediate a multiple of "
                f"{max(GROUP_ROWS, 4 * cw)}, got {I}")
    if L % (64 * GROUP_DOWN_TILES) or L % (4 * cw):
        return (f"the grouped cute {'fp8' if fp8 else 'bf16'} experts need the latent a multiple of "
                f"{64 * GROUP_DOWN_TILES}, got {L}")
    if B * K > MAX_PAIRS:
        return f"the grouped cute experts take batch x top-k <= {MAX_PAIRS}, got {B} x {K}"
    return None


def moe_grouped_dense(z, idx, wk, w1, w3, w2, s1, s3, s2, y, *, b1: float = 4.0, b2: float = 25.0,
                      pdl: bool | None = None):
    """y [B, L] fp32 = the routed experts of B tokens, bf16 or fp8 weights, pairs grouped by expert on tensor cores
    (`_grouped_classes`); y is zeroed by the up kernel and accumulated with fp32 atomics by the down kernel. pdl None
    is False (as moe_grouped: thousands of waiting CTAs launched early cost the step more than PDL saves). Returns y."""
    import cutlass

    from .kda_decode import gmem_ptr

    if pdl is None:
        pdl = False
    if not isinstance(pdl, bool):
        _fail("pdl", f"must be None or a bool, got {pdl!r}")
    if not isinstance(z, torch.Tensor) or z.dim() != 2:
        _fail("z", f"must be [B, L] bf16, got {getattr(z, 'shape', z)!r}")
    E, I, fp8 = _first(w1)
    dev, (B, L) = z.device, z.shape
    if not isinstance(idx, torch.Tensor) or idx.dim() != 2 or idx.shape[0] != B:
        _fail("idx", f"must be [B={B}, K] expert ids, got {getattr(idx, 'shape', idx)!r}")
    K = idx.shape[1]
    why = grouped_supports(B, K, I, L, fp8)
    if why:
        _fail("z", why)
    _check_all(z, idx, wk, w1, w3, w2, s1, s3, s2, y, B, K)
    step = 2 if idx.dtype == torch.int64 else 1
    N = B * K
    key_ws = (dev.index, N, I, fp8)
    act = _GWS.get(key_ws)
    if act is None:
        act = _GWS[key_ws] = torch.empty(N, I // 2, dtype=torch.int32, device=dev)  # bf16 / f16 pairs
    I32, F32 = cutlass.Int32, cutlass.Float32
    words = [gmem_ptr(t.view(torch.int32), I32, 16) for t in (w1, w3, w2)]
    scales = [gmem_ptr(t, F32, 4) if fp8 else gmem_ptr(y, F32, 4) for t in (s1, s3, s2)]  # y: never read as a scale
    up_args = [gmem_ptr(z.view(torch.int32), I32, 16), gmem_ptr(idx.view(torch.int32), I32, 4), gmem_ptr(wk, F32, 4),
               words[0], words[1], scales[0], scales[1], gmem_ptr(act, I32, 16), gmem_ptr(y, F32, 16)]
    down_args = [gmem_ptr(idx.view(torch.int32), I32, 4), words[2], scales[2], gmem_ptr(act, I32, 16),
                 gmem_ptr(y, F32, 16)]
    key = (B, K, I, L, step, float(b1), float(b2), pdl, dev.index, fp8, GROUP_DOWN_TILES, CHAINS, UP_UNROLL)
    with torch.cuda.device(dev):
        import cuda.bindings.driver as cuda

        stream = cuda.CUstream(torch.cuda.current_stream(dev).cuda_stream)
        fns = _GCOMPILED.get(key)
        if fns is None:
            from cutlass import cute

            up_cls, down_cls = _grouped_classes()
            fns = (cute.compile(up_cls(B, K, I, L, step, b1, b2, pdl, fp8), *up_args, stream),
                   cute.compile(down_cls(B, K, I, L, step, fp8, GROUP_DOWN_TILES), *down_args, stream))
            _GCOMPILED[key] = fns
        fns[0](*up_args, stream)
        fns[1](*down_args, stream)
    return y
