"""Fused KDA multi-token verify (speculative verification, T = 2..8 positions per sequence) and commit.

`kda_verify` is ONE launch: per (sequence b, head h, value tile of width tile_v) the program loads its
D x tile_v state tile once and, in a prologue for all T positions at once ([T, D] register tiles, so
every input load is issued before any store), the conv windows over [conv_state, x_0..x_t] + silu,
l2norm of q/k, decay exp(g) and beta (conv_hist[b, t] written there, exact bf16 copies). Then the
delta-rule recurrence runs position by position with the state in registers, writing the state
after every position into state_hist[b, t] (state dtype) and collecting o = S^T q / sqrt(D).
`state` and `conv_state` are only read. The gated output RMSNorm needs all of a head's value tiles:
with tile_v < D every program writes its unnormalized o slices (all positions) to an fp32 scratch and
the last program of the head to arrive (barrier + acq_rel atomic counter, reset after use) normalizes
and writes out[b, :, h]. Narrow tiles give more programs at small batch (12 heads, B=1: tile 32 ->
48 programs, tile 4 -> 384). lengths=None compiles the uniform-length specialization (no length
loads or masks; the position loop is unrolled); with `lengths` [B] int32 positions >= lengths[b]
are not computed and their out/hist entries stay untouched.

`commit` is a small Triton gather-copy kernel (two launches, state then conv state): state[b] =
state_hist[b, n_b-1], conv_state[b] = conv_hist[b, n_b-1], with n_b read on the device (no sync).

Floor, B sequences, T positions, H heads of dim D, fp32 state:
  state read B*H*D*D*4 + state_hist write B*T*H*D*D*4 + activations B*T*(6HD+H)*2 + conv_hist
  B*T*3HD*3*2.  B=1, T=4, H=12, D=128: 0.79 + 3.15 + 0.06 + 0.03 MB = 4.03 MB -> 0.94 us at
  4.275 TB/s (launch latency and the T-step dependency chain dominate at B=1).
"""
from __future__ import annotations

import math

import triton
import triton.language as tl
from k3lab_kernels.triton.kda_decode import TILE_V_ALLOWED, _scratch, default_num_warps


@triton.jit
def _conv_all(x_base, cs_row, ch_row_t, conv_w, ch, tt, valid_t, C, WRITE_HIST, W: tl.constexpr):
    """Conv + silu for every position at once: returns [TP, N] fp32. Position t's window is
    seq[t .. t+W-1] over seq = [conv_state (W-1 values), x_0, x_1, ...]; its last W-1 entries are the
    conv state after t, written to conv_hist[b, t] when WRITE_HIST (exact bf16 copies)."""
    acc = tl.zeros([tt.shape[0], ch.shape[0]], tl.float32)
    for jj in tl.static_range(W):
        i = tt + jj
        from_cs = (i < W - 1)[:, None]
        m = valid_t[:, None]
        cs = tl.load(cs_row + ch[None, :] * (W - 1) + i[:, None], mask=from_cs & m, other=0.0)
        xv = tl.load(x_base + (i[:, None] - (W - 1)) * C + ch[None, :], mask=(~from_cs) & m, other=0.0)
        val = tl.where(from_cs, cs, xv)
        if jj >= 1:
            if WRITE_HIST:
                tl.store(ch_row_t + tt[:, None] * (C * (W - 1)) + ch[None, :] * (W - 1) + (jj - 1), val, mask=m)
        wj = tl.load(conv_w + ch * W + jj).to(tl.float32)
        acc += val.to(tl.float32) * wj[None, :]
    return acc / (1.0 + tl.exp(-acc))


@triton.jit
def _row(x, tt, t):
    """Row t of a [TP, N] register tile (a masked reduction; TP <= 8)."""
    return tl.sum(tl.where(tt[:, None] == t, x, 0.0), axis=0)


