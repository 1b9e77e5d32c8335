"""KDA chunked prefill (chunk 64 by default), following `kda_prefill_chunked` in k3lab.ref.kda.

Launches (correctness over speed; this path is for numerics studies and for filling states):
  1. prep   (b, h, chunk): causal conv over [conv_state, x] + silu, l2norm q/k, gate g, beta; the
            in-chunk cumulative log-decay G = cumsum(g). Padded positions (past L) get q=k=v=g=beta=0,
            which is exactly neutral. Writes fp32 q, k, v, G [B,H,Lp,D], beta [B,H,Lp].
  2. intra  (b, h, chunk): A_ts = beta_t sum_d k_t k_s exp(G_t - G_s) (s < t), Aqk_ts = sum_d q_t k_s
            exp(G_t - G_s) (s <= t), both column by column with exp arguments clamped <= 0 (never
            exp(-G) over a chunk); the 64x64 unit lower-triangular inverse T = (I+A)^-1 by forward
            substitution in fp32 (inverse="bf16": A rounded to bf16 first); W = T diag(beta)(k e^G),
            U0 = T diag(beta) v (fp32 dots, input_precision="ieee").
  3a. grouped=False, seq (b, h, value tile): chunks in order carrying S in registers:
            u = U0 - W S0; o = scale (q e^G) S0 + scale Aqk u; S = e^{G_C} S0 + (k e^{G_C-G})^T u.
  3b. grouped=True: summ (b, h, chunk, value tile) M = diag(e^{G_C}) - (k e^{G_C-G})^T W,
            N = (k e^{G_C-G})^T U0; scan (b, h, value tile): ordered S_{c+1} = M_c S_c + N_c, saving
            every chunk's start state; out (b, h, chunk, value tile) all chunks in parallel.
  4. norm   (b*l, h): rms(o; o_norm_w) * sigmoid(gate) -> out [B,L,HD] bf16.
  5. conv tail (b): conv_state <- the last W-1 entries of [conv_state, x] (after prep read it).
The final state is written into `state` (its dtype) in place.

Floor (bytes, not time-critical): qkv/f/gate/out 7*L*HD*2 per sequence + state read/write; the
intermediates (q,k,v,G,W,U0 fp32, 6*L*HD*4, and 64x64 Aqk per chunk) are a correctness-first choice,
about 4x the input bytes. At B=1, L=4096, H=12, D=128: ~88 MB of traffic -> ~21 us at 4.275 TB/s.
"""
from __future__ import annotations

import math

import torch
import triton
import triton.language as tl


