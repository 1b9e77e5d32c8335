"""Gated-MLA cache write as one CuTe DSL kernel: the kv down-projection's output through kv_norm, written
into the latent cache in place; the same results, bit for bit, as kernels/triton/mla_cache_write.py on
the GPU.

    entry = [rms(kv[:C]; kv_norm, eps) | kv[C:]]     (C = 512 latent, Dr = 64 rope; fp32 statistics)
    cache[b, lengths[b] + t] = entry (rounded once to the cache format)       for t in 0..T-1

Layout. One warp (one CTA of 32 threads) per new entry, B*T CTAs. Lane l holds the latent values
128 j + 4 l .. + 3 of chunk j = 0..3 (one 8-byte load each for bf16: each chunk is 256 contiguous bytes
across the warp) and, lanes 0..15, the rope values 4 l .. + 3. The sum of squares follows the Triton
kernel's order on the GPU exactly (Triton 3.6, 4 warps, 4 values a thread): lane l of chunk j stands for
Triton's thread 32 j + l, its four squares chained as fma(x3, x3, fma(x2, x2, fma(x0, x0, x1 * x1))), each
chunk butterflied over the warp (offsets 16 .. 1) and the four warp sums joined as (w0 + w2) + (w1 + w3),
so no shared memory and no barrier. Triton 3.8 sums a thread's four squares as a tree instead,
fma(x0, x0, x1 * x1) + fma(x2, x2, x3 * x3): SUM_ORDER names the form matched ("chain": 3.6, the H200
image's Triton; "tree": 3.8). The normalization is Triton's too: x / sqrt(sum / C + eps) * kv_norm
with div.full.f32 and sqrt.approx.ftz.f32. Every rounding fp32 operation is a one-instruction inline PTX
(mul.rn, fma.rn, add.rn, div.full, sqrt.approx.ftz), so neither LLVM nor ptxas contracts or reorders it.

Cache formats (the scheme of k3lab.ref.mla): bf16: each value rounded once to nearest-even. fp8 e4m3
(float8_e4m3fn): PER-TENSOR: the 0-d fp32 scale s is read; PER-TOKEN: s = max(amax(|entry|) / 448, 1e-12)
over the entry's 576 values (a warp max) is written beside the row (scale [B, S_max], or [n_pages, PAGE]
paged); the row stores cvt.rn.satfinite.e4m3(clamp(x / s, +-448)), four codes a 32-bit store. Rows: a
contiguous cache [B, S_max, W] row b*S_max + pos; paged (pool [n_pages, PAGE, W], block_table
[B, max_pages] int32) row block_table[b, pos // PAGE]*PAGE + pos % PAGE; 64-bit row offsets. Nothing else
of the cache is touched; lengths stays as it is (the caller owns it).

Order (the batch-1 chain): lengths[b] and then the block-table entry are loaded first (the store address
depends on them), kv_norm and the per-tensor scale next, the projection's output last. pdl=True
(programmatic dependent launch): everything but the projection's output is loaded before
griddepcontrol.wait, which the kv loads follow; the caller's precondition: the kernel directly before this
one on the stream writes none of kv_norm, lengths, block_table or a per-tensor scale.

Floor (k3lab.ops.mla.write_bytes, the one formula): input B*T*W*2 + kv_norm C*2 + rows written B*T*W*e
(e = 2 bf16, 1 fp8; + 4 a row for per-token scales) + lengths (+ table entries): ~2.3 KB a position in
bf16; launch-bound at decode.

Contract (torch tensors on one CUDA device, torch's current stream, CUDA-graph safe once a variant has
compiled): mla_cache_write(kv, kv_norm, cache, lengths, *, eps=1e-6, scale=None, block_table=None,
pdl=None), the Triton wrapper's arguments. C = 512, Dr = 64 (K3's MLA); kv [B, T, 576] bf16 / fp16 / fp32
with its last dim contiguous, the other strides multiples of 4 and the base 4-element aligned; kv_norm
[512] contiguous; cache bf16 or float8_e4m3fn, contiguous, 16-byte aligned; lengths [B] int32 / int64.
"""
from typing import Any

import torch

from .kda_decode import gmem_ptr as _ptr  # the one host pointer helper