@triton.jit
def _kda_verify_kernel(
    qkv, f_ptr, b_ptr, gate_ptr, conv_w, A_log, dt_bias, o_norm_w,
    state, conv_state, out, state_hist, conv_hist, scr_o, counter, lengths,
    H, eps, lb, scale,
    T: tl.constexpr, TP: tl.constexpr, D: tl.constexpr, TV: tl.constexpr, NT: tl.constexpr,
    W: tl.constexpr, RAGGED: tl.constexpr,
):
    pid = tl.program_id(0)
    vt = pid % NT
    bh = pid // NT
    h = bh % H
    bi = bh // H
    HD = H * D
    C = 3 * HD
    offs_k = tl.arange(0, D)
    offs_v = tl.arange(0, TV)
    v0 = vt * TV
    tt = tl.arange(0, TP)
    # the big load first
    S = tl.load(state + bh.to(tl.int64) * (D * D) + offs_k[:, None] * D + (v0 + offs_v)[None, :])
    S = S.to(tl.float32)
    if RAGGED:
        n = tl.load(lengths + bi)
        valid_t = tt < n
    else:
        n = T
        valid_t = tt < T
    # prologue for ALL positions before the recurrence: every input load is issued up front
    x_base = qkv + bi.to(tl.int64) * T * C
    cs_row = conv_state + bi.to(tl.int64) * (C * (W - 1))
    ch_row_t = conv_hist + bi.to(tl.int64) * T * (C * (W - 1))
    ch_q = h * D + offs_k
    ch_k = HD + h * D + offs_k
    ch_v = 2 * HD + h * D + v0 + offs_v
    bt = bi.to(tl.int64) * T + tt  # [TP]
    fk = tl.load(f_ptr + bt[:, None] * HD + h * D + offs_k[None, :], mask=valid_t[:, None], other=0.0)
    blog = tl.load(b_ptr + bt * H + h, mask=valid_t, other=0.0).to(tl.float32)
    dtb = tl.load(dt_bias + h * D + offs_k).to(tl.float32)
    a = tl.exp(tl.load(A_log + h).to(tl.float32))
    q = _conv_all(x_base, cs_row, ch_row_t, conv_w, ch_q, tt, valid_t, C, vt == 0, W)
    k = _conv_all(x_base, cs_row, ch_row_t, conv_w, ch_k, tt, valid_t, C, vt == 0, W)
    v = _conv_all(x_base, cs_row, ch_row_t, conv_w, ch_v, tt, valid_t, C, True, W)
    q = q * tl.rsqrt(tl.sum(q * q, axis=1) + 1e-6)[:, None]
    k = k * tl.rsqrt(tl.sum(k * k, axis=1) + 1e-6)[:, None]
    decay = tl.exp(lb / (1.0 + tl.exp(-(a * (fk.to(tl.float32) + dtb[None, :])))))
    beta = 1.0 / (1.0 + tl.exp(-blog))
    qk = tl.sum(q * k, axis=1)  # [TP]

    o_all = tl.zeros([TP, TV], tl.float32)
    sh_base = state_hist + (bi.to(tl.int64) * T * H + h) * (D * D) + offs_k[:, None] * D + (v0 + offs_v)[None, :]
    if RAGGED:
        for t in range(n):
            S, o_all = _step(t, S, o_all, q, k, v, decay, beta, qk, tt, sh_base, H, scale, D)
    else:
        for t in tl.static_range(T):
            S, o_all = _step(t, S, o_all, q, k, v, decay, beta, qk, tt, sh_base, H, scale, D)

    out_rows = out + bt[:, None] * HD + h * D
    if NT == 1:
        wn = tl.load(o_norm_w + offs_v).to(tl.float32)
        gt = tl.load(gate_ptr + bt[:, None] * HD + h * D + offs_v[None, :], mask=valid_t[:, None],
                     other=0.0).to(tl.float32)
        r = tl.rsqrt(tl.sum(o_all * o_all, axis=1) / D + eps)
        y = o_all * r[:, None] * wn[None, :] / (1.0 + tl.exp(-gt))
        tl.store(out_rows + offs_v[None, :], y.to(out.dtype.element_ty), mask=valid_t[:, None])
    else:
        scr_rows = scr_o + (bh.to(tl.int64) * T + tt[:, None]) * D
        tl.store(scr_rows + v0 + offs_v[None, :], o_all, mask=valid_t[:, None])
        tl.debug_barrier()  # every thread's scratch stores happen-before the release below
        arrived = tl.atomic_add(counter + bh, 1, sem="acq_rel")
        if arrived == NT - 1:
            oa = tl.load(scr_rows + offs_k[None, :], mask=valid_t[:, None], other=0.0, cache_modifier=".cg")
            wn = tl.load(o_norm_w + offs_k).to(tl.float32)
            gt = tl.load(gate_ptr + bt[:, None] * HD + h * D + offs_k[None, :], mask=valid_t[:, None],
                         other=0.0).to(tl.float32)
            r = tl.rsqrt(tl.sum(oa * oa, axis=1) / D + eps)
            y = oa * r[:, None] * wn[None, :] / (1.0 + tl.exp(-gt))
            tl.store(out_rows + offs_k[None, :], y.to(out.dtype.element_ty), mask=valid_t[:, None])
            tl.store(counter + bh, 0)


