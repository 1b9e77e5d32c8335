"""Fused KDA decode step (T = 1) in ONE Triton launch.

Fuses, per (sequence b, head h, value tile):
  causal depthwise short-conv update of the 3*H*D qkv channels (kernel W = 4; conv_state shifted in
  place) + silu, per-head l2norm of q and k, the decay gate g = lb*sigmoid(exp(A_log[h])*(f+dt_bias)),
  beta = sigmoid(b), the delta-rule update of the state (in place; fp32 state, or bf16 state loaded
  as bf16, computed in fp32, stored as bf16), o = S^T q / sqrt(D), and the gated output RMSNorm
  rms(o; o_norm_w) * sigmoid(gate) written straight into `out` [B, H*D] bf16.

Grid: one program per (b, h, value tile of width tile_v). Each program first issues every small input
load (the W-1 conv-state columns and the new input of its q|k channels as [D, 2] tiles -- column 0 = q,
1 = k -- and of its v channels as 1-D vectors; f, dt_bias, A_log, b; gate and norm weight when the head
is one tile), then its D x tile_v state tile (one coalesced block load) so the prologue runs while the
state is in flight. Only ONE D x tile_v fp32 tile is live: S' = exp(g) S; S'^T k and S'^T q are two
reductions over S'; u = beta (v - S'^T k); o = (S'^T q + (q.k) u) / sqrt(D) (= S''^T q); S'' = S' + k u^T
is stored straight back. The conv-state columns a program owns are shifted in place only after the
last use of its windows (never earlier: see step 5 in the kernel). With tile_v == D the program
normalizes and writes out itself: no scratch, no atomics. With tile_v < D the per-head RMSNorm needs
every tile's o: each program writes its unnormalized o slice to a small fp32 scratch and bumps a
per-(b,h) arrival counter (barrier + acq_rel atomic); the last program of a head re-reads the scratch,
normalizes and writes the whole head, shifts the head's q/k conv state (every program of the head must
have read the old one first; it re-loads those inputs from L2 in the same round trip as the scratch
instead of keeping them in registers), and resets the counter so the kernel is re-launchable and
CUDA-graph capturable. Scratch and counters are allocated once per (device, B, H, D, tile count) and
cached; call once before graph capture. Concurrent launches of the same shape on different streams
would share that scratch: not supported.

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

from k3lab_kernels.triton.pdl import chain_pdl, launch_kw, pdl_enter

TILE_V_ALLOWED = (4, 8, 16, 32, 64, 128)


# ---- shared device helpers (also used by kda_verify) -------------------------------------------

@triton.jit
def _load_cols(cs_row, ch, W: tl.constexpr):
    """The W-1 conv-state columns of channels `ch` (oldest first) as a tuple of vectors (ch 1-D, or the
    [D, 2] q|k channel tile), input dtype.
    Separate 1-D loads instead of one [N, W] tile: no padded column, no select, and each vector stays in
    a 1-D layout (about N / threads registers) until it is consumed."""
    cols = ()
    for j in tl.static_range(W - 1):
        cols = cols + (tl.load(cs_row + ch * (W - 1) + j),)
    return cols


@triton.jit
def _conv_silu(win, w_ptr, ch, W: tl.constexpr):
    """silu(sum_j win[j] * conv_w[ch, j]) in fp32; `win` is a tuple of W 1-D vectors (oldest first)."""
    y = win[0].to(tl.float32) * tl.load(w_ptr + ch * W).to(tl.float32)
    for j in tl.static_range(1, W):
        y += win[j].to(tl.float32) * tl.load(w_ptr + ch * W + j).to(tl.float32)
    return y / (1.0 + tl.exp(-y))


@triton.jit
def _store_cols(cs_row, win, ch, W: tl.constexpr):
    """Conv state after the step = window entries 1..W-1 (the oldest dropped); `win` holds W vectors."""
    for j in tl.static_range(W - 1):
        tl.store(cs_row + ch * (W - 1) + j, win[j + 1])


@triton.jit
def _recur(qk2, v, fk, blog, a, dtb, lb, scale, S):
    """One position on a D x TV state tile S (fp32), from the conv + silu outputs qk2 [D, 2] (q | k) and v [TV]:
    l2norm of q and k, decay = exp(lb sigmoid(a (f + dt_bias))), beta = sigmoid(b); S' = decay * S, S'^T k and
    S'^T q in one pass over S', u = beta (v - S'^T k), o = (S'^T q + (q.k) u) * scale [= S''^T q * scale],
    S'' = S' + k u^T. Returns (S'', o). The decode, the verify and the commit's replay share it."""
    qk2 = qk2 * tl.rsqrt(tl.sum(qk2 * qk2, axis=0) + 1e-6)[None, :]
    q, k = tl.split(qk2)
    decay = tl.exp(lb / (1.0 + tl.exp(-(a * (fk.to(tl.float32) + dtb)))))
    beta = 1.0 / (1.0 + tl.exp(-blog.to(tl.float32)))
    qk = tl.sum(q * k, axis=0)
    S = S * decay[:, None]
    kS = tl.sum(S * k[:, None], axis=0)
    qS = tl.sum(S * q[:, None], axis=0)
    u = beta * (v - kS)
    o = (qS + qk * u) * scale
    S = S + k[:, None] * u[None, :]
    return S, o


@triton.jit
def _head_tile(H, D: tl.constexpr, TV: tl.constexpr, NT: tl.constexpr):
    """Program -> (value tile vt, row bh = bi * H + h, head h, sequence bi, key rows, the tile's value columns,
    its first column v0): NT value tiles of TV columns a head, the decode / verify / replay grids' order."""
    pid = tl.program_id(0)
    vt = pid % NT
    bh = pid // NT
    return vt, bh, bh % H, bh // H, tl.arange(0, D), tl.arange(0, TV), vt * TV