@triton.jit
def _prep_kernel(qkv, f_ptr, b_ptr, conv_w, A_log, dt_bias, conv_state,
                 q_o, k_o, v_o, G_o, beta_o, H, L, Lp, lb,
                 CH: tl.constexpr, D: tl.constexpr, W: tl.constexpr):
    bh = tl.program_id(0)
    c = tl.program_id(1)
    h = bh % H
    bi = bh // H
    HD = H * D
    C = 3 * HD
    p = c * CH + tl.arange(0, CH)  # positions
    valid = p < L
    d = tl.arange(0, D)
    x_base = qkv + bi.to(tl.int64) * L * C
    cs_row = conv_state + bi.to(tl.int64) * C * (W - 1)
    accq = tl.zeros([CH, D], tl.float32)
    acck = tl.zeros([CH, D], tl.float32)
    accv = tl.zeros([CH, D], tl.float32)
    for jj in tl.static_range(W):
        i = p + jj  # index into seq = [conv_state, x_0 .. x_{L-1}]
        from_cs = i < W - 1
        for which in tl.static_range(3):
            ch = which * HD + h * D + d
            cs = tl.load(cs_row + ch[None, :] * (W - 1) + i[:, None], mask=from_cs[:, None] & valid[:, None],
                         other=0.0)
            xv = tl.load(x_base + (i[:, None] - (W - 1)) * C + ch[None, :],
                         mask=(~from_cs[:, None]) & valid[:, None], other=0.0)
            val = tl.where(from_cs[:, None], cs, xv).to(tl.float32)
            wj = tl.load(conv_w + ch * W + jj).to(tl.float32)
            if which == 0:
                accq += val * wj[None, :]
            elif which == 1:
                acck += val * wj[None, :]
            else:
                accv += val * wj[None, :]
    q = accq / (1.0 + tl.exp(-accq))
    k = acck / (1.0 + tl.exp(-acck))
    v = accv / (1.0 + tl.exp(-accv))
    q = q * tl.rsqrt(tl.sum(q * q, axis=1) + 1e-6)[:, None]
    k = k * tl.rsqrt(tl.sum(k * k, axis=1) + 1e-6)[:, None]
    fk = tl.load(f_ptr + (bi.to(tl.int64) * L + p[:, None]) * HD + h * D + d[None, :], mask=valid[:, None],
                 other=0.0).to(tl.float32)
    dtb = tl.load(dt_bias + h * D + d).to(tl.float32)
    a = tl.exp(tl.load(A_log + h).to(tl.float32))
    g = lb / (1.0 + tl.exp(-(a * (fk + dtb[None, :]))))
    g = tl.where(valid[:, None], g, 0.0)
    G = tl.cumsum(g, axis=0)
    bl = tl.load(b_ptr + (bi.to(tl.int64) * L + p) * H + h, mask=valid, other=0.0).to(tl.float32)
    beta = tl.where(valid, 1.0 / (1.0 + tl.exp(-bl)), 0.0)
    q = tl.where(valid[:, None], q, 0.0)
    k = tl.where(valid[:, None], k, 0.0)
    v = tl.where(valid[:, None], v, 0.0)
    row = (bh.to(tl.int64) * Lp + p[:, None]) * D + d[None, :]
    tl.store(q_o + row, q)
    tl.store(k_o + row, k)
    tl.store(v_o + row, v)
    tl.store(G_o + row, G)
    tl.store(beta_o + bh.to(tl.int64) * Lp + p, beta)


@triton.jit
def _intra_kernel(q_i, k_i, v_i, G_i, beta_i, W_o, U0_o, Aqk_o, Lp, NC,
                  CH: tl.constexpr, D: tl.constexpr, BF16_INV: tl.constexpr):
    bh = tl.program_id(0)
    c = tl.program_id(1)
    t = tl.arange(0, CH)
    d = tl.arange(0, D)
    base = (bh.to(tl.int64) * Lp + c * CH) * D
    tile = base + t[:, None] * D + d[None, :]
    q = tl.load(q_i + tile)
    k = tl.load(k_i + tile)
    v = tl.load(v_i + tile)
    G = tl.load(G_i + tile)
    beta = tl.load(beta_i + bh.to(tl.int64) * Lp + c * CH + t)
    A = tl.zeros([CH, CH], tl.float32)
    Aqk = tl.zeros([CH, CH], tl.float32)
    for s in range(CH):
        ks = tl.load(k_i + base + s * D + d)
        Gs = tl.load(G_i + base + s * D + d)
        E = tl.exp(tl.minimum(G - Gs[None, :], 0.0))  # exp(G_t - G_s) for t >= s, never > 1
        kE = ks[None, :] * E
        col_a = tl.where(t > s, beta * tl.sum(k * kE, axis=1), 0.0)
        col_q = tl.where(t >= s, tl.sum(q * kE, axis=1), 0.0)
        sel = t[None, :] == s
        A = tl.where(sel, col_a[:, None], A)
        Aqk = tl.where(sel, col_q[:, None], Aqk)
    if BF16_INV:
        A = A.to(tl.bfloat16).to(tl.float32)
    # forward substitution: rows of X = (I + A)^-1, X_i = e_i - sum_{s<i} A_is X_s
    X = tl.zeros([CH, CH], tl.float32)
    for i in range(CH):
        a_i = tl.sum(tl.where(t[:, None] == i, A, 0.0), axis=0)  # row i of A, over columns
        x_i = tl.where(t == i, 1.0, 0.0) - tl.sum(a_i[:, None] * X, axis=0)
        X = tl.where(t[:, None] == i, x_i[None, :], X)
    Wm = tl.dot(X, beta[:, None] * k * tl.exp(G), input_precision="ieee")
    U0 = tl.dot(X, beta[:, None] * v, input_precision="ieee")
    tl.store(W_o + tile, Wm)
    tl.store(U0_o + tile, U0)
    tl.store(Aqk_o + (bh.to(tl.int64) * NC + c) * CH * CH + t[:, None] * CH + t[None, :], Aqk)


