"""Fused KDA multi-token verify (speculative verification, T = 2..8 positions per sequence) and commit.

`kda_verify` is ONE launch: per (sequence b, head h, value tile of width tile_v) the program first
issues every input load for all T positions (conv-state columns and x_t of its q|k channels as [D, 2]
tiles, of its v channels as 1-D vectors, f_t, b_t, and gate_t when the head is one tile; kept in their
input dtype as tuples, nothing stored before them), then its D x tile_v state tile, then writes
conv_hist[b, t] straight from those registers (exact copies; q/k by the head's first tile only). The
delta-rule recurrence then runs position by position (fully unrolled) with ONE fp32 state tile live:
per position the conv + silu, l2norm of q/k, decay exp(g) and beta are computed in fp32 vectors,
S' = exp(g) S, S'^T k and S'^T q in one pass, u = beta (v - S'^T k), o = (S'^T q + (q.k) u) / sqrt(D),
and S = S' + k u^T is carried to the next position and, at a slot position of the `checkpoint` c (compile-time:
t + 1 a multiple of c, or the last position; c = 1 every position), stored to state_hist[b, t // c].
`state` and `conv_state` are only read. With tile_v == D each position's gated RMSNorm output is written as soon as
it is known (no scratch, no atomics). With tile_v < D every program writes its unnormalized o slices
to an fp32 scratch and the last program of the head to arrive (barrier + acq_rel atomic counter, reset
after use) normalizes and writes out[b, :, h]. Narrow tiles give more programs at small batch
(12 heads, B=1: tile 32 -> 48 programs, tile 4 -> 384). lengths=None compiles the uniform-length
specialization (no length loads or guards); with `lengths` [B] int32 positions >= lengths[b] are not
computed (a runtime guard per unrolled position) and their out/hist entries stay untouched.

`commit` (n_b read on the device, no sync): checkpoint 1, a small gather-copy kernel (two launches, state
then conv state): state[b] = state_hist[b, n_b-1], conv_state[b] = conv_hist[b, n_b-1]. checkpoint c >= 2:
`_kda_replay_kernel` (a slot copy, or the replay of n_b mod c positions from the last slot before n_b - 1, or
from `state` itself, written into `state` in place) then the conv gather.

Floor, B sequences, T positions, H heads of dim D, fp32 state (k3lab.ops.kda.kda_bytes; checkpoint c:
ceil(T / c) states written instead of T):
  state read B*H*D*D*4 + state_hist write B*T*H*D*D*4 + activations B*T*(6HD+H)*2 + conv_hist
  B*T*3HD*3*2.  B=1, T=4, H=12, D=128: 0.79 + 3.15 + 0.06 + 0.03 MB = 4.03 MB -> 0.94 us at
  4.275 TB/s (launch latency and the T-step dependency chain dominate at B=1).
"""
from __future__ import annotations

import math

import triton
import triton.language as tl
from k3lab_kernels.triton.kda_decode import (TILE_V_ALLOWED, _head_tile, _load_cols, _recur, _scratch,
                                            default_num_warps)


@triton.jit
def _conv_silu_at(seq, t: tl.constexpr, w_ptr, ch, W: tl.constexpr):
    """Conv + silu of position t: its window is seq[t .. t+W-1] over the tuple of 1-D (or [D, 2]) vectors
    seq = (conv-state columns oldest first, x_0, x_1, ...). fp32."""
    y = seq[t].to(tl.float32) * tl.load(w_ptr + ch * W).to(tl.float32)
    for j in tl.static_range(1, W):
        y += seq[t + j].to(tl.float32) * tl.load(w_ptr + ch * W + j).to(tl.float32)
    return y / (1.0 + tl.exp(-y))


@triton.jit
def _store_hist(row, seq, t: tl.constexpr, ch, W: tl.constexpr):
    """conv_hist[b, t] = the conv state after position t = seq[t+1 .. t+W-1] (exact input-dtype copies)."""
    for j in tl.static_range(W - 1):
        tl.store(row + ch * (W - 1) + j, seq[t + 1 + j])