@triton.jit
def _kda_decode_kernel(
    qkv, f_ptr, b_ptr, gate_ptr, conv_w, A_log, dt_bias, o_norm_w,
    state, conv_state, out, scr_o, counter,
    H, eps, lb, scale,
    D: tl.constexpr, TV: tl.constexpr, NT: tl.constexpr, W: tl.constexpr, PDL: tl.constexpr,
):
    vt, bh, h, bi, offs_k, offs_v, v0 = _head_tile(H, D, TV, NT)
    HD = H * D
    C = 3 * HD
    x_row = qkv + bi.to(tl.int64) * C
    cs_row = conv_state + bi.to(tl.int64) * (C * (W - 1))
    out_row = out + bi.to(tl.int64) * HD + h * D
    gate_row = gate_ptr + bi.to(tl.int64) * HD + h * D
    ch_q = h * D + offs_k
    ch_k = HD + h * D + offs_k
    ch_v = 2 * HD + h * D + v0 + offs_v

    # 1. every small input load first (all independent): conv windows as 1-D vectors, gate inputs
    # q and k channels side by side as one [D, 2] tile (column 0 = q, 1 = k)
    ch_qk = ch_q[:, None] + HD * tl.arange(0, 2)[None, :]
    s_ptrs = state + bh.to(tl.int64) * (D * D) + offs_k[:, None] * D + (v0 + offs_v)[None, :]
    if PDL:  # launched with PDL: the state, the conv windows and the parameters (no kernel before writes them:
        # the caller's precondition) before the wait, the activations after it
        S = tl.load(s_ptrs).to(tl.float32)
        cw_qk = _load_cols(cs_row, ch_qk, W)
        cw_v = _load_cols(cs_row, ch_v, W)
        dtb = tl.load(dt_bias + h * D + offs_k).to(tl.float32)
        a = tl.exp(tl.load(A_log + h).to(tl.float32))
        if NT == 1:
            wn = tl.load(o_norm_w + offs_v).to(tl.float32)
        pdl_enter(PDL)
        win_qk = cw_qk + (tl.load(x_row + ch_qk),)
        win_v = cw_v + (tl.load(x_row + ch_v),)
        fk = tl.load(f_ptr + bi.to(tl.int64) * HD + h * D + offs_k).to(tl.float32)
        blog = tl.load(b_ptr + bi.to(tl.int64) * H + h).to(tl.float32)
        if NT == 1:
            gt = tl.load(gate_row + offs_v).to(tl.float32)
    else:
        win_qk = _load_cols(cs_row, ch_qk, W) + (tl.load(x_row + ch_qk),)
        win_v = _load_cols(cs_row, ch_v, W) + (tl.load(x_row + ch_v),)
        fk = tl.load(f_ptr + bi.to(tl.int64) * HD + h * D + offs_k).to(tl.float32)
        dtb = tl.load(dt_bias + h * D + offs_k).to(tl.float32)
        a = tl.exp(tl.load(A_log + h).to(tl.float32))
        blog = tl.load(b_ptr + bi.to(tl.int64) * H + h).to(tl.float32)
        if NT == 1:
            wn = tl.load(o_norm_w + offs_v).to(tl.float32)
            gt = tl.load(gate_row + offs_v).to(tl.float32)

        # 2. the one D x TV state tile (rows contiguous along the value axis): in flight during the prologue
        S = tl.load(s_ptrs).to(tl.float32)

    # 3. prologue in fp32 1-D vectors
    # 3-4. the position's prologue and recurrence, one tile live (_recur), stored straight back
    S, o = _recur(_conv_silu(win_qk, conv_w, ch_qk, W), _conv_silu(win_v, conv_w, ch_v, W), fk, blog, a, dtb, lb,
                  scale, S)
    tl.store(s_ptrs, S.to(state.dtype.element_ty))

    # 5. conv-state shifts this program owns: its v channels, and with one tile per head also q/k (with
    #    NT > 1 every tile reads q/k, so the last arriver shifts them). They come AFTER every use of the
    #    windows on purpose: Triton may re-issue a window's loads in another register layout at its use
    #    (seen in Triton 3.6's PTX), and a re-load placed after an in-place shift reads the shifted
    #    conv state (H200: state error up to 0.17 at 2-4 warps when the shift came first).
    _store_cols(cs_row, win_v, ch_v, W)
    if NT == 1:
        _store_cols(cs_row, win_qk, ch_qk, W)

    if NT == 1:
        # the whole head is here: no scratch, no atomics
        r = tl.rsqrt(tl.sum(o * o, axis=0) / D + eps)
        y = o * r * wn / (1.0 + tl.exp(-gt))
        tl.store(out_row + offs_v, y.to(out.dtype.element_ty))
    else:
        tl.store(scr_o + bh.to(tl.int64) * D + v0 + offs_v, o)
        tl.debug_barrier()  # every thread's scratch store happens-before the release below
        arrived = tl.atomic_add(counter + bh, 1, sem="acq_rel")
        if arrived == NT - 1:
            # scratch, gate, norm weight and the head's q/k conv inputs: independent loads, one round trip
            oa = tl.load(scr_o + bh.to(tl.int64) * D + offs_k, cache_modifier=".cg")
            wn = tl.load(o_norm_w + offs_k).to(tl.float32)
            gt = tl.load(gate_row + offs_k).to(tl.float32)
            # every program of this head has read the old q/k conv state by now
            sh_q = _load_cols(cs_row, ch_q, W) + (tl.load(x_row + ch_q),)
            sh_k = _load_cols(cs_row, ch_k, W) + (tl.load(x_row + ch_k),)
            r = tl.rsqrt(tl.sum(oa * oa, axis=0) / D + eps)
            y = oa * r * wn / (1.0 + tl.exp(-gt))
            tl.store(out_row + offs_k, y.to(out.dtype.element_ty))
            _store_cols(cs_row, sh_q, ch_q, W)
            _store_cols(cs_row, sh_k, ch_k, W)
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


