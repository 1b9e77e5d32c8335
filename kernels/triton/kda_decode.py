"""Fused KDA decode step (T = 1) in ONE Triton launch.

Fuses, per (sequence b, head h, value tile):
  causal depthwise short-conv update of the 3*H*D qkv channels (kernel W = 4; conv_state shifted in
  place) + silu, per-head l2norm of q and k, the decay gate g = lb*sigmoid(exp(A_log[h])*(f+dt_bias)),
  beta = sigmoid(b), the delta-rule update of the state (in place; fp32 state, or bf16 state loaded
  as bf16, computed in fp32, stored as bf16), o = S^T q / sqrt(D), and the gated output RMSNorm
  rms(o; o_norm_w) * sigmoid(gate) written straight into `out` [B, H*D] bf16.

Grid: one program per (b, h, value tile of width tile_v). Each program reads its D x tile_v state tile
once (one coalesced block load), keeps everything in registers and writes it once. With tile_v < D the
per-head RMSNorm needs every tile's o: each program writes its unnormalized o slice to a small fp32
scratch and bumps a per-(b,h) arrival counter (barrier + acq_rel atomic); the last program of a head
normalizes and writes the whole head, writes the head's q/k conv-state shift (every program of the head
must have read the old q/k conv state first, so that write waits for the last arrival), and resets
the counter so the kernel is re-launchable and CUDA-graph capturable. Scratch and counters are
allocated once per (device, B, H, D, tile count) and cached; call once before graph capture.
Concurrent launches of the same shape on different streams would share that scratch: not supported.

Floor (bytes that must move, per call), H heads of dim D, batch B, fp32 state:
  state read + write   B*H*D*D*4*2            (B=1, H=12, D=128: 1.573 MB; B=64: 100.7 MB)
  activations          B*(3HD + HD + H + HD)*2 + conv state r/w B*3HD*3*2*2  (~0.03 MB per B)
  => B=1: ~1.61 MB -> 0.38 us at 4.275 TB/s (launch latency ~2-3 us dominates);
     B=64: ~102.8 MB -> 24.0 us at 4.275 TB/s. bf16 state halves the state term.
"""
from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

TILE_V_ALLOWED = (4, 8, 16, 32, 64, 128)


# ---- shared device helpers (also used by kda_verify) -------------------------------------------

@triton.jit
def _conv_window(x_row, cs_row, ch, j, W: tl.constexpr):
    """Window [N, WP] of pre-conv inputs for channels `ch`: columns 0..W-2 from the conv state (oldest
    first), column W-1 the new input. Columns >= W are zero. Kept in the input dtype (exact)."""
    cs = tl.load(cs_row + ch[:, None] * (W - 1) + j[None, :], mask=j[None, :] < W - 1, other=0.0)
    x = tl.load(x_row + ch)
    return tl.where(j[None, :] == W - 1, x[:, None], cs)


@triton.jit
def _conv_silu(win, w_ptr, ch, j, W: tl.constexpr):
    w = tl.load(w_ptr + ch[:, None] * W + j[None, :], mask=j[None, :] < W, other=0.0)
    y = tl.sum(win.to(tl.float32) * w.to(tl.float32), axis=1)
    return y / (1.0 + tl.exp(-y))


@triton.jit
def _store_conv_shift(cs_row, win, ch, j, W: tl.constexpr):
    """New conv state = window columns 1..W-1 (drop the oldest)."""
    tl.store(cs_row + ch[:, None] * (W - 1) + (j[None, :] - 1), win,
             mask=(j[None, :] >= 1) & (j[None, :] < W))


@triton.jit
def _l2norm(x):
    return x * tl.rsqrt(tl.sum(x * x, axis=0) + 1e-6)