C_LATENT = 512
D_ROPE = 64
WIDTH = C_LATENT + D_ROPE
FP8_MAX = 448.0
SCALE_FLOOR = 1e-12  # k3lab.ref.mla.fp8_quantize's clamp of a per-token scale
_LANES = 32
_CHUNKS = C_LATENT // (4 * _LANES)  # 4: latent values a lane holds / 4
_ROPE_LANES = D_ROPE // 4          # 16 lanes hold the rope values, 4 each
MODES = {"bf16": 0, "tensor": 1, "token": 2}  # cache format: bf16, fp8 with a per-tensor / per-token scale
SUM_ORDERS = ("chain", "tree")
SUM_ORDER = "chain"  # the Triton kernel's in-thread order of the four squares (module doc): Triton 3.6

__all__ = ["mla_cache_write"]


# ---------------------------------------------------------------------------------------------
# fp32 operations as single PTX instructions, and the kernel (built lazily: importing this module never
# needs cutlass)
# ---------------------------------------------------------------------------------------------

_KERNEL_CLS = None
_OPS = None


def _ops():
    """The exact fp32 operations (one inline PTX instruction each) and the e4m3 packing (built once)."""
    global _OPS
    if _OPS is not None:
        return _OPS
    from types import SimpleNamespace

    from cutlass import Float32, Int32
    from cutlass._mlir.dialects import llvm as _llvm
    from cutlass.cutlass_dsl import dsl_user_op

    def asm(res_type, text, constraints, vals, loc, ip):
        return _llvm.inline_asm(res_type, [Float32(v).ir_value(loc=loc, ip=ip) for v in vals], text, constraints,
                                has_side_effects=False, is_align_stack=False,
                                asm_dialect=_llvm.AsmDialect.AD_ATT, loc=loc, ip=ip)

    @dsl_user_op
    def mul(a, b, *, loc=None, ip=None):
        return Float32(asm(Float32.mlir_type, "mul.rn.f32 $0, $1, $2;", "=f,f,f", (a, b), loc, ip))

    @dsl_user_op
    def add(a, b, *, loc=None, ip=None):
        return Float32(asm(Float32.mlir_type, "add.rn.f32 $0, $1, $2;", "=f,f,f", (a, b), loc, ip))

    @dsl_user_op
    def fma(a, b, c, *, loc=None, ip=None):
        """a * b + c rounded once."""
        return Float32(asm(Float32.mlir_type, "fma.rn.f32 $0, $1, $2, $3;", "=f,f,f,f", (a, b, c), loc, ip))

    @dsl_user_op
    def div(a, b, *, loc=None, ip=None):
        """a / b as Triton's fp32 `/` compiles (div.full.f32: full range, within 2 ulp)."""
        return Float32(asm(Float32.mlir_type, "div.full.f32 $0, $1, $2;", "=f,f,f", (a, b), loc, ip))

    @dsl_user_op
    def sqrt(a, *, loc=None, ip=None):
        """sqrt(a) as Triton's tl.sqrt compiles (sqrt.approx.ftz.f32)."""
        return Float32(asm(Float32.mlir_type, "sqrt.approx.ftz.f32 $0, $1;", "=f,f", (a,), loc, ip))

    @dsl_user_op
    def pack_e4m3(a, b, c, d, *, loc=None, ip=None):
        """Four fp32 values -> their e4m3 codes (nearest-even, saturating) in one 32-bit word, a in the
        lowest byte (the first in memory)."""
        text = ("{\n.reg .b16 k3p01, k3p23;\n"
                "cvt.rn.satfinite.e4m3x2.f32 k3p01, $2, $1;\n"
                "cvt.rn.satfinite.e4m3x2.f32 k3p23, $4, $3;\n"
                "mov.b32 $0, {k3p01, k3p23};\n}")
        return Int32(asm(Int32.mlir_type, text, "=r,f,f,f,f", (a, b, c, d), loc, ip))

    _OPS = SimpleNamespace(mul=mul, add=add, fma=fma, div=div, sqrt=sqrt, pack_e4m3=pack_e4m3)
    return _OPS


