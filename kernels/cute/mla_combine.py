"""Gated-MLA combine as one CuTe DSL kernel (the twin of kernels/triton/mla_combine.py): the log-sum-exp merge of
the attention partials (split-KV pieces and/or DCP shards), the value up-projection and the sigmoid output gate.

    o[b,t,h]        = sum_k exp(lse_k - m) o_k / sum_k exp(lse_k - m),  m = max_k lse_k   (fp32; lse_k = -inf: 0)
    out[b,t,h*Dv+v] = (bf16(o[b,t,h]) @ Wuv[h])[v] * sigmoid(gate[b,t,h*Dv+v])                           (bf16)

what the output projection Wo reads (k3lab.ref.mla.mla_combine). o is rounded to bf16 before the product, as both
Triton kernels round it for their product.

Layout. A CTA of 128 threads (4 warps) owns one head h, BV = 32 output columns and RB rows (b, t); grid
(H, Dv / BV, ceil(B*T / RB)): 48 CTAs at batch 1 and 12 heads. RB (`block_r`): 1 up to 2 rows (batch 1 decode),
else 4 (`default_block_r`), halved while RB * K > MAX_WEIGHTS.
  1. weights (K > 1): warp r % 4 reads row r's K lse values (lanes k, k + 32, ...), their max by shuffles, the
     weights exp(lse_k - max) into shared memory and their sum; an all-empty row (every lse = -inf) weighs 0.
  2. merge: thread i owns latent values 4 i .. 4 i + 3 of each row (one 16-byte load a partial, the loads of
     eight partials issued together), sum_k w_k o_k / sum_k w_k rounded to bf16 into shared memory [RB, 512]
     (K = 1, an already merged o_lat: one load); rows past B*T hold zeros.
  3. product: thread i takes output columns 8 (i % 4) .. + 7 of the CTA's 32 and latent values i // 4 + 32 s,
     s = 0..15: its 16 Wuv loads of 16 bytes are issued at once (each Wuv element read once for the RB rows), the
     RB x 8 partial sums reduced over the warp's 8 latent lanes by shuffles and over the 4 warps in shared
     memory; warp 0, lane = column, applies sigmoid(gate) (fp32) and stores bf16.
The merge is repeated by the Dv / BV = 4 column CTAs of a head (the partials then come from L2); the decode step
hands this kernel an already merged o_lat (K = 1). (The first version, one scalar Wuv load and 4 scalar partial
loads a step, lost to Triton's at batch 1: profiles/h200/mla_combine_cute.json.gz (git history at 58394f6), a15ce2b;
figures in docs/NOTES_mla.md.)

Floor (bytes, k3lab.ops.mla.combine_bytes, the Triton kernel's): Wuv H*C*Dv*2 (12 heads: 1.57 MB) + partials
B*K*T*H*(C+1)*4 + gate and out B*T*H*Dv*2 each; launch-bound at batch 1.

Contract (torch tensors on one CUDA device, torch's current stream, CUDA-graph safe once a shape has compiled):
mla_combine(o_part, lse_part, w_uv, gate, out=None, *, block_r=None, pdl=None) with the Triton wrapper's tensors:
o_part [B,K,T,H,512] fp32 contiguous (or a merged o_lat [B,T,H,512], K = 1), lse_part [B,K,T,H] fp32 contiguous (None
when K = 1), w_uv [H,512,128] bf16 contiguous, gate [B,T,H*128] bf16 contiguous; out [B,T,H*128] bf16 contiguous
(allocated when None). pdl=True (programmatic dependent launch): Wuv is not read before the wait, the gate is
(the caller's precondition: the kernel directly before writes neither the gate nor Wuv); None: the enclosing
k3lab_kernels.triton.pdl.pdl_chain's setting, as in Triton.
"""
from typing import Any

import torch

C_LATENT = 512
D_V = 128
_THREADS = 128
_BV = 32                       # output columns a CTA
BLOCK_R_ALLOWED = (1, 2, 4, 8)
ROW_CTA_MAX_ROWS = 2           # up to this many rows (b, t) one row a CTA (the Triton one-row path's limit too)
MAX_WEIGHTS = 4096             # RB * K merge weights a CTA keeps in shared memory (16 KB)

__all__ = ["BLOCK_R_ALLOWED", "default_block_r", "mla_combine"]