@triton.jit
def _step(t, S, o_all, q, k, v, decay, beta, qk, tt, sh_base, H, scale, D: tl.constexpr):
    q_t = _row(q, tt, t)
    k_t = _row(k, tt, t)
    v_t = _row(v, tt, t)
    d_t = _row(decay, tt, t)
    beta_t = tl.sum(tl.where(tt == t, beta, 0.0), axis=0)
    qk_t = tl.sum(tl.where(tt == t, qk, 0.0), axis=0)
    Sd = S * d_t[:, None]
    kS = tl.sum(k_t[:, None] * Sd, axis=0)
    qS = tl.sum(q_t[:, None] * Sd, axis=0)
    u = beta_t * (v_t - kS)
    S = Sd + k_t[:, None] * u[None, :]
    o = (qS + qk_t * u) * scale
    tl.store(sh_base + t * (H * D * D), S.to(sh_base.dtype.element_ty))
    o_all = tl.where(tt[:, None] == t, o[None, :], o_all)
    return S, o_all


def kda_verify(qkv, f, b, gate, params, state, conv_state, out, state_hist, conv_hist, lengths=None,
               tile_v: int = 8, num_warps=None):
    """T positions per sequence from the start state (read only). qkv [B,T,3HD], f/gate [B,T,HD],
    b [B,T,H]; writes out [B,T,HD], state_hist [B,T,H,D,D], conv_hist [B,T,3HD,W-1]; returns out.
    lengths [B] int32 in 1..T (device tensor, not read on the host) or None (uniform T)."""
    B, T = qkv.shape[:2]
    H, D, W = params.heads, params.head_dim, params.conv_kernel
    assert D % tile_v == 0 and tile_v in TILE_V_ALLOWED, (D, tile_v)
    NT = D // tile_v
    scr_o, counter = _scratch(qkv.device, B * H, D, NT, T) if NT > 1 else (out, out)
    nw = num_warps or default_num_warps(D, tile_v, verify=True)
    _kda_verify_kernel[(B * H * NT,)](
        qkv, f, b, gate, params.conv_w, params.A_log, params.dt_bias, params.o_norm_w,
        state, conv_state, out, state_hist, conv_hist, scr_o, counter,
        lengths if lengths is not None else out,
        H, float(params.eps), float(params.lower_bound), 1.0 / math.sqrt(D),
        T=T, TP=triton.next_power_of_2(T), D=D, TV=tile_v, NT=NT, W=W, RAGGED=lengths is not None,
        num_warps=nw,
    )
    return out


# ---- commit ----------------------------------------------------------------------------------------

@triton.jit
def _gather_rows_kernel(src, dst, num_accepted, N, T, BLOCK: tl.constexpr):
    """dst[b, :] = src[b, n_b - 1, :] for rows of N elements; n_b clamped to 1..T (validated on host)."""
    bi = tl.program_id(0)
    blk = tl.program_id(1)
    n = tl.load(num_accepted + bi).to(tl.int64)
    n = tl.minimum(tl.maximum(n, 1), T)
    offs = blk * BLOCK + tl.arange(0, BLOCK)
    m = offs < N
    x = tl.load(src + (bi.to(tl.int64) * T + n - 1) * N + offs, mask=m)
    tl.store(dst + bi.to(tl.int64) * N + offs, x, mask=m)


def commit(state_hist, conv_hist, num_accepted, state, conv_state, block: int = 4096):
    """state[b] = state_hist[b, n_b-1]; conv_state[b] = conv_hist[b, n_b-1] (Triton, 2 launches)."""
    B, T = state_hist.shape[:2]
    for src, dst in ((state_hist, state), (conv_hist, conv_state)):
        N = dst[0].numel()
        _gather_rows_kernel[(B, triton.cdiv(N, block))](src, dst, num_accepted, N, T, BLOCK=block,
                                                        num_warps=8)