@triton.jit
def _kda_decode_kernel(
    qkv, f_ptr, b_ptr, gate_ptr, conv_w, A_log, dt_bias, o_norm_w,
    state, conv_state, out, scr_o, counter,
    H, eps, lb, scale,
    D: tl.constexpr, TV: tl.constexpr, NT: tl.constexpr, W: tl.constexpr, WP: tl.constexpr,
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
    j = tl.arange(0, WP)

    # the big load first: the whole D x TV state tile, rows contiguous along the value axis
    s_ptrs = state + bh.to(tl.int64) * (D * D) + offs_k[:, None] * D + (v0 + offs_v)[None, :]
    S = tl.load(s_ptrs).to(tl.float32)

    x_row = qkv + bi.to(tl.int64) * C
    cs_row = conv_state + bi.to(tl.int64) * (C * (W - 1))
    ch_q = h * D + offs_k
    ch_k = HD + h * D + offs_k
    ch_v = 2 * HD + h * D + v0 + offs_v
    win_q = _conv_window(x_row, cs_row, ch_q, j, W)
    win_k = _conv_window(x_row, cs_row, ch_k, j, W)
    win_v = _conv_window(x_row, cs_row, ch_v, j, W)
    fk = tl.load(f_ptr + bi.to(tl.int64) * HD + h * D + offs_k).to(tl.float32)
    dtb = tl.load(dt_bias + h * D + offs_k).to(tl.float32)
    a = tl.exp(tl.load(A_log + h).to(tl.float32))
    blog = tl.load(b_ptr + bi.to(tl.int64) * H + h).to(tl.float32)

    q = _l2norm(_conv_silu(win_q, conv_w, ch_q, j, W))
    k = _l2norm(_conv_silu(win_k, conv_w, ch_k, j, W))
    v = _conv_silu(win_v, conv_w, ch_v, j, W)
    g = lb / (1.0 + tl.exp(-(a * (fk + dtb))))
    beta = 1.0 / (1.0 + tl.exp(-blog))

    # delta rule on the decayed state; both reductions read the same decayed tile
    Sd = S * tl.exp(g)[:, None]
    kS = tl.sum(k[:, None] * Sd, axis=0)
    qS = tl.sum(q[:, None] * Sd, axis=0)
    qk = tl.sum(q * k, axis=0)
    u = beta * (v - kS)
    S_new = Sd + k[:, None] * u[None, :]
    tl.store(s_ptrs, S_new.to(state.dtype.element_ty))
    o = (qS + qk * u) * scale
    # this program owns its v channels' conv state
    _store_conv_shift(cs_row, win_v, ch_v, j, W)

    out_row = out + bi.to(tl.int64) * HD + h * D
    gate_row = gate_ptr + bi.to(tl.int64) * HD + h * D
    if NT == 1:
        wn = tl.load(o_norm_w + offs_v).to(tl.float32)
        gt = tl.load(gate_row + offs_v).to(tl.float32)
        r = tl.rsqrt(tl.sum(o * o, axis=0) / D + eps)
        y = o * r * wn / (1.0 + tl.exp(-gt))
        tl.store(out_row + offs_v, y.to(out.dtype.element_ty))
        _store_conv_shift(cs_row, win_q, ch_q, j, W)
        _store_conv_shift(cs_row, win_k, ch_k, j, W)
    else:
        tl.store(scr_o + bh.to(tl.int64) * D + v0 + offs_v, o)
        tl.debug_barrier()  # every thread's scratch store happens-before the release below
        arrived = tl.atomic_add(counter + bh, 1, sem="acq_rel")
        if arrived == NT - 1:
            oa = tl.load(scr_o + bh.to(tl.int64) * D + offs_k, cache_modifier=".cg")
            wn = tl.load(o_norm_w + offs_k).to(tl.float32)
            gt = tl.load(gate_row + offs_k).to(tl.float32)
            r = tl.rsqrt(tl.sum(oa * oa, axis=0) / D + eps)
            y = oa * r * wn / (1.0 + tl.exp(-gt))
            tl.store(out_row + offs_k, y.to(out.dtype.element_ty))
            # all programs of this head have read the old q/k conv state by now
            _store_conv_shift(cs_row, win_q, ch_q, j, W)
            _store_conv_shift(cs_row, win_k, ch_k, j, W)
            tl.store(counter + bh, 0)


# ---- host side -----------------------------------------------------------------------------------

_SCRATCH: dict = {}


def _scratch(device: torch.device, rows: int, D: int, NT: int, T: int = 1):
    """fp32 o scratch [rows*T*D] and int32 arrival counters [rows], allocated once per shape/device."""
    key = (str(device), rows, D, NT, T)
    s = _SCRATCH.get(key)
    if s is None:
        s = (torch.empty(rows * T * D, dtype=torch.float32, device=device),
             torch.zeros(rows, dtype=torch.int32, device=device))
        _SCRATCH[key] = s
    return s


# Measured on the H200 (12 heads, D=128, CUDA-graph replay, 2026-11-30): decode best at
# tile 16 / 2 warps (B=1: 4.98 us back-to-back, 6.0 us as a single-node graph; B=64: 1.93 TB/s fp32)
# and tile 32 / 4 warps (B=64 fp32: 1.96 TB/s); tile 128 / 8 warps spills (255 regs).
_DECODE_WARPS = {4: 2, 8: 2, 16: 2, 32: 4, 64: 4, 128: 8}
# verify (B=1, T=4): tile 8 / 1 warp 9.5 us, tile 16 / 1 warp 11.6 us; B=8, T=4: tile 16 / 1 warp 18.2 us
_VERIFY_WARPS = {4: 1, 8: 1, 16: 1, 32: 4, 64: 4, 128: 8}


def default_num_warps(D: int, tile_v: int, verify: bool = False) -> int:
    """num_warps measured best per value-tile width (D=128); scaled down for smaller heads."""
    nw = (_VERIFY_WARPS if verify else _DECODE_WARPS)[tile_v]
    return max(1, min(nw, (D * tile_v) // 512 or 1))


def kda_decode(qkv, f, b, gate, params, state, conv_state, out, tile_v: int = 128, num_warps=None):
    """One fused decode step. Shapes as k3lab.ref.kda (contiguous; validated by the component API).
    Updates `state` and `conv_state` in place, writes `out` [B, H*D]; returns `out`."""
    B = qkv.shape[0]
    H, D, W = params.heads, params.head_dim, params.conv_kernel
    assert D % tile_v == 0 and tile_v in TILE_V_ALLOWED, (D, tile_v)
    NT = D // tile_v
    scr_o, counter = _scratch(qkv.device, B * H, D, NT) if NT > 1 else (out, out)
    nw = num_warps or default_num_warps(D, tile_v)
    _kda_decode_kernel[(B * H * NT,)](
        qkv, f, b, gate, params.conv_w, params.A_log, params.dt_bias, params.o_norm_w,
        state, conv_state, out, scr_o, counter,
        H, float(params.eps), float(params.lower_bound), 1.0 / math.sqrt(D),
        D=D, TV=tile_v, NT=NT, W=W, WP=triton.next_power_of_2(W), num_warps=nw,
    )
    return out
