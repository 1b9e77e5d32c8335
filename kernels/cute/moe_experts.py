"""Latent-MoE routed experts of one token in CuTe DSL, MXFP4 weights (the batch-1 twin of the Triton simt path):
two launches, no atomics, no tickets, y written (not accumulated).

    act[k, i] = 2^6 wk[k] situ(W1_e z, W3_e z)[i]      e = idx[0, k], k < K (the top-k); f16, the 2^6 undone by
    y[0, l]   = sum_k wk[k] sum_i W2_e[l, i] situ_k[i]    the block factor 2^(s - 119) of the decoded e2m1 * 2^-14

  up    a CTA per (pair k, R = UP_ROWS intermediate rows of W1_e and of W3_e) in UP_HALVES groups of L/32 threads
        (two groups of 112 at K3's latent: 7 warps, no idle lane); thread j of group g owns the 32-block j of the
        group's R/2 rows of W1 and of W3 (one 16-byte load of four kernel-layout words a row, and the row's E8M0
        scale byte), z's 16 bf16 pairs of its block converted once to f16 of 2^6 z; each block's 32 products in
        f16x2 FMAs (the simt path's PTX: 7 integer operations decode a word into four f16x2 of e2m1 * 2^-14, no
        table), the block sum times 2^(s - 119) into fp32; the row sums reduced over a shuffle segment (32 lanes, or
        16 with two groups: a group is whole segments) by a reduce-scatter (seg_reduce), then across segments in
        shared memory; R/2 threads store two rows' activations each as one f16x2 word (2^6 wk situ, the simt
        path's scaling, exact for |wk situ| < 1023). A thread past the last block (one group of L/32 rounded up to
        whole warps) redoes a valid block times a factor of 0.0.
  down  a CTA per R = DOWN_ROWS latent rows; thread p < K * I/32 owns the (pair, block) product p of every row: its
        32 activations loaded once, the rows' W2_e words and scales; per row a shuffle sum, then across warps in
        shared memory (the reduce-scatter too); a PDL launch after `up` (it waits for up's activations before
        reading anything). With `glue` it also writes yg = bf16(y gamma) and its rows' sum of y^2 (one
        partial a CTA): the MoE output's routed norm folded (k3lab.step.moe_glue_fold).
  (git history: a warp per (pair, two rows) and a warp per latent row, whose every warp re-read z or all of act,
  lost at TP8; experiments/moe_cute/README.md, docs/NOTES_moe.md. W2_TAIL, each up CTA requesting its share of the
  pair's W2 into L2 once its rows were read, and DOWN_OVERLAP, down launched right after up's wait and reading its W2
  before its own, tied with the plain kernels in the batch-1 step: docs/NOTES_moe.md, thirty-seventh session; git
  history at 251d172.)

Layout: z [1, L] bf16 (read as int32 pairs); idx [1, K] int32 or int64 (the low word read); wk [1, K] fp32; w1, w3
[E, I, L/8] and w2 [E, L, I/8] int32 words of k3lab.mxfp4.to_kernel_layout; their E8M0 scales [E, out, in/32] uint8
(read as the stack's 32-bit words: byte n in word n // 4, so a TP16 row of six w2 scales may straddle two words);
y [1, L] fp32; a workspace act [K, I/2] int32 (cached per device and shape: make the first call outside a CUDA graph
capture). Needs L and I multiples of 32, L/32 <= 1024 and K * I/32 <= 1024 (threads a CTA).
Exactness and tolerance: the simt path's (k3lab_kernels.triton.moe_experts, the SIMT section): the decoded weights
are exact, a block's products and sum are f16, everything after fp32.

Floor (k3lab.ops.moe.experts_bytes): the K experts' w1, w3, w2 codes and scales (TP8: 16 x 2.15 MB = 34.5 MB) at the
read bandwidth, ~7.5 us on the H200. Contract: moe_experts(z, idx, wk, w1, w3, w2, s1, s3, s2, y, *, b1, b2, pdl=None)
-> y on torch's current stream; pdl=True: `up` waits for the kernel before (griddepcontrol.wait) before its first
read; None: the enclosing k3lab_kernels.triton.pdl.pdl_chain's setting. `up` triggers its dependents after its loads
with or without pdl (down, always a PDL launch, then starts during up's tail and waits for it). Arguments are checked by
name (MoECuteError); the component (k3lab.components.moe.experts, backend "cute") passes the kernel layout.
"""
import types
from typing import Any