def default_block_r(rows: int, K: int = 1) -> int:
    """Rows (b, t) a CTA: one at batch-1 sizes (more CTAs read Wuv), four above (Wuv read once for four rows),
    halved while the rows' merge weights exceed MAX_WEIGHTS."""
    rb = 1 if rows <= ROW_CTA_MAX_ROWS else 4
    while rb > 1 and rb * K > MAX_WEIGHTS:
        rb //= 2
    return rb


_KERNEL_CLS = None


def _kernel_class():
    """The combine generator (built once; importing this module never needs cutlass)."""
    global _KERNEL_CLS
    if _KERNEL_CLS is not None:
        return _KERNEL_CLS
    import cuda.bindings.driver as cuda
    import cutlass
    from cutlass import Float32, cute

    C, DV, BV = C_LATENT, D_V, _BV
    CS = C // 32  # latent values a thread takes in the product

    def vec(ptr, off, n):
        return cute.make_tensor(ptr + off, cute.make_layout(n))

    class MLACombineKernel:
        """One CTA per (head, 32 output columns, RB rows)."""

        def __init__(self, H: int, K: int, T: int, NR: int, RB: int, pdl: bool = False):
            assert RB in BLOCK_R_ALLOWED, RB
            self.H, self.K, self.T, self.NR, self.RB = H, K, T, NR, RB
            self.pdl = bool(pdl)

        @cute.jit
        def __call__(self, p_o: cute.Pointer, p_lse: cute.Pointer, p_w: cute.Pointer, p_gate: cute.Pointer,
                     p_out: cute.Pointer, stream: cuda.CUstream):
            self.kernel(p_o, p_lse, p_w, p_gate, p_out).launch(
                grid=[self.H, DV // BV, (self.NR + self.RB - 1) // self.RB], block=[_THREADS, 1, 1], stream=stream,
                use_pdl=self.pdl)

        @cute.kernel
        def kernel(self, p_o: cute.Pointer, p_lse: cute.Pointer, p_w: cute.Pointer, p_gate: cute.Pointer,
                   p_out: cute.Pointer):
            H, K, T, NR, RB = self.H, self.K, self.T, self.NR, self.RB
            TH = T * H
            tid, _, _ = cute.arch.thread_idx()
            h, vb, rb = cute.arch.block_idx()
            warp = cute.arch.make_warp_uniform(cute.arch.warp_idx())
            lane = tid % 32

            smem = cutlass.memory.SmemAllocator()
            s_o = smem.allocate_tensor(Float32, cute.make_layout(RB * C), byte_alignment=16)
            s_acc = smem.allocate_tensor(Float32, cute.make_layout(4 * RB * 32), byte_alignment=16)
            s_w = smem.allocate_tensor(Float32, cute.make_layout(RB * K + RB), byte_alignment=16)  # weights, sums
            lse_g = cute.make_tensor(p_lse, cute.make_layout(NR * K * H))
            gate_g = cute.make_tensor(p_gate, cute.make_layout(NR * H * DV))
            out_g = cute.make_tensor(p_out, cute.make_layout(NR * H * DV))

            # the gate of warp 0's column (lane) for each row: the split does not write it, so before the PDL wait
            g = cute.make_rmem_tensor((RB,), p_gate.dtype)
            for r in cutlass.range_constexpr(RB):
                row = rb * RB + r
                g[r] = Float32(0.0).to(p_gate.dtype)
                if row < NR:
                    g[r] = gate_g[row * (H * DV) + h * DV + vb * BV + lane]
            if cutlass.const_expr(self.pdl):
                cute.arch.griddepcontrol_wait()  # the partials are complete and visible after this
                cute.arch.griddepcontrol_launch_dependents()

            # ---- 1. merge weights: warp r % 4 takes row r ------------------------------------------------------
            if cutlass.const_expr(K > 1):
                for r in cutlass.range_constexpr(RB):
                    row = rb * RB + r
                    if warp == r % 4:
                        den = Float32(0.0)
                        if row < NR:
                            b = row // T
                            base = (b * K * T + row - b * T) * H + h  # partial k of (b, t, h) at base + k * TH
                            m = Float32(float("-inf"))
                            for k in cutlass.range(lane, K, 32):
                                m = cute.arch.fmax(m, lse_g[base + k * TH])
                            for sh in cutlass.range_constexpr(5):
                                m = cute.arch.fmax(m, cute.arch.shuffle_sync_bfly(m, offset=16 >> sh))
                            if m == Float32(float("-inf")):
                                m = Float32(0.0)  # every partial empty: all weights 0
                            for k in cutlass.range(lane, K, 32):
                                wk = cute.math.exp(lse_g[base + k * TH] - m)
                                s_w[r * K + k] = wk
                                den = den + wk
                            for sh in cutlass.range_constexpr(5):
                                den = den + cute.arch.shuffle_sync_bfly(den, offset=16 >> sh)
                        if lane == 0:
                            s_w[RB * K + r] = den
                cute.arch.sync_threads()

            # ---- 2. merge: latent values 4 tid .. 4 tid + 3 of each row --------------------------------------
            acc = cute.make_rmem_tensor((4,), Float32)
            x = cute.make_rmem_tensor((4,), Float32)
            for r in cutlass.range_constexpr(RB):
                row = rb * RB + r
                acc.fill(0.0)
                if row < NR:
                    b = row // T
                    base = (b * K * T + row - b * T) * H + h
                    if cutlass.const_expr(K == 1):
                        cute.autovec_copy(vec(p_o, cute.assume(base * C + 4 * tid, divby=4), 4), acc)
                    else:
                        for k in cutlass.range(K, unroll=8):
                            cute.autovec_copy(vec(p_o, cute.assume((base + k * TH) * C + 4 * tid, divby=4), 4), x)
                            wk = s_w[r * K + k]
                            for j in cutlass.range_constexpr(4):
                                acc[j] = acc[j] + wk * x[j]
                        den = s_w[RB * K + r]
                        if den > Float32(0.0):
                            inv = Float32(1.0) / den
                            for j in cutlass.range_constexpr(4):
                                acc[j] = acc[j] * inv
                for j in cutlass.range_constexpr(4):
                    s_o[r * C + 4 * tid + j] = acc[j].to(cutlass.BFloat16).to(Float32)
            cute.arch.sync_threads()

            # ---- 3. product: columns 8 (tid % 4) .. + 7, latent values tid // 4 + 32 s --------------------------
            oc = tid % 4
            ci = tid // 4
            w_r = cute.make_rmem_tensor((8, CS), p_w.dtype)
            wsrc = cute.make_tensor(p_w + cute.assume((h * C + ci) * DV + vb * BV + 8 * oc, divby=8),
                                    cute.make_layout((8, CS), stride=(1, 32 * DV)))
            cute.autovec_copy(wsrc, w_r)  # 16 loads of 16 bytes, all in flight
            y = cute.make_rmem_tensor((8, RB), Float32)
            y.fill(0.0)
            for si in cutlass.range_constexpr(CS):
                for r in cutlass.range_constexpr(RB):
                    sv = s_o[r * C + ci + 32 * si]
                    for j in cutlass.range_constexpr(8):
                        y[j, r] = y[j, r] + sv * w_r[j, si].to(Float32)
            # over the warp's 8 latent lanes (lane bits 2..4), then over the 4 warps
            for r in cutlass.range_constexpr(RB):
                for j in cutlass.range_constexpr(8):
                    for sh in cutlass.range_constexpr(3):
                        y[j, r] = y[j, r] + cute.arch.shuffle_sync_bfly(y[j, r], offset=16 >> sh)
            if lane < 4:
                for r in cutlass.range_constexpr(RB):
                    for j in cutlass.range_constexpr(8):
                        s_acc[(warp * RB + r) * 32 + 8 * oc + j] = y[j, r]
            cute.arch.sync_threads()
            if warp == 0:
                for r in cutlass.range_constexpr(RB):
                    row = rb * RB + r
                    if row < NR:
                        s = (s_acc[r * 32 + lane] + s_acc[(RB + r) * 32 + lane]) + \
                            (s_acc[(2 * RB + r) * 32 + lane] + s_acc[(3 * RB + r) * 32 + lane])
                        s = s / (Float32(1.0) + cute.math.exp(-g[r].to(Float32)))
                        out_g[row * (H * DV) + h * DV + vb * BV + lane] = s.to(p_out.dtype)

    _KERNEL_CLS = MLACombineKernel
    return MLACombineKernel


# ---------------------------------------------------------------------------------------------
# Host wrapper
# ---------------------------------------------------------------------------------------------

_COMPILED: dict[tuple, Any] = {}


class MLACombineError(ValueError):
    """An argument of the CuTe combine has the wrong type, shape, dtype, layout or device."""


def _fail(name: str, msg: str):
    raise MLACombineError(f"mla_combine cute: {name!r} {msg}")


def _tensor(name, t, device, dtypes, shape=None):
    if not isinstance(t, torch.Tensor):
        _fail(name, f"must be a torch.Tensor, got {type(t).__name__}")
    if t.device.type != "cuda":
        _fail(name, f"must be on a CUDA device, got {t.device}")
    if device is not None and t.device != device:
        _fail(name, f"is on {t.device}, expected {device} (the device of o_part)")
    if t.dtype not in dtypes:
        _fail(name, f"must have dtype in {[str(d).replace('torch.', '') for d in dtypes]}, got {t.dtype}")
    if shape is not None and tuple(t.shape) != tuple(shape):
        _fail(name, f"must have shape {tuple(shape)}, got {tuple(t.shape)}")
    if not t.is_contiguous():
        _fail(name, "must be contiguous")
    return t


def _ptr(t: torch.Tensor, align: int):
    import cutlass
    from cutlass import cute
    from cutlass.cute.runtime import make_ptr
    dt = {torch.float32: cutlass.Float32, torch.bfloat16: cutlass.BFloat16}[t.dtype]
    return make_ptr(dt, t.data_ptr(), cute.AddressSpace.gmem, assumed_align=align)


def mla_combine(o_part: torch.Tensor, lse_part: torch.Tensor | None, w_uv: torch.Tensor, gate: torch.Tensor,
                out: torch.Tensor | None = None, *, block_r: int | None = None,
                pdl: bool | None = None) -> torch.Tensor:
    """out [B,T,H*128] = merge(o_part) @ Wuv[h] * sigmoid(gate) (module doc). Returns `out`."""
    if pdl is None:
        from k3lab_kernels.triton.pdl import chain_pdl

        pdl = chain_pdl(None)
    if not isinstance(pdl, bool):
        _fail("pdl", f"must be None or a bool, got {pdl!r}")
    _tensor("o_part", o_part, None, (torch.float32,))
    dev = o_part.device
    o5 = o_part.unsqueeze(1) if o_part.dim() == 4 else o_part
    if o5.dim() != 5 or o5.shape[-1] != C_LATENT:
        _fail("o_part", f"must be [B,K,T,H,{C_LATENT}] partials or a merged [B,T,H,{C_LATENT}], got "
                        f"{tuple(o_part.shape)}")
    B, K, T, H, _ = o5.shape
    if B < 1 or K < 1 or T < 1 or H < 1:
        _fail("o_part", f"must not be empty, got {tuple(o_part.shape)}")
    if K == 1 and lse_part is not None and o_part.dim() == 4:
        _fail("lse_part", "must be None when o_part is an already merged o_lat [B,T,H,C]")
    if K > 1 or lse_part is not None:
        _tensor("lse_part", lse_part, dev, (torch.float32,), (B, K, T, H))
    _tensor("w_uv", w_uv, dev, (torch.bfloat16,), (H, C_LATENT, D_V))
    _tensor("gate", gate, dev, (torch.bfloat16,), (B, T, H * D_V))
    if out is None:
        out = torch.empty(B, T, H * D_V, dtype=torch.bfloat16, device=dev)
    _tensor("out", out, dev, (torch.bfloat16,), (B, T, H * D_V))
    for name, t in (("o_part", o5), ("w_uv", w_uv)):  # 16-byte vector loads
        if t.data_ptr() % 16:
            _fail(name, f"base address must be 16-byte aligned (got 0x{t.data_ptr():x})")
    if o5.numel() >= 2 ** 31:
        _fail("o_part", f"holds {o5.numel()} elements: the kernel indexes with 32 bits (< 2^31)")
    NR = B * T
    RB = default_block_r(NR, K) if block_r is None else block_r
    if isinstance(RB, bool) or RB not in BLOCK_R_ALLOWED:
        _fail("block_r", f"must be None or one of {BLOCK_R_ALLOWED}, got {block_r!r}")
    if K > 1 and RB * K > MAX_WEIGHTS:
        _fail("block_r" if block_r is not None else "o_part", f"{RB} rows x {K} partials exceed the "
              f"{MAX_WEIGHTS} merge weights a CTA keeps in shared memory")
    lse = lse_part if lse_part is not None else o5  # never read at K = 1
    args = [_ptr(o5, 16), _ptr(lse, 4), _ptr(w_uv, 16), _ptr(gate, 2), _ptr(out, 2)]
    key = (H, K, T, NR, RB, pdl, dev.index)
    with torch.cuda.device(dev):
        import cuda.bindings.driver as cuda

        stream = cuda.CUstream(torch.cuda.current_stream(dev).cuda_stream)
        fn = _COMPILED.get(key)
        if fn is None:
            from cutlass import cute

            fn = cute.compile(_kernel_class()(H, K, T, NR, RB, pdl), *args, stream)
            _COMPILED[key] = fn
        fn(*args, stream)
    return out