@triton.jit
def _chunk_out(S0, c, bh, q_i, k_i, G_i, W_i, U0_i, Aqk_i, o_buf, vt, H, L, Lp, NC, scale,
               CH: tl.constexpr, D: tl.constexpr, TV: tl.constexpr):
    """Outputs of chunk c for one value tile from start state S0 [D, TV]; returns the end state."""
    t = tl.arange(0, CH)
    d = tl.arange(0, D)
    dv = vt * TV + tl.arange(0, TV)
    base = (bh.to(tl.int64) * Lp + c * CH) * D
    tile = base + t[:, None] * D + d[None, :]
    q = tl.load(q_i + tile)
    k = tl.load(k_i + tile)
    G = tl.load(G_i + tile)
    Wm = tl.load(W_i + tile)
    U0 = tl.load(U0_i + base + t[:, None] * D + dv[None, :])
    Aqk = tl.load(Aqk_i + (bh.to(tl.int64) * NC + c) * CH * CH + t[:, None] * CH + t[None, :])
    GC = tl.load(G_i + base + (CH - 1) * D + d)
    u = U0 - tl.dot(Wm, S0, input_precision="ieee")
    o = scale * (tl.dot(q * tl.exp(G), S0, input_precision="ieee") + tl.dot(Aqk, u, input_precision="ieee"))
    h = bh % H
    bi = bh // H
    p = c * CH + t
    optr = o_buf + ((bi.to(tl.int64) * L + p[:, None]) * H + h) * D + dv[None, :]
    tl.store(optr, o, mask=(p < L)[:, None])
    Kd = k * tl.exp(tl.minimum(GC[None, :] - G, 0.0))
    S = tl.exp(GC)[:, None] * S0 + tl.dot(tl.trans(Kd), u, input_precision="ieee")
    return S


@triton.jit
def _seq_kernel(state, q_i, k_i, G_i, W_i, U0_i, Aqk_i, o_buf, H, L, Lp, NC, scale,
                CH: tl.constexpr, D: tl.constexpr, TV: tl.constexpr, NT: tl.constexpr):
    pid = tl.program_id(0)
    vt = pid % NT
    bh = pid // NT
    d = tl.arange(0, D)
    dv = vt * TV + tl.arange(0, TV)
    sp = state + bh.to(tl.int64) * D * D + d[:, None] * D + dv[None, :]
    S = tl.load(sp).to(tl.float32)
    for c in range(NC):
        S = _chunk_out(S, c, bh, q_i, k_i, G_i, W_i, U0_i, Aqk_i, o_buf, vt, H, L, Lp, NC, scale, CH, D, TV)
    tl.store(sp, S.to(state.dtype.element_ty))


@triton.jit
def _summary_kernel(k_i, G_i, W_i, U0_i, M_o, N_o, Lp, NC,
                    CH: tl.constexpr, D: tl.constexpr, TV: tl.constexpr, NT: tl.constexpr):
    pid = tl.program_id(0)
    c = tl.program_id(1)
    vt = pid % NT
    bh = pid // NT
    t = tl.arange(0, CH)
    d = tl.arange(0, D)
    dv = vt * TV + tl.arange(0, TV)
    base = (bh.to(tl.int64) * Lp + c * CH) * D
    k = tl.load(k_i + base + t[:, None] * D + d[None, :])
    G = tl.load(G_i + base + t[:, None] * D + d[None, :])
    Wt = tl.load(W_i + base + t[:, None] * D + dv[None, :])
    U0 = tl.load(U0_i + base + t[:, None] * D + dv[None, :])
    GC = tl.load(G_i + base + (CH - 1) * D + d)
    KdT = tl.trans(k * tl.exp(tl.minimum(GC[None, :] - G, 0.0)))  # [D, CH]
    diag = tl.where(d[:, None] == dv[None, :], tl.exp(GC)[:, None], 0.0)
    M = diag - tl.dot(KdT, Wt, input_precision="ieee")
    N = tl.dot(KdT, U0, input_precision="ieee")
    mo = (bh.to(tl.int64) * NC + c) * D * D + d[:, None] * D + dv[None, :]
    tl.store(M_o + mo, M)
    tl.store(N_o + mo, N)


