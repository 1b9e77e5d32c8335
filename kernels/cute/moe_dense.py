"""Latent-MoE routed experts of one token in CuTe DSL, bf16 or fp8 weights (the dense twins of the MXFP4 one-token
kernels of kernels/cute/moe_experts.py, whose device helpers they use): two launches, no atomics, y written.

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

Floor (k3lab.ops.moe.experts_bytes): the K experts' W1, W3, W2 (and the fp8 scales) at the read bandwidth: TP8 bf16
16 x 8.26 MB = 132 MB, fp8 66 MB. Contract: moe_experts_dense(z, idx, wk, w1, w3, w2, s1, s3, s2, y, *, b1, b2,
pdl=None) -> y on torch's current stream; pdl=True: `up` waits for the kernel before (griddepcontrol.wait) before its
first read; None: the enclosing k3lab_kernels.triton.pdl.pdl_chain's setting. Arguments are checked by name
(MoECuteError); the component (k3lab.components.moe.experts, backend "cute", path "token") passes the stored weights.
"""
from typing import Any

import torch

from .moe_experts import MoECuteError, _fail, _ptr, _tensor, one_token

__all__ = ["MoECuteError", "moe_experts_dense"]

# rows a CTA: intermediate rows (of W1 and of W3) of the up kernel, latent rows of the down kernel (not yet swept on
# a GPU; a shape they do not divide takes 1)
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
            smem = cutlass.utils.SmemAllocator()
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
            if cutlass.const_expr(self.pdl):
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
                    g = g * vec(p_s1, e * I + r0 + tid, 1)[0]
                    u = u * vec(p_s3, e * I + r0 + tid, 1)[0]
                wt = vec(p_wk, k, 1)[0]
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
            smem = cutlass.utils.SmemAllocator()
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
            av = cute.make_rmem_tensor((CW,), Float32)
            for h in cutlass.range_constexpr(CW // 4):
                cute.autovec_copy(vec(p_act, cute.assume(k * I + CW * ch + 4 * h, divby=4), 4),
                                  cute.make_tensor(av.iterator + 4 * h, cute.make_layout(4)))
            acc = cute.make_rmem_tensor((R,), Float32)
            for r in cutlass.range_constexpr(R):
                a = chunk_dot(self.fp8, wv, r * (4 if self.fp8 else 8), av)
                if cutlass.const_expr(self.fp8):  # this pair's expert's scale of latent row c R + r
                    a = a * vec(p_s2, e * L + c * R + r, 1)[0]
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
# Host wrapper
# ---------------------------------------------------------------------------------------------

_COMPILED: dict[tuple, Any] = {}
_WS: dict[tuple, torch.Tensor] = {}
DTYPES = (torch.bfloat16, torch.float8_e4m3fn)


def rows_of(I: int, L: int) -> tuple[int, int]:
    """The rows a CTA of (up, down) at intermediate size I and latent L: UP_ROWS / DOWN_ROWS where they divide,
    else 1."""
    return (UP_ROWS if I % UP_ROWS == 0 else 1), (DOWN_ROWS if L % DOWN_ROWS == 0 else 1)


def moe_experts_dense(z, idx, wk, w1, w3, w2, s1, s3, s2, y, *, b1: float = 4.0, b2: float = 25.0,
                      pdl: bool | None = None):
    """y [1, L] fp32 = the routed experts of one token, bf16 or fp8 weights (module docstring). Returns y."""
    pdl = one_token(z, pdl)
    if not isinstance(w1, torch.Tensor) or w1.dim() != 3 or w1.dtype not in DTYPES:
        _fail("w1", f"must be the experts' [E, I, L] bf16 or float8_e4m3fn weights, got "
                    f"{getattr(w1, 'dtype', type(w1).__name__)} {tuple(getattr(w1, 'shape', ()))}")
    dev, L = z.device, z.shape[1]
    E, I = w1.shape[0], w1.shape[1]
    fp8 = w1.dtype == torch.float8_e4m3fn
    cw = 16 if fp8 else 8
    if L % cw or I % cw:
        _fail("z", f"L and I must be multiples of {cw} (16-byte chunks of {w1.dtype} rows), got L={L}, I={I}")
    if not isinstance(idx, torch.Tensor) or idx.dim() != 2 or idx.shape[0] != 1:
        _fail("idx", f"must be [1, K] expert ids, got {getattr(idx, 'shape', idx)!r}")
    K = idx.shape[1]
    _tensor("z", z, None, (torch.bfloat16,), (1, L))
    _tensor("w1", w1, dev, (w1.dtype,), (E, I, L))
    _tensor("w3", w3, dev, (w1.dtype,), (E, I, L))
    _tensor("w2", w2, dev, (w1.dtype,), (E, L, I))
    _tensor("idx", idx, dev, (torch.int32, torch.int64), (1, K))
    _tensor("wk", wk, dev, (torch.float32,), (1, K))
    _tensor("y", y, dev, (torch.float32,), (1, L))
    if fp8:
        _tensor("s1", s1, dev, (torch.float32,), (E, I))
        _tensor("s3", s3, dev, (torch.float32,), (E, I))
        _tensor("s2", s2, dev, (torch.float32,), (E, L))
    else:
        for name, s in (("s1", s1), ("s3", s3), ("s2", s2)):
            if s is not None:
                _fail(name, "is the fp8 weights' row scale; these weights are bf16 (pass None)")
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