import torch

from ..mxfp4_ptx import decode_ptx

_THREADS = 128
_WARPS = _THREADS // 32

__all__ = ["MoECuteError", "block_ptx", "moe_experts"]


def block_ptx() -> str:
    """PTX of one 32-block of one row for one token: $0 (f32) = $22 + 2^(s-119) * sum of the block's 32 products,
    $1..$4 the block's four kernel-layout words, $5 + 4p + j the activation pair (f16x2 of 2^6 x) that part p of word
    j multiplies, $21 the factor's bits ((s + 8) << 23), $22 the fp32 accumulator in."""
    lines = ["{", ".reg .b32 t, d0, d1, d2, d3, h;", ".reg .b16 lo, hi;", ".reg .f32 a, b;", "mov.b32 h, 0;"]
    for j in range(4):
        lines += decode_ptx(f"${1 + j}")
        lines += [f"fma.rn.f16x2 h, d{p}, ${5 + 4 * p + j}, h;" for p in range(4)]
    lines += ["mov.b32 {lo, hi}, h;", "cvt.f32.f16 a, lo;", "cvt.f32.f16 b, hi;", "add.f32 a, a, b;",
              "fma.rn.f32 $0, a, $21, $22;", "}"]
    return "\n".join(lines)


# bf16 pair -> f16 pair of 2^6 x (round to nearest even): the simt path's conversion
TO_F16_PTX = "\n".join(["{", ".reg .b32 a, b;", "mad.lo.u32 a, $1, 65536, 0x03000000;", "and.b32 b, $1, 0xFFFF0000;",
                        "add.u32 b, b, 0x03000000;", "cvt.rn.f16x2.f32 $0, b, a;", "}"])
# two fp32 -> one f16x2 word ($2 in the low half)
PACK_PTX = "cvt.rn.f16x2.f32 $0, $1, $2;"