@triton.jit
def _position(seq_qk, seq_v, t: tl.constexpr, conv_w, ch_qk, ch_v, W: tl.constexpr, fk, blog, a, dtb, lb, scale, S):
    """Position t of the recurrence on one D x TV state tile S (fp32): conv + silu, l2norm of q/k, decay and
    beta, S' = decay * S, S'^T k and S'^T q in one pass, u = beta (v - S'^T k), o = (S'^T q + (q.k) u) * scale,
    S = S' + k u^T. Returns (S, o). The verify and the commit's replay share it (the same arithmetic)."""
    return _recur(_conv_silu_at(seq_qk, t, conv_w, ch_qk, W), _conv_silu_at(seq_v, t, conv_w, ch_v, W), fk, blog,
                  a, dtb, lb, scale, S)


@triton.jit
def _kda_verify_kernel(
    qkv, f_ptr, b_ptr, gate_ptr, conv_w, A_log, dt_bias, o_norm_w,
    state, conv_state, out, state_hist, conv_hist, scr_o, counter, lengths,
    H, eps, lb, scale,
    T: tl.constexpr, TP: tl.constexpr, D: tl.constexpr, TV: tl.constexpr, NT: tl.constexpr,
    W: tl.constexpr, RAGGED: tl.constexpr, CK: tl.constexpr, NS: tl.constexpr,
):
    vt, bh, h, bi, offs_k, offs_v, v0 = _head_tile(H, D, TV, NT)
    HD = H * D
    C = 3 * HD
    bT = bi.to(tl.int64) * T
    x_base = qkv + bT * C
    cs_row = conv_state + bi.to(tl.int64) * (C * (W - 1))
    hist_base = conv_hist + bT * (C * (W - 1))
    ch_q = h * D + offs_k
    ch_qk = ch_q[:, None] + HD * tl.arange(0, 2)[None, :]  # [D, 2]: column 0 = q, 1 = k channels
    ch_v = 2 * HD + h * D + v0 + offs_v

    # 1. every input load up front (nothing is stored before them): the conv-state columns, then per
    #    position the raw inputs, kept in their input dtype as tuples of 1-D vectors until used
    seq_qk = _load_cols(cs_row, ch_qk, W)
    seq_v = _load_cols(cs_row, ch_v, W)
    fks = ()
    blogs = ()
    gts = ()
    for t in tl.static_range(T):
        seq_qk = seq_qk + (tl.load(x_base + t * C + ch_qk),)
        seq_v = seq_v + (tl.load(x_base + t * C + ch_v),)
        fks = fks + (tl.load(f_ptr + (bT + t) * HD + h * D + offs_k),)
        blogs = blogs + (tl.load(b_ptr + (bT + t) * H + h),)
        if NT == 1:
            gts = gts + (tl.load(gate_ptr + (bT + t) * HD + h * D + offs_v),)
    dtb = tl.load(dt_bias + h * D + offs_k).to(tl.float32)
    a = tl.exp(tl.load(A_log + h).to(tl.float32))
    if NT == 1:
        wn = tl.load(o_norm_w + offs_v).to(tl.float32)
    if RAGGED:
        n = tl.load(lengths + bi)
    else:
        n = T

    # 2. the one D x TV state tile: in flight while conv_hist is written and position 0's prologue runs
    s_off = offs_k[:, None] * D + (v0 + offs_v)[None, :]
    S = tl.load(state + bh.to(tl.int64) * (D * D) + s_off).to(tl.float32)

    # 3. conv_hist straight from registers (q/k by the head's first tile only; v by every tile)
    for t in tl.static_range(T):
        if t < n:
            _store_hist(hist_base + t * (C * (W - 1)), seq_v, t, ch_v, W)
            if vt == 0:
                _store_hist(hist_base + t * (C * (W - 1)), seq_qk, t, ch_qk, W)

    # 4. the recurrence, one position at a time, ONE state tile live (_position); the state after a slot
    #    position (t + 1 a multiple of CK, or the last position: a compile-time set) is stored to
    #    state_hist[b, t // CK]; every position's state is the next one's start state
    for t in tl.static_range(T):
        if t < n:
            S, o = _position(seq_qk, seq_v, t, conv_w, ch_qk, ch_v, W, fks[t], blogs[t], a, dtb, lb, scale, S)
            if (t + 1) % CK == 0 or t == T - 1:
                tl.store(state_hist + ((bi.to(tl.int64) * NS + t // CK) * H + h) * (D * D) + s_off,
                         S.to(state_hist.dtype.element_ty))
            if NT == 1:
                # the whole head is here: normalize and write position t now (no scratch, no atomics)
                r = tl.rsqrt(tl.sum(o * o, axis=0) / D + eps)
                y = o * r * wn / (1.0 + tl.exp(-gts[t].to(tl.float32)))
                tl.store(out + (bT + t) * HD + h * D + offs_v, y.to(out.dtype.element_ty))
            else:
                tl.store(scr_o + (bh.to(tl.int64) * T + t) * D + v0 + offs_v, o)

    if NT > 1:
        tt = tl.arange(0, TP)
        valid_t = tt < n
        tl.debug_barrier()  # every thread's scratch stores happen-before the release below
        arrived = tl.atomic_add(counter + bh, 1, sem="acq_rel")
        if arrived == NT - 1:
            scr_rows = scr_o + (bh.to(tl.int64) * T + tt[:, None]) * D
            oa = tl.load(scr_rows + offs_k[None, :], mask=valid_t[:, None], other=0.0, cache_modifier=".cg")
            wn = tl.load(o_norm_w + offs_k).to(tl.float32)
            gt = tl.load(gate_ptr + (bT + tt)[:, None] * HD + h * D + offs_k[None, :], mask=valid_t[:, None],
                         other=0.0).to(tl.float32)
            r = tl.rsqrt(tl.sum(oa * oa, axis=1) / D + eps)
            y = oa * r[:, None] * wn[None, :] / (1.0 + tl.exp(-gt))
            tl.store(out + (bT + tt)[:, None] * HD + h * D + offs_k[None, :], y.to(out.dtype.element_ty),
                     mask=valid_t[:, None])
            tl.store(counter + bh, 0)


def kda_verify(qkv, f, b, gate, params, state, conv_state, out, state_hist, conv_hist, lengths=None,
               tile_v: int = 8, num_warps=None, checkpoint=None):
    """T positions per sequence from the start state (read only). qkv [B,T,3HD], f/gate [B,T,HD],
    b [B,T,H]; writes out [B,T,HD], state_hist [B,ceil(T/c),H,D,D], conv_hist [B,T,3HD,W-1]; returns out.
    checkpoint c (None = 1): slot s of state_hist holds the state after position min((s+1) c, T) - 1.
    lengths [B] int32 in 1..T (device tensor, not read on the host) or None (uniform T); ragged, a slot
    whose position is >= lengths[b] is left untouched."""
    _launch_verify(qkv, f, b, gate, params, state, conv_state, out, state_hist, conv_hist, lengths, tile_v,
                   num_warps, checkpoint=checkpoint)
    return out


def _launch_verify(qkv, f, b, gate, params, state, conv_state, out, state_hist, conv_hist, lengths, tile_v,
                   num_warps, num_stages=None, checkpoint=None):
    """The launch behind kda_verify; returns Triton's compiled-kernel handle (n_regs / n_spills on a GPU).
    num_stages is exposed for kernels/triton/tune_kda.py only (the position loop is fully unrolled)."""
    B, T = qkv.shape[:2]
    H, D, W = params.heads, params.head_dim, params.conv_kernel
    CK = checkpoint or 1
    NS = -(-T // CK)
    assert D % tile_v == 0 and tile_v in TILE_V_ALLOWED, (D, tile_v)
    assert 1 <= CK <= T and state_hist.shape[1] == NS, (CK, T, tuple(state_hist.shape))
    NT = D // tile_v
    scr_o, counter = _scratch(qkv.device, B * H, D, NT, T) if NT > 1 else (out, out)
    nw = num_warps or default_num_warps(D, tile_v, verify=True)
    opts = {} if num_stages is None else {"num_stages": num_stages}
    return _kda_verify_kernel[(B * H * NT,)](
        qkv, f, b, gate, params.conv_w, params.A_log, params.dt_bias, params.o_norm_w,
        state, conv_state, out, state_hist, conv_hist, scr_o, counter,
        lengths if lengths is not None else out,
        H, float(params.eps), float(params.lower_bound), 1.0 / math.sqrt(D),
        T=T, TP=triton.next_power_of_2(T), D=D, TV=tile_v, NT=NT, W=W, RAGGED=lengths is not None, CK=CK, NS=NS,
        num_warps=nw, **opts,
    )


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


@triton.jit
def _kda_replay_kernel(
    qkv, f_ptr, b_ptr, conv_w, A_log, dt_bias, state, conv_state, state_hist, conv_hist, num_accepted,
    H, lb,
    T: tl.constexpr, CK: tl.constexpr, NS: tl.constexpr, D: tl.constexpr, TV: tl.constexpr, NT: tl.constexpr,
    W: tl.constexpr,
):
    """The checkpointed commit's state, per (sequence b, head h, value tile): n = num_accepted[b] (clamped to
    1..T), p = n - 1. A slot position (n a multiple of CK, or n = T) loads slot (n - 1) // CK and stores it
    into `state`; otherwise the tile starts from slot n // CK - 1 (or, before the first slot, `state` itself),
    its conv window from conv_hist[b, t0 - 1] (or `conv_state`), and runs r = n mod CK positions t0 = (n // CK)
    CK .. p with the verify's own arithmetic (_position), then stores the tile into `state` in place. In place
    is safe: a program owns its D x TV tile (the recurrence never mixes value columns) and loads it whole
    before its one store; `conv_state` is only read here (the conv gather runs after this launch)."""
    vt, bh, h, bi, offs_k, offs_v, v0 = _head_tile(H, D, TV, NT)
    HD = H * D
    C = 3 * HD
    n = tl.minimum(tl.maximum(tl.load(num_accepted + bi).to(tl.int32), 1), T)
    at_slot = ((n % CK) == 0) | (n == T)
    q = n // CK
    slot = tl.where(at_slot, (n - 1) // CK, q - 1)
    t0 = tl.where(at_slot, n, q * CK)
    r = n - t0  # positions to replay: 0 (a copy) .. CK - 1
    s_off = offs_k[:, None] * D + (v0 + offs_v)[None, :]
    if slot >= 0:
        s_src = state_hist + ((bi.to(tl.int64) * NS + slot) * H + h) * (D * D)
    else:
        s_src = state + bh.to(tl.int64) * (D * D)
    S = tl.load(s_src + s_off).to(tl.float32)

    ch_q = h * D + offs_k
    ch_qk = ch_q[:, None] + HD * tl.arange(0, 2)[None, :]  # [D, 2]: column 0 = q, 1 = k channels
    ch_v = 2 * HD + h * D + v0 + offs_v
    if t0 > 0:
        cs_row = conv_hist + (bi.to(tl.int64) * T + t0 - 1) * (C * (W - 1))
    else:
        cs_row = conv_state + bi.to(tl.int64) * (C * (W - 1))
    # the window before t0 and the inputs of the replayed positions, masked off past r (no traffic on a copy)
    live = r > 0
    seq_qk = ()
    seq_v = ()
    for j in tl.static_range(W - 1):
        seq_qk = seq_qk + (tl.load(cs_row + ch_qk * (W - 1) + j, mask=live, other=0.0),)
        seq_v = seq_v + (tl.load(cs_row + ch_v * (W - 1) + j, mask=live, other=0.0),)
    fks = ()
    blogs = ()
    row0 = bi.to(tl.int64) * T + t0
    for t in tl.static_range(CK - 1):
        live = t < r
        seq_qk = seq_qk + (tl.load(qkv + (row0 + t) * C + ch_qk, mask=live, other=0.0),)
        seq_v = seq_v + (tl.load(qkv + (row0 + t) * C + ch_v, mask=live, other=0.0),)
        fks = fks + (tl.load(f_ptr + (row0 + t) * HD + h * D + offs_k, mask=live, other=0.0),)
        blogs = blogs + (tl.load(b_ptr + (row0 + t) * H + h, mask=live, other=0.0),)
    dtb = tl.load(dt_bias + h * D + offs_k).to(tl.float32)
    a = tl.exp(tl.load(A_log + h).to(tl.float32))
    for t in tl.static_range(CK - 1):
        if t < r:
            S, o = _position(seq_qk, seq_v, t, conv_w, ch_qk, ch_v, W, fks[t], blogs[t], a, dtb, lb, 1.0, S)
    tl.store(state + bh.to(tl.int64) * (D * D) + s_off, S.to(state.dtype.element_ty))


def default_commit_tile(B: int, checkpoint: int) -> int:
    """The replay's value tile: the fastest of 8..128 on the H200 at B = 1 / 8 / 16 / 64 and c = 2 / 4 / 8
    (docs/NOTES_kda.md, fourteenth session; profiles/h200/kda_commit_tiles.json.gz, git history at dca2865): 16 at
    batch <= 2, 32 to batch 16, then 64 (c <= 4) or 128 (longer replays). The old fixed 8 was 1.3-2.7x slower from
    batch 8."""
    if B <= 2:
        return 16
    if B <= 16:
        return 32
    return 64 if checkpoint <= 4 else 128


def commit(state_hist, conv_hist, num_accepted, state, conv_state, block: int = 4096, *, checkpoint=None, qkv=None,
           f=None, b=None, params=None, tile_v: int | None = None, num_warps=None):
    """state[b] = the state after position n_b - 1, conv_state[b] = conv_hist[b, n_b - 1]; num_accepted [B] int on
    the device (not read on the host: no sync). checkpoint c = 1 (None): state_hist holds every position, a
    gather (two launches: state, conv state). c >= 2: state_hist holds ceil(T/c) slots (kda_verify); one
    launch of _kda_replay_kernel (a slot copy, or the replay of up to c - 1 positions from the verify's inputs
    qkv, f, b and params), then the conv gather."""
    B, T = conv_hist.shape[:2]
    CK = checkpoint or 1
    if CK == 1:
        srcs = ((state_hist, state), (conv_hist, conv_state))
    else:
        H, D, W = params.heads, params.head_dim, params.conv_kernel
        NS = -(-T // CK)
        tile_v = min(tile_v or default_commit_tile(B, CK), D)
        assert 2 <= CK <= T and state_hist.shape[1] == NS and D % tile_v == 0, (CK, T, tuple(state_hist.shape))
        NT = D // tile_v
        _kda_replay_kernel[(B * H * NT,)](
            qkv, f, b, params.conv_w, params.A_log, params.dt_bias, state, conv_state, state_hist, conv_hist,
            num_accepted, H, float(params.lower_bound), T=T, CK=CK, NS=NS, D=D, TV=tile_v, NT=NT, W=W,
            num_warps=num_warps or default_num_warps(D, tile_v, verify=True))
        srcs = ((conv_hist, conv_state),)
    for src, dst in srcs:
        N = dst[0].numel()
        _gather_rows_kernel[(B, triton.cdiv(N, block))](src, dst, num_accepted, N, src.shape[1], BLOCK=block,
                                                        num_warps=8)