def _kernel_class():
    """The cache-write generator (built once)."""
    global _KERNEL_CLS
    if _KERNEL_CLS is not None:
        return _KERNEL_CLS
    import cuda.bindings.driver as cuda
    import cutlass
    from cutlass import Float32, Int32, Int64, cute

    ops = _ops()
    C, W, NJ, RL = C_LATENT, WIDTH, _CHUNKS, _ROPE_LANES
    CH = 4 * _LANES  # latent values a chunk

    def vec(ptr, off, n):
        return cute.make_tensor(ptr + off, cute.make_layout(n))

    class MLACacheWriteKernel:
        """One warp per new entry (b, t): kv_norm RMSNorm of the latent, the row written in place."""

        def __init__(self, mode: int, paged: bool, page: int, pdl: bool = False, sum_order: str = "chain"):
            assert mode in (0, 1, 2) and sum_order in SUM_ORDERS, (mode, sum_order)
            self.tree = sum_order == "tree"   # a lane's four squares as a tree (Triton 3.8) or a chain (3.6)
            self.mode = mode                  # 0 bf16, 1 fp8 per-tensor scale, 2 fp8 per-token scale
            self.paged = bool(paged)
            self.page = int(page) if paged else 1
            self.pdl = bool(pdl)

        @cute.jit
        def __call__(self, p_kv: cute.Pointer, p_norm: cute.Pointer, p_cache: cute.Pointer, p_scale: cute.Pointer,
                     p_table: cute.Pointer, p_len: cute.Pointer, eps: Float32, n: Int32, T: Int32, s_ib: Int32,
                     s_it: Int32, s_cb: Int32, s_btb: Int32, stream: cuda.CUstream):
            self.kernel(p_kv, p_norm, p_cache, p_scale, p_table, p_len, eps, T, s_ib, s_it, s_cb, s_btb).launch(
                grid=[n, 1, 1], block=[_LANES, 1, 1], stream=stream, use_pdl=self.pdl)

        @cute.kernel
        def kernel(self, p_kv: cute.Pointer, p_norm: cute.Pointer, p_cache: cute.Pointer, p_scale: cute.Pointer,
                   p_table: cute.Pointer, p_len: cute.Pointer, eps: Float32, T: Int32, s_ib: Int32, s_it: Int32,
                   s_cb: Int32, s_btb: Int32):
            # p_cache: bf16 values (mode 0) or the fp8 rows as 32-bit words of four codes (modes 1, 2);
            # p_scale: the 0-d scale (1) or the per-token scales (2); p_table: the block table (paged)
            lane, _, _ = cute.arch.thread_idx()
            e, _, _ = cute.arch.block_idx()
            b = e // T
            t = e - b * T
            PAGE = self.page

            # ---- the store address: lengths[b], then the block-table entry, before anything else --------
            pos = Int32(vec(p_len, b, 1)[0]) + t
            if cutlass.const_expr(self.paged):
                page = vec(p_table, b * s_btb + pos // PAGE, 1)[0]
                row = Int64(page) * PAGE + pos % PAGE
            else:
                row = Int64(b) * s_cb + pos

            # ---- what the previous kernel does not write: kv_norm, a per-tensor scale ----------------------
            w_raw = cute.make_rmem_tensor((4, NJ), p_norm.dtype)
            cute.autovec_copy(cute.make_tensor(p_norm + cute.assume(lane * 4, divby=4),
                                               cute.make_layout((4, NJ), stride=(1, CH))), w_raw)
            s_t = Float32(1.0)
            if cutlass.const_expr(self.mode == 1):
                s_t = vec(p_scale, 0, 1)[0]

            if cutlass.const_expr(self.pdl):
                # the projection before us produced kv: wait for it, then let the next kernel launch
                cute.arch.griddepcontrol_wait()
                cute.arch.griddepcontrol_launch_dependents()

            # ---- the projection's output: 4 chunks of 4 latent values, lanes 0..15 four rope values -------
            src = cute.assume(Int64(b) * s_ib + t * s_it + lane * 4, divby=4)
            x_raw = cute.make_rmem_tensor((4, NJ), p_kv.dtype)
            cute.autovec_copy(cute.make_tensor(p_kv + src, cute.make_layout((4, NJ), stride=(1, CH))), x_raw)
            r_raw = cute.make_rmem_tensor((4,), p_kv.dtype)
            r_raw.fill(0.0)
            if lane < RL:
                cute.autovec_copy(vec(p_kv, src + C, 4), r_raw)

            xf = cute.make_rmem_tensor((4, NJ), Float32)
            for j in cutlass.range_constexpr(NJ):
                for i in cutlass.range_constexpr(4):
                    xf[i, j] = x_raw[i, j].to(Float32)

            # ---- sum of squares in Triton's order (module doc) --------------------------------------------
            part = cute.make_rmem_tensor((NJ,), Float32)
            for j in cutlass.range_constexpr(NJ):
                p = ops.fma(xf[0, j], xf[0, j], ops.mul(xf[1, j], xf[1, j]))
                if cutlass.const_expr(self.tree):
                    part[j] = ops.add(p, ops.fma(xf[2, j], xf[2, j], ops.mul(xf[3, j], xf[3, j])))
                else:
                    part[j] = ops.fma(xf[3, j], xf[3, j], ops.fma(xf[2, j], xf[2, j], p))
            for k in cutlass.range_constexpr(5):
                for j in cutlass.range_constexpr(NJ):
                    part[j] = ops.add(part[j], cute.arch.shuffle_sync_bfly(part[j], offset=16 >> k))
            total = ops.add(ops.add(part[0], part[2]), ops.add(part[1], part[3]))
            rms = ops.sqrt(ops.add(eps, ops.div(total, float(C))))

            y = cute.make_rmem_tensor((4, NJ), Float32)
            for j in cutlass.range_constexpr(NJ):
                for i in cutlass.range_constexpr(4):
                    y[i, j] = ops.mul(ops.div(xf[i, j], rms), w_raw[i, j].to(Float32))

            if cutlass.const_expr(self.mode == 0):
                # ---- bf16: one rounding to nearest-even, 8-byte stores -------------------------------------
                o = cute.make_rmem_tensor((4, NJ), p_cache.dtype)
                for j in cutlass.range_constexpr(NJ):
                    for i in cutlass.range_constexpr(4):
                        o[i, j] = y[i, j].to(p_cache.dtype)
                dst = cute.assume(row * W + lane * 4, divby=4)
                cute.autovec_copy(o, cute.make_tensor(p_cache + dst, cute.make_layout((4, NJ), stride=(1, CH))))
                o_r = cute.make_rmem_tensor((4,), p_cache.dtype)
                if lane < RL:
                    for i in cutlass.range_constexpr(4):
                        o_r[i] = r_raw[i].to(Float32).to(p_cache.dtype)
                    cute.autovec_copy(o_r, vec(p_cache, dst + C, 4))
            else:
                rf = cute.make_rmem_tensor((4,), Float32)
                for i in cutlass.range_constexpr(4):
                    rf[i] = r_raw[i].to(Float32)
                s = s_t
                if cutlass.const_expr(self.mode == 2):
                    # ---- per-token scale: the entry's amax over the warp ------------------------------------
                    am = abs(rf[0])
                    for i in cutlass.range_constexpr(1, 4):
                        am = cute.arch.fmax(am, abs(rf[i]))
                    for j in cutlass.range_constexpr(NJ):
                        for i in cutlass.range_constexpr(4):
                            am = cute.arch.fmax(am, abs(y[i, j]))
                    for k in cutlass.range_constexpr(5):
                        am = cute.arch.fmax(am, cute.arch.shuffle_sync_bfly(am, offset=16 >> k))
                    s = cute.arch.fmax(ops.div(am, FP8_MAX), SCALE_FLOOR)
                    if lane == 0:
                        vec(p_scale, row, 1)[0] = s
                # ---- e4m3 codes, four a 32-bit word: the row is W / 4 words --------------------------------
                q = cute.make_rmem_tensor((4,), Float32)
                wbase = row * (W // 4)
                for j in cutlass.range_constexpr(NJ):
                    for i in cutlass.range_constexpr(4):
                        q[i] = cute.arch.fmin(cute.arch.fmax(ops.div(y[i, j], s), -FP8_MAX), FP8_MAX)
                    vec(p_cache, wbase + (j * _LANES + lane), 1)[0] = ops.pack_e4m3(q[0], q[1], q[2], q[3])
                if lane < RL:
                    for i in cutlass.range_constexpr(4):
                        q[i] = cute.arch.fmin(cute.arch.fmax(ops.div(rf[i], s), -FP8_MAX), FP8_MAX)
                    vec(p_cache, wbase + (C // 4 + lane), 1)[0] = ops.pack_e4m3(q[0], q[1], q[2], q[3])

    _KERNEL_CLS = MLACacheWriteKernel
    return MLACacheWriteKernel


# ---------------------------------------------------------------------------------------------
# Host wrapper
# ---------------------------------------------------------------------------------------------

_COMPILED: dict[tuple, Any] = {}
_ACT = (torch.bfloat16, torch.float16, torch.float32)


class MLACacheWriteError(ValueError):
    """An argument of the CuTe cache write has the wrong type, shape, dtype, layout or device."""


def _fail(name: str, msg: str):
    raise MLACacheWriteError(f"mla_cache_write cute: {name!r} {msg}")


def _cutlass_dtype(dt: torch.dtype):
    import cutlass
    m = {torch.float32: cutlass.Float32, torch.bfloat16: cutlass.BFloat16, torch.float16: cutlass.Float16,
         torch.int32: cutlass.Int32, torch.int64: cutlass.Int64}
    return m[dt]


def _tensor(name, t, device, dtypes, dim=None):
    if not isinstance(t, torch.Tensor):
        _fail(name, f"must be a torch.Tensor, got {type(t).__name__}")
    if t.device.type != "cuda":
        _fail(name, f"must be on a CUDA device, got {t.device}")
    if device is not None and t.device != device:
        _fail(name, f"is on {t.device}, expected {device} (the device of kv)")
    if t.dtype not in dtypes:
        _fail(name, f"must have dtype in {[str(d).replace('torch.', '') for d in dtypes]}, got {t.dtype}")
    if dim is not None and t.dim() != dim:
        _fail(name, f"must have {dim} dims, got shape {tuple(t.shape)}")
    return t


def _aligned(name, t, nbytes):
    if t.data_ptr() % nbytes:
        _fail(name, f"base address must be {nbytes}-byte aligned (got 0x{t.data_ptr():x})")


def _validate(kv, kv_norm, cache, lengths, eps, scale, block_table, pdl):
    if not isinstance(pdl, bool):
        _fail("pdl", f"must be a bool, got {pdl!r}")
    if not isinstance(eps, float) or not eps > 0:
        _fail("eps", f"must be a positive float, got {eps!r}")
    _tensor("kv", kv, None, _ACT, 3)
    dev = kv.device
    B, T, W = kv.shape
    if B < 1 or T < 1 or W != WIDTH:
        _fail("kv", f"must be [B >= 1, T >= 1, {WIDTH}] (C = {C_LATENT} latent + {D_ROPE} rope), got "
                    f"{tuple(kv.shape)}")
    if kv.stride(2) != 1 or kv.stride(0) % 4 or kv.stride(1) % 4:
        _fail("kv", f"must have its last dim contiguous and the other strides multiples of 4, got {kv.stride()}")
    _aligned("kv", kv, 4 * kv.element_size())
    _tensor("kv_norm", kv_norm, dev, _ACT, 1)
    if kv_norm.shape[0] != C_LATENT or not kv_norm.is_contiguous():
        _fail("kv_norm", f"must be a contiguous [{C_LATENT}], got {tuple(kv_norm.shape)} strides {kv_norm.stride()}")
    _aligned("kv_norm", kv_norm, 4 * kv_norm.element_size())
    _tensor("cache", cache, dev, (torch.bfloat16, torch.float8_e4m3fn), 3)
    if cache.shape[2] != WIDTH or not cache.is_contiguous():
        _fail("cache", f"must be a contiguous [*, *, {WIDTH}], got {tuple(cache.shape)}")
    _aligned("cache", cache, 16)
    _tensor("lengths", lengths, dev, (torch.int32, torch.int64), 1)
    if lengths.shape[0] != B or not lengths.is_contiguous():
        _fail("lengths", f"must be a contiguous [{B}], got {tuple(lengths.shape)}")
    paged = block_table is not None
    if paged:
        _tensor("block_table", block_table, dev, (torch.int32,), 2)
        if block_table.shape[0] != B or block_table.stride(1) != 1:
            _fail("block_table", f"must be [{B}, max_pages] with its last dim contiguous, got "
                                 f"{tuple(block_table.shape)} strides {block_table.stride()}")
    elif cache.shape[0] != B:
        _fail("cache", f"contiguous must be [B={B}, S_max, {WIDTH}], got {tuple(cache.shape)}")
    if cache.dtype == torch.bfloat16:
        if scale is not None:
            _fail("scale", "must be None for a bf16 cache")
        return "bf16", paged
    if scale is None:
        _fail("scale", "is required for an fp8 cache (0-d per-tensor, or per-token [B, S_max] / [n_pages, PAGE])")
    _tensor("scale", scale, dev, (torch.float32,))
    if scale.dim() == 0:
        return "tensor", paged
    if tuple(scale.shape) != tuple(cache.shape[:2]) or not scale.is_contiguous():
        _fail("scale", f"per-token must be a contiguous {tuple(cache.shape[:2])} (one a cache row), got "
                       f"{tuple(scale.shape)}")
    return "token", paged


def _stream(dev):
    import cuda.bindings.driver as cuda
    return cuda.CUstream(torch.cuda.current_stream(dev).cuda_stream)


def mla_cache_write(kv: torch.Tensor, kv_norm: torch.Tensor, cache: torch.Tensor, lengths: torch.Tensor, *,
                    eps: float = 1e-6, scale: torch.Tensor | None = None, block_table: torch.Tensor | None = None,
                    pdl: bool | None = None) -> None:
    """kv [B,T,576] -> [rms(kv[:512]; kv_norm, eps) | kv[512:]] written into `cache` in place at positions
    lengths[b] .. lengths[b]+T-1 (module doc): cache [B,S_max,576] or, with block_table [B, max_pages] int32,
    the pool [n_pages, PAGE, 576]; bf16, or float8_e4m3fn with `scale` (0-d per-tensor, read; per-token
    [B,S_max] / [n_pages, PAGE] fp32, written). The caller validates the positions (inside the capacity).
    pdl=True: programmatic dependent launch (module doc for the caller's precondition); None: the enclosing
    k3lab_kernels.triton.pdl.pdl_chain's setting (the decode step's `pdl` switch), as in Triton."""
    if pdl is None:
        from k3lab_kernels.triton.pdl import chain_pdl

        pdl = chain_pdl(None)
    mode, paged = _validate(kv, kv_norm, cache, lengths, eps, scale, block_table, pdl)
    import cutlass

    B, T, _ = kv.shape
    dev = kv.device
    m = MODES[mode]
    page = cache.shape[1] if paged else 1
    # the fp8 rows travel as 32-bit words of four codes; pointers a variant never reads stand on lengths
    c_ptr = _ptr(cache, cutlass.BFloat16, 16) if m == 0 else _ptr(cache.view(torch.int32), cutlass.Int32, 16)
    s_ptr = _ptr(scale, cutlass.Float32, 4) if m else _ptr(lengths, cutlass.Float32, 4)
    t_ptr = _ptr(block_table, cutlass.Int32, 4) if paged else _ptr(lengths, cutlass.Int32, 4)
    args = [_ptr(kv, _cutlass_dtype(kv.dtype), 4 * kv.element_size()),
            _ptr(kv_norm, _cutlass_dtype(kv_norm.dtype), 4 * kv_norm.element_size()),
            c_ptr, s_ptr, t_ptr, _ptr(lengths, _cutlass_dtype(lengths.dtype), lengths.element_size()),
            float(eps), B * T, T, kv.stride(0), kv.stride(1), 0 if paged else cache.shape[1],
            block_table.stride(0) if paged else 0]
    key = (m, paged, page, pdl, SUM_ORDER, kv.dtype, kv_norm.dtype, lengths.dtype, dev.index)
    with torch.cuda.device(dev):
        stream = _stream(dev)
        fn = _COMPILED.get(key)
        if fn is None:
            from cutlass import cute
            fn = cute.compile(_kernel_class()(m, paged, page, pdl, SUM_ORDER), *args, stream)
            _COMPILED[key] = fn
        fn(*args, stream)