_KERNEL_CLS = None
# the device helpers the kernels below are written with (vec, ids, seg_reduce, sigmoid, tanh), for the one-token
# dense experts (kernels/cute/moe_dense.py): set by _kernel_classes()
DEVICE_OPS = None
# rows a CTA: latent rows of the down kernel, intermediate rows (of W1 and of W3; even) of the up kernel. Alone
# (experiments/moe_cute/README.md) 4 and 4 were ahead of 2, 8 and 16 at TP8 and TP16; inside the batch-1 decode step
# (pdl, the glue folded) 6 / 8 beat 4 / 4 (docs/NOTES_moe.md, thirtieth session); with the up kernel's two thread
# groups 12 rows (six a thread of W1 and of W3, as 6 had with one group) beat 6 and 8 (thirty-second session). A
# shape they do not divide takes 4 (up) or 1 (down).
DOWN_ROWS = 8
UP_ROWS = 12
# thread groups of L/32 an up CTA (2: two groups of 112 threads at K3's latent, each R/2 rows of W1 and of W3, so no
# thread of the CTA's 7 warps is idle, where one group of 4 warps leaves 16 idle lanes redoing a block times 0.0:
# fewer instructions, the step faster; figures in docs/NOTES_moe.md, thirty-second session); 1 where L/32 is not a
# multiple of 16 or UP_ROWS is not a multiple of it
UP_HALVES = 2
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

    BLOCK = block_ptx()

    def vec(ptr, off, n):
        return cute.make_tensor(ptr + off, cute.make_layout(n))

    @dsl_user_op
    def block_fma(words, pairs, fbits, acc, *, loc=None, ip=None):
        ops = ([Int32(words[j]).ir_value(loc=loc, ip=ip) for j in range(4)]
               + [Int32(pairs[q]).ir_value(loc=loc, ip=ip) for q in range(16)]
               + [Int32(fbits).ir_value(loc=loc, ip=ip), Float32(acc).ir_value(loc=loc, ip=ip)])
        return Float32(_llvm.inline_asm(Float32.mlir_type, ops, BLOCK, "=f," + "r," * 21 + "f",
                                        has_side_effects=False, is_align_stack=False,
                                        asm_dialect=_llvm.AsmDialect.AD_ATT, loc=loc, ip=ip))

    @dsl_user_op
    def to_f16x2(x, *, loc=None, ip=None):
        return Int32(_llvm.inline_asm(Int32.mlir_type, [Int32(x).ir_value(loc=loc, ip=ip)], TO_F16_PTX, "=r,r",
                                      has_side_effects=False, is_align_stack=False,
                                      asm_dialect=_llvm.AsmDialect.AD_ATT, loc=loc, ip=ip))

    @dsl_user_op
    def pack_f16x2(hi, lo, *, loc=None, ip=None):
        return Int32(_llvm.inline_asm(Int32.mlir_type, [Float32(hi).ir_value(loc=loc, ip=ip),
                                                        Float32(lo).ir_value(loc=loc, ip=ip)], PACK_PTX, "=r,f,f",
                                      has_side_effects=False, is_align_stack=False,
                                      asm_dialect=_llvm.AsmDialect.AD_ATT, loc=loc, ip=ip))

    def ids():
        """(thread, CTA, lane, warp) of a one-dimensional launch."""
        tid, _, _ = cute.arch.thread_idx()
        c, _, _ = cute.arch.block_idx()
        return tid, c, tid % 32, tid // 32

    def factor_bits(word, byte_n, keep):
        """The block factor 2^(s - 119) as fp32 bits from the E8M0 scale s, byte byte_n % 4 of `word` (the scales
        read four bytes at a time); `keep` 0 makes it 0.0 (an idle thread's block), -1 keeps it."""
        return ((((word >> (8 * byte_n % 32)) & 0xFF) + 8) << 23) & keep

    def sigmoid(x):
        return 1.0 / (1.0 + cute.math.exp(-x))

    def tanh(x):
        return 2.0 * sigmoid(2.0 * x) - 1.0

    def seg_reduce(acc, n, seg, lane):
        """Sum acc[0..n) over the `seg` lanes (32 or 16) of this thread's shuffle segment by a reduce-scatter: while
        the count is even a butterfly step hands half the values to the partner lane and keeps the other half (15
        shuffles for 12 values over 16 lanes instead of 48; the same tree of additions as a butterfly per value, so
        bit-identical to it; the step a little faster, docs/NOTES_moe.md thirty-second session), then full
        butterflies. Returns (start, cur, plain): this lane holds the sums of values start ..
        start + cur - 1 in acc[0..cur), and the lanes with lane & plain == 0 are the ones to store them (the others
        of a full butterfly step hold the same sums)."""
        cur, start, plain = n, Int32(0), 0
        for sh in range(5 if seg == 32 else 4):
            o = (seg // 2) >> sh
            if cur % 2 == 0:  # a plain function (not preprocessed): Python loops unroll
                half = cur // 2
                hi = (lane & o) != 0
                for i in range(half):
                    a, bb = acc[i], acc[half + i]
                    acc[i] = cutlass.select_(hi, bb, a) + cute.arch.shuffle_sync_bfly(cutlass.select_(hi, a, bb),
                                                                                      offset=o)
                start = start + cutlass.select_(hi, Int32(half), Int32(0))
                cur = half
            else:
                for i in range(cur):
                    acc[i] = acc[i] + cute.arch.shuffle_sync_bfly(acc[i], offset=o)
                plain = plain | o
        return start, cur, plain

    class MoEDown:
        """A CTA per R latent rows; thread p < K * I/32 owns the (pair k, block cb) product of every row (its 32
        activations loaded once, the R rows' words and scales of W2_e); a PDL launch after MoEUp."""

        def __init__(self, K: int, I: int, L: int, E: int, idx_step: int, rows: int, glue: bool = False):
            self.K, self.I, self.L, self.E, self.idx_step, self.R = K, I, L, E, idx_step, rows
            self.NP = K * (I // 32)                  # (pair, block) products a row
            self.NT = (self.NP + 31) // 32 * 32      # threads: a thread past the last product is idle
            self.glue = bool(glue)                   # also yg = bf16(y gamma) and the CTA's sum of y^2
            assert rows <= 32

        @cute.jit
        def __call__(self, p_idx: cute.Pointer, p_w2: cute.Pointer, p_s2: cute.Pointer, p_act: cute.Pointer,
                     p_y: cute.Pointer, p_gam: cute.Pointer, p_yg: cute.Pointer, p_ssp: cute.Pointer,
                     stream: cuda.CUstream):
            self.kernel(p_idx, p_w2, p_s2, p_act, p_y, p_gam, p_yg, p_ssp).launch(
                grid=[self.L // self.R, 1, 1], block=[self.NT, 1, 1], stream=stream, use_pdl=True)

        @cute.kernel
        def kernel(self, p_idx: cute.Pointer, p_w2: cute.Pointer, p_s2: cute.Pointer, p_act: cute.Pointer,
                   p_y: cute.Pointer, p_gam: cute.Pointer, p_yg: cute.Pointer, p_ssp: cute.Pointer):
            I, L, R, NP, NT = self.I, self.L, self.R, self.NP, self.NT
            NB = I // 32                 # blocks a row of w2 (and scale bytes a row)
            RW = I // 8
            W = NT // 32
            tid, c, lane, warp = ids()
            smem = cutlass.memory.SmemAllocator()
            s_red = smem.allocate_tensor(Float32, cute.make_layout(W * R), byte_alignment=16)  # [warp, row]
            q = tid % NP                 # an idle thread redoes a valid product times a factor of 0.0
            keep = (tid - NP) >> 31      # -1 for a product's thread, 0 for an idle one
            k = q // NB
            cb = q % NB
            cute.arch.griddepcontrol_wait()  # the activations of MoEUp (and idx, from before it)
            cute.arch.griddepcontrol_launch_dependents()
            e = vec(p_idx, k * self.idx_step, 1)[0]
            wv = cute.make_rmem_tensor((R * 4,), Int32)
            sv = cute.make_rmem_tensor((R,), Int32)
            for r in cutlass.range_constexpr(R):
                row = e * L + c * R + r
                cute.autovec_copy(vec(p_w2, cute.assume(row * RW + 4 * cb, divby=4), 4),
                                  cute.make_tensor(wv.iterator + 4 * r, cute.make_layout(4)))
                sv[r] = vec(p_s2, (row * NB + cb) // 4, 1)[0]
            ap = cute.make_rmem_tensor((16,), Int32)
            cute.autovec_copy(vec(p_act, cute.assume(k * (I // 2) + 16 * cb, divby=16), 16), ap)
            acc = cute.make_rmem_tensor((R,), Float32)
            for r in cutlass.range_constexpr(R):
                fbits = factor_bits(sv[r], (e * L + c * R + r) * NB + cb, keep)
                acc[r] = block_fma(cute.make_tensor(wv.iterator + 4 * r, cute.make_layout(4)), ap, fbits,
                                   Float32(0.0))
            start, cur, plain = seg_reduce(acc, R, 32, lane)
            if (lane & plain) == 0:
                for i in cutlass.range_constexpr(cur):
                    s_red[warp * R + start + i] = acc[i]
            cute.arch.sync_threads()
            if tid < 32:                 # warp 0: lane r < R sums row r over the warps
                rr = tid % R
                tot = s_red[rr]
                for w in cutlass.range_constexpr(1, W):
                    tot = tot + s_red[w * R + rr]
                if tid < R:
                    vec(p_y, c * R + tid, 1)[0] = tot
                    if cutlass.const_expr(self.glue):
                        vec(p_yg, c * R + tid, 1)[0] = (tot * vec(p_gam, c * R + tid, 1)[0].to(Float32)).to(
                            cutlass.BFloat16)
                if cutlass.const_expr(self.glue):  # this CTA's share of sum(y^2): the routed norm's statistic
                    sq = cutlass.select_(tid < R, tot * tot, Float32(0.0))
                    for sh in cutlass.range_constexpr(5):
                        sq = sq + cute.arch.shuffle_sync_bfly(sq, offset=16 >> sh)
                    if tid == 0:
                        vec(p_ssp, c, 1)[0] = sq

    class MoEUp:
        """A CTA per (pair, R intermediate rows of W1_e and W3_e); thread b < L/32 owns block b of every row (z's
        pairs converted once), the 2R row sums reduced by shuffles and shared memory."""

        def __init__(self, K: int, I: int, L: int, E: int, idx_step: int, b1: float, b2: float, pdl: bool,
                     rows: int, halves: int = 1):
            self.K, self.I, self.L, self.E, self.idx_step, self.R = K, I, L, E, idx_step, rows
            self.b1, self.b2, self.pdl = float(b1), float(b2), bool(pdl)
            self.NB = L // 32
            self.H = int(halves)                     # thread groups of NB a CTA, each R / H rows of W1 and of W3
            assert self.H in (1, 2) and rows % self.H == 0 and (self.H == 1 or self.NB % 16 == 0)
            self.NT = (self.H * self.NB + 31) // 32 * 32
            self.SEG = 32 if self.H == 1 else 16     # lanes a shuffle segment (a group of NB is whole segments)

        @cute.jit
        def __call__(self, p_z: cute.Pointer, p_idx: cute.Pointer, p_wk: cute.Pointer, p_w1: cute.Pointer,
                     p_w3: cute.Pointer, p_s1: cute.Pointer, p_s3: cute.Pointer, p_act: cute.Pointer,
                     stream: cuda.CUstream):
            self.kernel(p_z, p_idx, p_wk, p_w1, p_w3, p_s1, p_s3, p_act).launch(
                grid=[self.K * (self.I // self.R), 1, 1], block=[self.NT, 1, 1], stream=stream, use_pdl=self.pdl)

        @cute.kernel
        def kernel(self, p_z: cute.Pointer, p_idx: cute.Pointer, p_wk: cute.Pointer, p_w1: cute.Pointer,
                   p_w3: cute.Pointer, p_s1: cute.Pointer, p_s3: cute.Pointer, p_act: cute.Pointer):
            I, R, NB, NT, H, SEG = self.I, self.R, self.NB, self.NT, self.H, self.SEG
            RH = R // H                  # rows of W1 (and of W3) a thread
            NSEG = NT // SEG
            SPH = NSEG if H == 1 else NB // SEG  # segments a group's rows are summed over
            RW = self.L // 8
            tid, c, lane, warp = ids()
            smem = cutlass.memory.SmemAllocator()
            s_red = smem.allocate_tensor(Float32, cute.make_layout(NSEG * 2 * RH), byte_alignment=16)  # [seg, m, r]
            k = c // (I // R)
            r0 = (c % (I // R)) * R
            qt = tid % (H * NB)          # a thread past the last block redoes a valid one times a factor of 0.0
            b = qt % NB
            hr = r0 + (qt // NB) * RH    # this thread's group's first row
            keep = (tid - H * NB) >> 31
            if cutlass.const_expr(self.pdl):
                cute.arch.griddepcontrol_wait()  # idx, wk and z come from the kernels before
            e = vec(p_idx, k * self.idx_step, 1)[0]
            wv = cute.make_rmem_tensor((2 * RH * 4,), Int32)  # [m (w1, w3), r, word]
            sv = cute.make_rmem_tensor((2 * RH,), Int32)
            for m in cutlass.range_constexpr(2):
                for r in cutlass.range_constexpr(RH):
                    row = e * I + hr + r
                    cute.autovec_copy(vec(p_w1 if m == 0 else p_w3, cute.assume(row * RW + 4 * b, divby=4), 4),
                                      cute.make_tensor(wv.iterator + (m * RH + r) * 4, cute.make_layout(4)))
                    sv[m * RH + r] = vec(p_s1 if m == 0 else p_s3, (row * NB + b) // 4, 1)[0]
            zr = cute.make_rmem_tensor((16,), Int32)
            zp = cute.make_rmem_tensor((16,), Int32)
            cute.autovec_copy(vec(p_z, cute.assume(16 * b, divby=16), 16), zr)
            for q in cutlass.range_constexpr(16):
                zp[q] = to_f16x2(zr[q])
            acc = cute.make_rmem_tensor((2 * RH,), Float32)
            for j in cutlass.range_constexpr(2 * RH):
                fbits = factor_bits(sv[j], (e * I + hr + j % RH) * NB + b, keep)
                acc[j] = block_fma(cute.make_tensor(wv.iterator + j * 4, cute.make_layout(4)), zp, fbits,
                                   Float32(0.0))
            # down may launch now (it waits for this grid before reading act); without pdl this grid has no wait of
            # its own and its predecessor is done, so the trigger is always safe
            cute.arch.griddepcontrol_launch_dependents()
            start, cur, plain = seg_reduce(acc, 2 * RH, SEG, lane)
            if (lane & plain) == 0:
                for i in cutlass.range_constexpr(cur):
                    s_red[(tid // SEG) * 2 * RH + start + i] = acc[i]
            cute.arch.sync_threads()
            if tid < R // 2:             # the pair of rows r0 + 2 tid, r0 + 2 tid + 1 (row rho: group rho // RH)
                g = cute.make_rmem_tensor((2,), Float32)
                u = cute.make_rmem_tensor((2,), Float32)
                for i in cutlass.range_constexpr(2):
                    rho = 2 * tid + i
                    base = (rho // RH) * SPH * 2 * RH + rho % RH
                    g[i] = s_red[base]
                    u[i] = s_red[base + RH]
                    for w in cutlass.range_constexpr(1, SPH):
                        g[i] = g[i] + s_red[base + w * 2 * RH]
                        u[i] = u[i] + s_red[base + w * 2 * RH + RH]
                wt = vec(p_wk, k, 1)[0] * 64.0
                a0 = wt * (self.b1 * tanh(g[0] / self.b1) * sigmoid(g[0])) * (self.b2 * tanh(u[0] / self.b2))
                a1 = wt * (self.b1 * tanh(g[1] / self.b1) * sigmoid(g[1])) * (self.b2 * tanh(u[1] / self.b2))
                vec(p_act, k * (I // 2) + r0 // 2 + tid, 1)[0] = pack_f16x2(a1, a0)

    _KERNEL_CLS = (MoEUp, MoEDown)
    DEVICE_OPS = types.SimpleNamespace(vec=vec, ids=ids, seg_reduce=seg_reduce, sigmoid=sigmoid, tanh=tanh)
    return _KERNEL_CLS


# ---------------------------------------------------------------------------------------------
# Host wrapper
# ---------------------------------------------------------------------------------------------

_COMPILED: dict[tuple, Any] = {}
_WS: dict[tuple, torch.Tensor] = {}


class MoECuteError(ValueError):
    """An argument of the CuTe MoE kernels has the wrong type, shape, dtype, layout or device."""


def _fail(name: str, msg: str):
    raise MoECuteError(f"moe_experts cute: {name!r} {msg}")


def _ptr(t: torch.Tensor, align: int):
    import cutlass
    from cutlass import cute
    from cutlass.cute.runtime import make_ptr
    dt = {torch.float32: cutlass.Float32, torch.int32: cutlass.Int32, torch.bfloat16: cutlass.BFloat16}[t.dtype]
    return make_ptr(dt, t.data_ptr(), cute.AddressSpace.gmem, assumed_align=align)


def _tensor(name, t, dev, dtypes, shape, fail=_fail):
    if not isinstance(t, torch.Tensor):
        fail(name, f"must be a torch.Tensor, got {type(t).__name__}")
    if t.device.type != "cuda" or (dev is not None and t.device != dev):
        fail(name, f"must be on the CUDA device of z, got {t.device}")
    if t.dtype not in dtypes:
        fail(name, f"must have dtype in {[str(d).replace('torch.', '') for d in dtypes]}, got {t.dtype}")
    if tuple(t.shape) != tuple(shape) or not t.is_contiguous():
        fail(name, f"must be a contiguous tensor of shape {tuple(shape)}, got {tuple(t.shape)}")
    if t.data_ptr() % 16:
        fail(name, "must start 16-byte aligned")


def experts_tensors(z, idx, wk, w1, w3, w2, s1, s3, s2, y, B: int, fail=_fail) -> list[torch.Tensor]:
    """The checks both CuTe experts' wrappers make on their tensors (z [B, L] bf16; the kernel-layout words and E8M0
    scales of w1, w3, w2; idx [B, K]; wk; y [B, L] fp32), by name through `fail`; returns the scales as the stack's
    32-bit words (scale byte n in word n // 4), the kernels' view of them."""
    L = z.shape[1]
    _tensor("z", z, None, (torch.bfloat16,), (B, L), fail)
    E, I = w1.shape[0], w1.shape[1]
    dev = z.device
    _tensor("w1", w1, dev, (torch.int32,), (E, I, L // 8), fail)
    _tensor("w3", w3, dev, (torch.int32,), (E, I, L // 8), fail)
    _tensor("w2", w2, dev, (torch.int32,), (E, L, I // 8), fail)
    _tensor("s1", s1, dev, (torch.uint8,), (E, I, L // 32), fail)
    _tensor("s3", s3, dev, (torch.uint8,), (E, I, L // 32), fail)
    _tensor("s2", s2, dev, (torch.uint8,), (E, L, I // 32), fail)
    K = idx.shape[1]
    _tensor("idx", idx, dev, (torch.int32, torch.int64), (B, K), fail)
    _tensor("wk", wk, dev, (torch.float32,), (B, K), fail)
    _tensor("y", y, dev, (torch.float32,), (B, L), fail)
    for name, sc in (("s1", s1), ("s3", s3), ("s2", s2)):
        if sc.numel() % 4:
            fail(name, f"must hold a multiple of 4 bytes (read as 32-bit words), got {sc.numel()}")
    return [sc.reshape(-1).view(torch.int32) for sc in (s1, s3, s2)]


def one_token(z, pdl) -> bool:
    """The one-token wrappers' first checks: pdl resolved (None: the enclosing pdl_chain's setting) and z one token
    [1, L]; returns pdl."""
    if pdl is None:
        from k3lab_kernels.triton.pdl import chain_pdl

        pdl = chain_pdl(None)
    if not isinstance(pdl, bool):
        _fail("pdl", f"must be None or a bool, got {pdl!r}")
    if not isinstance(z, torch.Tensor) or z.dim() != 2 or z.shape[0] != 1:
        _fail("z", f"must be one token [1, L] (the cute experts take batch 1), got {getattr(z, 'shape', z)!r}")
    return pdl


def glue_partials(L: int) -> int:
    """How many partial sums of y^2 the down kernel writes with `glue` (one a CTA: L / DOWN_ROWS)."""
    return L // (DOWN_ROWS if L % DOWN_ROWS == 0 else 1)


def moe_experts(z, idx, wk, w1, w3, w2, s1, s3, s2, y, *, b1: float = 4.0, b2: float = 25.0, pdl: bool | None = None,
                glue: tuple | None = None):
    """y [1, L] fp32 = the routed experts of one token (module docstring). glue None or (gamma [L] bf16, yg [1, L]
    bf16 (any row stride), ssp [1, glue_partials(L)] fp32): the down kernel also writes yg = bf16(y * gamma) and
    ssp[0, c] = the sum of y^2 over CTA c's rows (the routed norm's statistic, finished by its consumer: the MoE
    output's projection, k3lab.step.moe_glue_fold). Returns y."""
    pdl = one_token(z, pdl)
    dev = z.device
    L = z.shape[1]
    if not isinstance(w1, torch.Tensor) or w1.dim() != 3:
        _fail("w1", f"must be the kernel-layout words [E, I, L/8] int32, got {getattr(w1, 'shape', w1)!r}")
    E, I = w1.shape[0], w1.shape[1]
    if L % 32 or I % 32:
        _fail("z", f"L and I must be multiples of 32 (MXFP4 blocks), got L={L}, I={I}")
    if not isinstance(idx, torch.Tensor) or idx.dim() != 2 or idx.shape[0] != 1:
        _fail("idx", f"must be [1, K] expert ids, got {getattr(idx, 'shape', idx)!r}")
    K = idx.shape[1]
    sw = experts_tensors(z, idx, wk, w1, w3, w2, s1, s3, s2, y, 1)
    if K * (I // 32) > 1024 or L // 32 > 1024:
        if L // 32 > 1024:
            _fail("z", f"L/32 must be at most 1024 (a thread a block in the up kernel), got {L // 32}")
        _fail("idx", f"top-k x I/32 must be at most 1024 (a thread a product in the down kernel), got {K} x {I // 32}")
    step = 2 if idx.dtype == torch.int64 else 1
    glue_args = [_ptr(y, 4), _ptr(y, 4), _ptr(y, 4)]  # y: never read or written as these without glue
    if glue is not None:
        if not isinstance(glue, (tuple, list)) or len(glue) != 3:
            _fail("glue", f"must be None or (gamma, yg, ssp), got {glue!r:.60}")
        gam, yg, ssp = glue
        for name, t, dt, shape in (("glue.gamma", gam, torch.bfloat16, (L,)), ("glue.yg", yg, torch.bfloat16, (1, L)),
                                   ("glue.ssp", ssp, torch.float32, (1, glue_partials(L)))):
            if not isinstance(t, torch.Tensor) or t.device != dev or t.dtype != dt or tuple(t.shape) != shape:
                _fail(name, f"must be a {str(dt)[6:]} tensor {shape} on {dev}, got "
                            f"{getattr(t, 'dtype', type(t).__name__)} {tuple(getattr(t, 'shape', ()))}")
            if t.stride(-1) != 1:
                _fail(name, "must have unit inner stride")
        glue_args = [_ptr(gam, 2), _ptr(yg, 2), _ptr(ssp, 4)]
    key_ws = (dev.index, K, I)
    act = _WS.get(key_ws)
    if act is None:
        act = _WS[key_ws] = torch.empty(K, I // 2, dtype=torch.int32, device=dev)
    up_args = [_ptr(z.view(torch.int32), 16), _ptr(idx.view(torch.int32), 4), _ptr(wk, 4), _ptr(w1, 16),
               _ptr(w3, 16), _ptr(sw[0], 4), _ptr(sw[1], 4), _ptr(act, 16)]
    down_args = [_ptr(idx.view(torch.int32), 4), _ptr(w2, 16), _ptr(sw[2], 4), _ptr(act, 16), _ptr(y, 4), *glue_args]
    rows = DOWN_ROWS if L % DOWN_ROWS == 0 else 1
    up_rows = UP_ROWS if I % UP_ROWS == 0 else 4  # I is a multiple of 32
    halves = UP_HALVES if (L // 32) % 16 == 0 and up_rows % UP_HALVES == 0 else 1
    key = (K, I, L, E, step, float(b1), float(b2), pdl, dev.index, rows, up_rows, halves, glue is not None)
    with torch.cuda.device(dev):
        import cuda.bindings.driver as cuda

        stream = cuda.CUstream(torch.cuda.current_stream(dev).cuda_stream)
        fns = _COMPILED.get(key)
        if fns is None:
            from cutlass import cute

            up_cls, down_cls = _kernel_classes()
            fns = (cute.compile(up_cls(K, I, L, E, step, b1, b2, pdl, up_rows, halves), *up_args, stream),
                   cute.compile(down_cls(K, I, L, E, step, rows, glue is not None), *down_args, stream))
            _COMPILED[key] = fns
        fns[0](*up_args, stream)
        fns[1](*down_args, stream)
    return y