@triton.jit
def _scan_kernel(state, M_i, N_i, starts, NC, D: tl.constexpr, TV: tl.constexpr, NT: tl.constexpr):
    pid = tl.program_id(0)
    vt = pid % NT
    bh = pid // NT
    d = tl.arange(0, D)
    dv = vt * TV + tl.arange(0, TV)
    sp = state + bh.to(tl.int64) * D * D + d[:, None] * D + dv[None, :]
    S = tl.load(sp).to(tl.float32)
    for c in range(NC):
        off = (bh.to(tl.int64) * NC + c) * D * D
        tl.store(starts + off + d[:, None] * D + dv[None, :], S)
        M = tl.load(M_i + off + d[:, None] * D + d[None, :])
        N = tl.load(N_i + off + d[:, None] * D + dv[None, :])
        S = tl.dot(M, S, input_precision="ieee") + N
    tl.store(sp, S.to(state.dtype.element_ty))


@triton.jit
def _grouped_out_kernel(starts, q_i, k_i, G_i, W_i, U0_i, Aqk_i, o_buf, H, L, Lp, NC, scale,
                        CH: tl.constexpr, D: tl.constexpr, TV: tl.constexpr, NT: tl.constexpr):
    pid = tl.program_id(0)
    c = tl.program_id(1)
    vt = pid % NT
    bh = pid // NT
    d = tl.arange(0, D)
    dv = vt * TV + tl.arange(0, TV)
    S0 = tl.load(starts + (bh.to(tl.int64) * NC + c) * D * D + d[:, None] * D + dv[None, :])
    _chunk_out(S0, c, bh, q_i, k_i, G_i, W_i, U0_i, Aqk_i, o_buf, vt, H, L, Lp, NC, scale, CH, D, TV)


@triton.jit
def _norm_kernel(o_buf, gate_ptr, o_norm_w, out, H, eps, D: tl.constexpr):
    bl = tl.program_id(0)
    h = tl.program_id(1)
    d = tl.arange(0, D)
    off = (bl.to(tl.int64) * H + h) * D + d
    o = tl.load(o_buf + off)
    wn = tl.load(o_norm_w + d).to(tl.float32)
    gt = tl.load(gate_ptr + off).to(tl.float32)
    r = tl.rsqrt(tl.sum(o * o, axis=0) / D + eps)
    tl.store(out + off, (o * r * wn / (1.0 + tl.exp(-gt))).to(out.dtype.element_ty))


@triton.jit
def _conv_tail_kernel(qkv, conv_state, C, L, W: tl.constexpr, WP: tl.constexpr, BLOCK: tl.constexpr):
    """conv_state[b, ch, j] = seq[L + j], seq = [conv_state[b, ch, :], x_0 .. x_{L-1}]."""
    bi = tl.program_id(0)
    blk = tl.program_id(1)
    ch = blk * BLOCK + tl.arange(0, BLOCK)
    jj = tl.arange(0, WP)
    m = (ch < C)[:, None] & (jj < W - 1)[None, :]
    cs_row = conv_state + bi.to(tl.int64) * C * (W - 1)
    x_base = qkv + bi.to(tl.int64) * L * C
    i = L + jj
    from_cs = (i < W - 1)[None, :]
    cs = tl.load(cs_row + ch[:, None] * (W - 1) + i[None, :], mask=m & from_cs, other=0.0)
    xv = tl.load(x_base + (i[None, :] - (W - 1)) * C + ch[:, None], mask=m & (~from_cs), other=0.0)
    val = tl.where(from_cs, cs, xv)
    tl.debug_barrier()  # every read of the old state (L < W-1 reads it) before any write
    tl.store(cs_row + ch[:, None] * (W - 1) + jj[None, :], val, mask=m)


