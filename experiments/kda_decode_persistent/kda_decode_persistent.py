"""A study kernel (experiments/kda_decode_persistent/README.md): the KDA decode step (T = 1) as one
persistent CuTe DSL kernel that streams the state through shared memory with the TMA unit. Measured on
the H200, not faster than the production grid kernel (k3lab_kernels.cute.kda_decode); nothing imports it.

What one launch fuses is exactly the production decode's (and `k3lab.ref.kda.kda_decode`): conv update +
silu of the head's q|k|v channels (conv_state shifted in place), l2norm of q and k, the decay gate and beta,
the delta rule on the fp32 state (in place), and the gated output RMSNorm into `out`.

Schedule. grid = min(B * H, ctas x SMs) CTAs of 256 threads, `ctas` (1 or 2) per SM; CTA i takes the (b, h) items
i, i + grid, i + 2 grid, ... in order. An item's fp32 state is one contiguous 64 KiB block: one thread
fetches it with a single cp.async.bulk into one of `stages` (1 to 3) shared-memory buffers, completing
on an mbarrier, `stages` items ahead of use. The item's small inputs (conv window, q|k|v, f, b, gate,
the head's conv weights, dt_bias, A_log) are loaded into registers one item ahead. So while a CTA
computes item j, the states of items j+1 .. j+stages-1 stream in and item j-1's new state drains from
registers (st.global.v4) behind it: loads, maths and stores of different items overlap, and no SM
waits for a wave to end. The per-item maths is the production decode's row layout at tile 128 (warp w
owns key rows w, w+8, ..; lane l value columns 4l..4l+3; both key reductions in one pass; partial sums
through shared memory; warp 0 finishes the RMSNorm). Shared memory: stages x 64 KiB + 20 KiB.

Why: the grid kernel (k3lab_kernels.cute.kda_decode) gives each CTA one item: load, compute, store, 2 CTAs per SM.
At B = 64, 12 heads (768 items, 2.9 waves on 132 SMs) it reached 3.42 TB/s (profiles/h200/
kda_sweep.json.gz) while long grids reach 3.85-3.95 TB/s: the loss is the wave tail and the
serialisation of load, compute and store inside each CTA. This kernel is for large batch only; at
small batch (items < SMs) it leaves SMs idle and the grid kernel with column tiles wins.

(ctas, stages) = (3, 1) is the register-light form ("regless"): no state in registers, so 3 CTAs and 3
states are in flight per SM.

Measured (profiles/h200/kda_cute_exp.json.gz, in git history at af86fbf; check_kda.py --exp of the time, 12 heads,
DRAM-cold): it does not beat the grid kernel.
B=64: grid 31.04 us; (CTAs per SM, stages) (2, 1) 31.02, (1, 2) 32.56, (1, 3) 34.65.
B=256: grid 109.42; (2, 1) 112.09. B=16: grid 10.98, (2, 1) 10.66. With one buffer set
reused (hot_us, state warm in L2) B=64 is 28.96 us against the grid's 30.58; with the previous call's dirty
state in L2 to write back, as in a real decode, the gain disappears. (3, 1) later ran too: 33.25 against
31.05 us at B=64 (kda_cute_exp_pdl.json.gz).

Floor (same bytes as the grid kernel, per (b, h) 137,218 B, see k3lab_kernels.cute.kda_decode):
    H = 12, B = 64: 105.4 MB -> 24.7 us at 4.275 TB/s (the issue's target: >= 3.6 TB/s, <= 29.3 us).

Host API (torch tensors on one CUDA device; current stream; CUDA-graph safe once compiled):

    kda_decode_persistent(qkv, f, b, gate, params, state, conv_state, out, stages=3, ctas=1) -> out

Same arguments and checks as kda_decode (tile 128 only); (ctas, stages) in CONFIGS.
"""
import functools
import math

import torch