# num_warps per value tile, from kernels/triton/tune_kda.py --quick on the H200 (tune_kda.json.gz, git history af86fbf,
# 12 heads, D = 128, every config checked against fp64 first; tiles 8/16/32/128, the geometric mean over
# its cases: decode B = 1 and 64, verify T = 4 and 8 at B = 1 and 8). Changed where the tuner found a clear
# winner: decode tile 128 8 -> 4 warps (faster at B=64; 8 warps spills), verify tile 128 8 -> 4 and tiles 8 and 16
# 1 -> 2 (at B=8 T=4; docs/NOTES_kda.md, fourth session).
# Kept where 2 and 4 warps tie (decode tiles 16, 32) and where the quick tuner did not go
# (tiles 4, 64: the previous kernel's measurement).
_DECODE_WARPS = {4: 2, 8: 2, 16: 2, 32: 4, 64: 4, 128: 4}
_VERIFY_WARPS = {4: 1, 8: 2, 16: 2, 32: 4, 64: 4, 128: 4}


def default_num_warps(D: int, tile_v: int, verify: bool = False) -> int:
    """num_warps measured best per value-tile width (D=128); scaled down for smaller heads."""
    nw = (_VERIFY_WARPS if verify else _DECODE_WARPS)[tile_v]
    return max(1, min(nw, (D * tile_v) // 512 or 1))


def kda_decode(qkv, f, b, gate, params, state, conv_state, out, tile_v: int = 128, num_warps=None, pdl=None):
    """One fused decode step. Shapes as k3lab.ref.kda (contiguous; validated by the component API).
    Updates `state` and `conv_state` in place, writes `out` [B, H*D]; returns `out`. pdl: launched with
    programmatic dependent launch (None: the enclosing pdl.pdl_chain's setting); the state, conv state
    and parameters are then read before the wait (the kernel directly before must not write them)."""
    _launch_decode(qkv, f, b, gate, params, state, conv_state, out, tile_v, num_warps, pdl=pdl)
    return out


def _launch_decode(qkv, f, b, gate, params, state, conv_state, out, tile_v, num_warps, num_stages=None, pdl=None):
    """The launch behind kda_decode; returns Triton's compiled-kernel handle (n_regs / n_spills on a GPU).
    num_stages is exposed for kernels/triton/tune_kda.py only (the kernel has no loop to pipeline)."""
    B = qkv.shape[0]
    H, D, W = params.heads, params.head_dim, params.conv_kernel
    assert D % tile_v == 0 and tile_v in TILE_V_ALLOWED, (D, tile_v)
    NT = D // tile_v
    scr_o, counter = _scratch(qkv.device, B * H, D, NT) if NT > 1 else (out, out)
    nw = num_warps or default_num_warps(D, tile_v)
    opts = {} if num_stages is None else {"num_stages": num_stages}
    pdl = chain_pdl(pdl)
    return _kda_decode_kernel[(B * H * NT,)](
        qkv, f, b, gate, params.conv_w, params.A_log, params.dt_bias, params.o_norm_w,
        state, conv_state, out, scr_o, counter,
        H, float(params.eps), float(params.lower_bound), 1.0 / math.sqrt(D),
        D=D, TV=tile_v, NT=NT, W=W, PDL=pdl, num_warps=nw, **opts, **launch_kw(pdl),
    )