def kda_prefill(qkv, f, b, gate, params, state, conv_state, out, chunk: int = 64, inverse: str = "fp32",
                grouped: bool = False, tile_v: int = 32):
    """Chunked prefill of L positions per sequence. qkv [B,L,3HD], f/gate [B,L,HD], b [B,L,H].
    Writes out [B,L,HD]; updates state [B,H,D,D] and conv_state [B,3HD,W-1] in place; returns out."""
    B, L = qkv.shape[:2]
    H, D, W = params.heads, params.head_dim, params.conv_kernel
    assert chunk in (16, 32, 64) and inverse in ("fp32", "bf16")
    CH = chunk
    NC = triton.cdiv(L, CH)
    Lp = NC * CH
    TV = min(tile_v, D)
    assert TV >= 16 and D % TV == 0, "prefill value tiles must be >= 16 (tl.dot) and divide D"
    NT = D // TV
    dev = qkv.device
    f32 = dict(dtype=torch.float32, device=dev)
    q_b, k_b, v_b, G_b = (torch.empty(B * H * Lp * D, **f32) for _ in range(4))
    beta_b = torch.empty(B * H * Lp, **f32)
    _prep_kernel[(B * H, NC)](qkv, f, b, params.conv_w, params.A_log, params.dt_bias, conv_state,
                              q_b, k_b, v_b, G_b, beta_b, H, L, Lp, float(params.lower_bound),
                              CH=CH, D=D, W=W, num_warps=4, num_stages=1)
    W_b, U0_b = torch.empty(B * H * Lp * D, **f32), torch.empty(B * H * Lp * D, **f32)
    Aqk_b = torch.empty(B * H * NC * CH * CH, **f32)
    _intra_kernel[(B * H, NC)](q_b, k_b, v_b, G_b, beta_b, W_b, U0_b, Aqk_b, Lp, NC,
                               CH=CH, D=D, BF16_INV=(inverse == "bf16"), num_warps=4, num_stages=1)
    o_buf = torch.empty(B * L * H * D, **f32)
    scale = 1.0 / math.sqrt(D)
    if not grouped:
        _seq_kernel[(B * H * NT,)](state, q_b, k_b, G_b, W_b, U0_b, Aqk_b, o_buf, H, L, Lp, NC, scale,
                                   CH=CH, D=D, TV=TV, NT=NT, num_warps=4, num_stages=1)
    else:
        M_b, N_b, st_b = (torch.empty(B * H * NC * D * D, **f32) for _ in range(3))
        _summary_kernel[(B * H * NT, NC)](k_b, G_b, W_b, U0_b, M_b, N_b, Lp, NC, CH=CH, D=D, TV=TV, NT=NT,
                                          num_warps=4, num_stages=1)
        _scan_kernel[(B * H * NT,)](state, M_b, N_b, st_b, NC, D=D, TV=TV, NT=NT, num_warps=8, num_stages=1)
        _grouped_out_kernel[(B * H * NT, NC)](st_b, q_b, k_b, G_b, W_b, U0_b, Aqk_b, o_buf, H, L, Lp, NC,
                                              scale, CH=CH, D=D, TV=TV, NT=NT, num_warps=4, num_stages=1)
    _norm_kernel[(B * L, H)](o_buf, gate, params.o_norm_w, out, H, float(params.eps), D=D, num_warps=1)
    C = 3 * H * D
    _conv_tail_kernel[(B, triton.cdiv(C, 1024))](qkv, conv_state, C, L, W=W, WP=triton.next_power_of_2(W),
                                                  BLOCK=1024, num_warps=4, num_stages=1)
    return out