import k3lab  # noqa: F401  (maps k3lab_kernels onto the checkout when it is not installed)
from k3lab_kernels.cute.kda_decode import (_D, _THREADS, _dsl, _get_compiled, _kernel_args, _params_key, _stream,
                                          _validate)

__all__ = ["CONFIGS", "STAGES", "kda_decode_persistent"]

STAGES = (1, 2, 3)
# (CTAs per SM, stages) that fit: ctas * (stages * 64 KiB + 20 KiB) <= 227 KiB, and 2 CTAs need <= 128 registers
# (3, 1) is the register-light form: the state is never held in registers (both passes read the shared
# stage, the update goes straight to global), so 3 CTAs fit an SM: 3 states in flight instead of 2.
CONFIGS = ((1, 2), (1, 3), (2, 1), (3, 1))
_STATE_BYTES = _D * _D * 4
_CLS = None


def _persistent_class():
    global _CLS
    if _CLS is not None:
        return _CLS
    d = _dsl()
    cuda, cutlass, Float32, Int32, cute = d.cuda, d.cutlass, d.Float32, d.Int32, d.cute
    sigmoid, vec, warp_sum = d.sigmoid, d.vec, d.warp_sum
    prologue_position, position_norms = d.prologue_position, d.position_norms
    from cutlass._mlir.dialects import nvvm as _nvvm
    from cutlass.cutlass_dsl import dsl_user_op

    @dsl_user_op
    def bulk_load(dst_smem, src_gmem, mbar, nbytes: int, *, loc=None, ip=None):
        """cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes of nbytes contiguous bytes."""
        _nvvm.cp_async_bulk_shared_cluster_global(
            dst_smem.to_llvm_ptr(loc=loc, ip=ip), src_gmem.to_llvm_ptr(loc=loc, ip=ip),
            mbar.to_llvm_ptr(loc=loc, ip=ip), Int32(nbytes).ir_value(loc=loc, ip=ip), loc=loc, ip=ip)

    def load_item(it, H, half, c, col0, qkv_g, conv_g, convw_g, f_g, b_g, alog_g, dtb_g, p_gate,
                  n_x, n_win, n_w, n_fb, n_par, n_gate):
        """Item `it`'s small inputs into the prefetch registers (both channels and the gate constants for
        every thread: branch-free; the unused ones are valid addresses of the same item)."""
        D = _D
        HD = H * D
        C = 3 * HD
        bb = it // H
        h = it - bb * H
        ch1 = half * (2 * HD) + h * D + c
        ch2 = HD + h * D + c
        n_x[0] = qkv_g[bb * C + ch1]
        n_x[1] = qkv_g[bb * C + ch2]
        for i in range(3):
            n_win[0, i] = conv_g[(bb * C + ch1) * 3 + i]
            n_win[1, i] = conv_g[(bb * C + ch2) * 3 + i]
        for i in range(4):
            n_w[0, i] = convw_g[ch1 * 4 + i]
            n_w[1, i] = convw_g[ch2 * 4 + i]
        n_fb[0] = f_g[bb * HD + h * D + c]
        n_fb[1] = b_g[bb * H + h]
        n_par[0] = alog_g[h].to(Float32)
        n_par[1] = dtb_g[h * D + c].to(Float32)
        cute.autovec_copy(vec(p_gate, cute.assume(bb * HD + h * D + col0, divby=4), 4), n_gate)

    class KDADecodePersistent:
        """grid CTAs (one per SM); CTA i runs items i, i + grid, ...; state via cp.async.bulk stages."""

        def __init__(self, B: int, H: int, T: int, verify: bool, ragged: bool, eps: float,
                     lower_bound: float, tile_v: int = 128, sms: int = 132, stages: int = 3, ctas: int = 1):
            assert T == 1 and not verify and not ragged and tile_v == 128
            assert (ctas, stages) in CONFIGS
            self.B, self.H = B, H
            self.eps, self.lb = float(eps), float(lower_bound)
            self.N = B * H
            self.grid = max(1, min(ctas * sms, self.N))
            self.NS = stages
            self.ctas = ctas
            self.regless = ctas >= 3
            self.NB = 1 if self.regless else 2  # s_info / s_red / s_part buffers (regless: a third barrier)

        @cute.jit
        def __call__(self, p_qkv: cute.Pointer, p_f: cute.Pointer, p_b: cute.Pointer,
                     p_gate: cute.Pointer, p_convw: cute.Pointer, p_alog: cute.Pointer,
                     p_dtb: cute.Pointer, p_onw: cute.Pointer, p_state: cute.Pointer,
                     p_conv: cute.Pointer, p_out: cute.Pointer, p_shist: cute.Pointer,
                     p_chist: cute.Pointer, p_len: cute.Pointer, stream: cuda.CUstream):
            self.kernel(p_qkv, p_f, p_b, p_gate, p_convw, p_alog, p_dtb, p_onw, p_state, p_conv,
                        p_out).launch(grid=[self.grid, 1, 1], block=[_THREADS, 1, 1], stream=stream,
                                      max_number_threads=[_THREADS, 1, 1], min_blocks_per_mp=self.ctas)

        @cute.kernel
        def kernel(self, p_qkv: cute.Pointer, p_f: cute.Pointer, p_b: cute.Pointer,
                   p_gate: cute.Pointer, p_convw: cute.Pointer, p_alog: cute.Pointer,
                   p_dtb: cute.Pointer, p_onw: cute.Pointer, p_state: cute.Pointer,
                   p_conv: cute.Pointer, p_out: cute.Pointer):
            D = _D
            H = self.H
            N = self.N
            GRID = self.grid
            NS = self.NS
            HD = H * D
            C = 3 * HD
            DD = D * D
            scale = 1.0 / math.sqrt(D)

            tid, _, _ = cute.arch.thread_idx()
            bid, _, _ = cute.arch.block_idx()
            warp = cute.arch.make_warp_uniform(cute.arch.warp_idx())
            lane = tid % 32
            col0 = lane * 4    # this thread's 4 value columns
            lower = tid < 128
            half = tid // 128  # 0: q/k channels of row c; 1: v channel and decay gate of row c
            c = tid % 128

            smem = cutlass.memory.SmemAllocator()
            s_stage = smem.allocate_tensor(Float32, cute.make_layout(NS * DD), byte_alignment=128)
            NB = self.NB
            s_info = smem.allocate_tensor(Float32, cute.make_layout(NB * 128 * 4), byte_alignment=16)
            s_red = smem.allocate_tensor(Float32, cute.make_layout(NB * 16), byte_alignment=16)
            s_part = smem.allocate_tensor(Float32, cute.make_layout(NB * 8 * 256), byte_alignment=16)
            mbar = smem.allocate_array(cutlass.Int64, NS, byte_alignment=8)

            qkv_g = cute.make_tensor(p_qkv, cute.make_layout(self.B * C))
            f_g = cute.make_tensor(p_f, cute.make_layout(self.B * HD))
            b_g = cute.make_tensor(p_b, cute.make_layout(self.B * H))
            conv_g = cute.make_tensor(p_conv, cute.make_layout(self.B * C * 3))
            convw_g = cute.make_tensor(p_convw, cute.make_layout(C * 4))
            alog_g = cute.make_tensor(p_alog, cute.make_layout(H))
            dtb_g = cute.make_tensor(p_dtb, cute.make_layout(HD))

            # ---- the first `stages` states in flight -------------------------------------------
            if tid == 0:
                for s in cutlass.range_constexpr(NS):
                    cute.arch.mbarrier_init(mbar + s, 1)
                cute.arch.mbarrier_init_fence()
            cute.arch.sync_threads()
            if tid == 0:
                for s in cutlass.range_constexpr(NS):
                    itp = bid + s * GRID
                    if itp < N:
                        cute.arch.mbarrier_arrive_and_expect_tx(mbar + s, _STATE_BYTES)
                        bulk_load(s_stage.iterator + s * DD, p_state + itp * DD, mbar + s, _STATE_BYTES)

            # ---- the next item's small inputs, one item ahead, in registers (load_item) ---------
            n_x = cute.make_rmem_tensor((2,), p_qkv.dtype)       # x of channel 1 (q | v), channel 2 (k)
            n_win = cute.make_rmem_tensor((2, 3), p_qkv.dtype)   # conv windows of the two channels
            n_w = cute.make_rmem_tensor((2, 4), p_convw.dtype)   # conv weights of the two channels
            n_fb = cute.make_rmem_tensor((2,), p_f.dtype)        # f[row c], b[head]
            n_par = cute.make_rmem_tensor((2,), Float32)         # A_log[h], dt_bias[h, c]
            n_gate = cute.make_rmem_tensor((4,), p_gate.dtype)   # gate of this lane's 4 columns
            r_onw_raw = cute.make_rmem_tensor((4,), p_onw.dtype)
            cute.autovec_copy(vec(p_onw, cute.assume(col0, divby=4), 4), r_onw_raw)

            load_item(bid, H, half, c, col0, qkv_g, conv_g, convw_g, f_g, b_g, alog_g, dtb_g, p_gate,
                      n_x, n_win, n_w, n_fb, n_par, n_gate)

            win1 = cute.make_rmem_tensor((4,), p_qkv.dtype)
            win2 = cute.make_rmem_tensor((4,), p_qkv.dtype)
            w1 = cute.make_rmem_tensor((4,), Float32)
            w2 = cute.make_rmem_tensor((4,), Float32)
            gate_r = cute.make_rmem_tensor((4,), p_gate.dtype)
            r_s = cute.make_rmem_tensor((4, 1) if self.regless else (4, 16), Float32)  # regless: one row
            r_info = cute.make_rmem_tensor((4,), Float32)
            acc_k = cute.make_rmem_tensor((4,), Float32)
            acc_q = cute.make_rmem_tensor((4,), Float32)
            r_p = cute.make_rmem_tensor((4,), Float32)
            u = cute.make_rmem_tensor((4,), Float32)
            o = cute.make_rmem_tensor((4,), Float32)
            r_out = cute.make_rmem_tensor((4,), p_out.dtype)

            n_my = (N - bid + GRID - 1) // GRID
            for j in cutlass.range(n_my, unroll=1):
                it = bid + j * GRID
                bb = it // H
                h = it - bb * H
                buf = j % NB
                st = j % NS
                phase = (j // NS) % 2
                ch1 = half * (2 * HD) + h * D + c
                ch2 = HD + h * D + c

                # this item's inputs out of the prefetch registers, then the next item's loads go out
                x1 = n_x[0]
                x2 = n_x[1]
                fv = n_fb[0]
                bv = n_fb[1].to(Float32)
                a_exp = cute.math.exp(n_par[0])
                dtb = n_par[1]
                for i in cutlass.range_constexpr(3):
                    win1[i] = n_win[0, i]
                    win2[i] = n_win[1, i]
                for i in cutlass.range_constexpr(4):
                    w1[i] = n_w[0, i].to(Float32)
                    w2[i] = n_w[1, i].to(Float32)
                    gate_r[i] = n_gate[i]
                nxt = it + GRID
                if nxt >= N:
                    nxt = it
                load_item(nxt, H, half, c, col0, qkv_g, conv_g, convw_g, f_g, b_g, alog_g, dtb_g, p_gate,
                          n_x, n_win, n_w, n_fb, n_par, n_gate)

                # ---- prologue (state-independent): conv + silu, gate, norms; conv state in place ----
                prologue_position(x1, x2, fv, win1, win2, w1, w2, a_exp, dtb, self.lb, lower, lane, warp, c,
                                  s_info, buf * 512 + c * 4, s_red, buf * 16)
                for i in cutlass.range_constexpr(3):
                    conv_g[(bb * C + ch1) * 3 + i] = win1[i]
                if lower:
                    for i in cutlass.range_constexpr(3):
                        conv_g[(bb * C + ch2) * 3 + i] = win2[i]

                # ---- this item's state: shared stage -> registers --------------------------------
                cute.arch.mbarrier_wait(mbar + st, phase)
                if cutlass.const_expr(not self.regless):
                    s_src = cute.make_tensor(s_stage.iterator + cute.assume(st * DD + warp * D + col0, divby=4),
                                             cute.make_layout((4, 16), stride=(1, 8 * D)))
                    cute.autovec_copy(s_src, r_s)
                cute.arch.sync_threads()  # s_info / s_red complete; every thread has read stage st
                if cutlass.const_expr(not self.regless):
                    if tid == 0:
                        nf = it + NS * GRID
                        if nf < N:
                            cute.arch.mbarrier_arrive_and_expect_tx(mbar + st, _STATE_BYTES)
                            bulk_load(s_stage.iterator + st * DD, p_state + nf * DD, mbar + st, _STATE_BYTES)

                # ---- pass 1: k^T diag(d) S and q^T diag(d) S over the old state -----------------
                rq, rk, dot = position_norms(s_red, buf * 16)
                qk = dot * rq * rk
                beta = sigmoid(bv)
                acc_k.fill(0.0)
                acc_q.fill(0.0)
                for i in cutlass.range_constexpr(16):
                    r = i * 8 + warp
                    cute.autovec_copy(vec(s_info.iterator, cute.assume(buf * 512 + r * 4, divby=4), 4), r_info)
                    qd = r_info[0] * r_info[2]
                    kd = r_info[1] * r_info[2]
                    ii = i
                    if cutlass.const_expr(self.regless):
                        ii = 0
                        cute.autovec_copy(vec(s_stage.iterator, cute.assume(st * DD + r * D + col0, divby=4), 4),
                                          r_s[None, 0])
                    for jj in cutlass.range_constexpr(4):
                        acc_k[jj] = acc_k[jj] + kd * r_s[jj, ii]
                        acc_q[jj] = acc_q[jj] + qd * r_s[jj, ii]
                p_off = cute.assume(buf * 2048 + warp * 256 + col0, divby=4)
                cute.autovec_copy(acc_k, vec(s_part.iterator, p_off, 4))
                cute.autovec_copy(acc_q, vec(s_part.iterator, p_off + 128, 4))
                cute.arch.sync_threads()

                # ---- combine the 8 warps' partials, delta-rule update, state out -----------------
                acc_k.fill(0.0)
                acc_q.fill(0.0)
                for w in cutlass.range_constexpr(8):
                    o_w = cute.assume(buf * 2048 + w * 256 + col0, divby=4)
                    cute.autovec_copy(vec(s_part.iterator, o_w, 4), r_p)
                    for jj in cutlass.range_constexpr(4):
                        acc_k[jj] = acc_k[jj] + r_p[jj]
                    cute.autovec_copy(vec(s_part.iterator, o_w + 128, 4), r_p)
                    for jj in cutlass.range_constexpr(4):
                        acc_q[jj] = acc_q[jj] + r_p[jj]
                for jj in cutlass.range_constexpr(4):
                    vj = s_info[buf * 512 + (col0 + jj) * 4 + 3]
                    u[jj] = beta * (vj - rk * acc_k[jj])
                for i in cutlass.range_constexpr(16):
                    r = i * 8 + warp
                    cute.autovec_copy(vec(s_info.iterator, cute.assume(buf * 512 + r * 4, divby=4), 4), r_info)
                    dr = r_info[2]
                    kr = r_info[1] * rk
                    if cutlass.const_expr(self.regless):
                        # row r: shared stage -> registers -> updated -> global (16 B a lane)
                        cute.autovec_copy(vec(s_stage.iterator, cute.assume(st * DD + r * D + col0, divby=4), 4),
                                          r_s[None, 0])
                        for jj in cutlass.range_constexpr(4):
                            r_s[jj, 0] = dr * r_s[jj, 0] + kr * u[jj]
                        cute.autovec_copy(r_s[None, 0], vec(p_state, cute.assume(it * DD + r * D + col0, divby=4), 4))
                    else:
                        for jj in cutlass.range_constexpr(4):
                            r_s[jj, i] = dr * r_s[jj, i] + kr * u[jj]
                if cutlass.const_expr(not self.regless):
                    g_dst = cute.make_tensor(p_state + cute.assume(it * DD + warp * D + col0, divby=4),
                                             cute.make_layout((4, 16), stride=(1, 8 * D)))
                    cute.autovec_copy(r_s, g_dst)
                else:
                    # every thread is done with stage st, s_info and s_part: refill the stage, and the next
                    # item's prologue may overwrite the single-buffered s_info / s_red
                    cute.arch.sync_threads()
                    if tid == 0:
                        nf = it + NS * GRID
                        if nf < N:
                            cute.arch.mbarrier_arrive_and_expect_tx(mbar + st, _STATE_BYTES)
                            bulk_load(s_stage.iterator + st * DD, p_state + nf * DD, mbar + st, _STATE_BYTES)

                # ---- output: o = S^T q / sqrt(D), gated RMSNorm (warp 0) -------------------------
                if warp == 0:
                    ss = Float32(0.0)
                    for jj in cutlass.range_constexpr(4):
                        o[jj] = (rq * acc_q[jj] + qk * u[jj]) * scale
                        ss = ss + o[jj] * o[jj]
                    ss = warp_sum(ss)
                    inv = cute.math.rsqrt(ss * (1.0 / D) + self.eps)
                    for jj in cutlass.range_constexpr(4):
                        val = o[jj] * inv * r_onw_raw[jj].to(Float32) * sigmoid(gate_r[jj].to(Float32))
                        r_out[jj] = val.to(p_out.dtype)
                    cute.autovec_copy(r_out, vec(p_out, cute.assume(bb * HD + h * D + col0, divby=4), 4))

    _CLS = KDADecodePersistent
    return KDADecodePersistent


def kda_decode_persistent(qkv, f, b, gate, params, state, conv_state, out, stages: int = 3, ctas: int = 1):
    """Fused KDA decode step, persistent schedule (see the module doc). Same contract as kda_decode:
    updates `state` [B,H,128,128] fp32 and `conv_state` [B,3HD,3] bf16 in place, writes `out`."""
    if (ctas, stages) not in CONFIGS:
        raise ValueError(f"kda cute persistent decode: (ctas, stages) must be one of {CONFIGS} "
                         f"(got ctas={ctas!r}, stages={stages!r})")
    B, H = _validate(qkv, f, b, gate, params, state, conv_state, out, 128, None)
    if state.numel() >= 2**31:
        raise NotImplementedError("kda cute persistent decode: state too large for 32-bit indexing")
    dev = qkv.device
    sms = torch.cuda.get_device_properties(dev).multi_processor_count
    args = _kernel_args(qkv, f, b, gate, params, state, conv_state, out, state, conv_state, None)
    key = ("decode-persistent", ctas, stages, sms, B, H, dev.index) + _params_key(params)
    build = functools.partial(_persistent_class(), B, H, 1, False, False, params.eps, params.lower_bound, 128,
                              sms=sms, stages=stages, ctas=ctas)
    with torch.cuda.device(dev):
        stream = _stream(dev)
        fn = _get_compiled(key, build, args + [stream])
        fn(*args, stream)
    return out
