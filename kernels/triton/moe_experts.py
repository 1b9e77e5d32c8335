"""Latent-MoE routed experts for decode: the token x top-k pairs grouped by expert on the device, w1/w3 with
SiTU-GLU fused, w2 with the routing weights applied, and the sum over a token's experts. Four paths (`path`;
the rule `default_path` picks by weight format and batch, from the H200 sweeps in docs/NOTES_moe.md):
  grouped  one launch after zeroing y (`_moe_experts_kernel`, below): program (n, pair) runs BN intermediate rows
           of w1/w3 and the matching w2 columns of its expert; tensor-core tiles of up to 16 tokens;
  gemv     one launch, y zeroed inside (`_moe_gemv_kernel`, batch <= 16): role A items (pair, BN rows) put
           wk * situ(W1 z, W3 z) for every token into a scratch buffer, role B items (pair, BL latent rows) add
           W2 act into y; items are handed out by a ticket in program start order and B items wait for every A
           item (a counter), so the whole chip streams w1/w3, then w2, in small even items (bf16, fp8);
  simt     MXFP4, batch <= 64 (`_moe_simt_kernel`): the gemv kernel's two roles and tickets with CUDA-core bodies
           (no tensor cores, no 16-token padding): the codes in their kernel layout (k3lab.mxfp4.to_kernel_layout),
           7 integer instructions per 8 codes, f16x2 FMAs per 32-block, one or two tokens a pass; optionally
           persistent (`persist` programs a multiprocessor, registers capped by `maxnreg` so that they fit); at
           batch 1 each pair is its own group; `leaders`: a prologue lists the groups' leaders, and the tickets
           run over them only; `wait`: a B item waits for every A item ("all") or its own expert's ("expert").
           Its section below has the details and the exactness.
  tc       MXFP4 (the rule above 64 tokens; `_moe_tc_kernel`): the grouped kernel's programs on the simt path's
           kernel layout and decode, one f16 tensor-core dot a 32-block times its factor; its section below.

    y[b] = sum_k wk[b,k] * W2_e situ(W1_e z[b], W3_e z[b]),   e = idx[b,k]        (fp32 [B, L])
    situ(g, u) = b1 tanh(g/b1) sigmoid(g) * b2 tanh(u/b2)                          (k3lab.ref.situ)

Layout (k3lab.ref.moe.ExpertWeight, one GPU's TP slice; L = latent 3584, I = per-GPU intermediate 384 at TP8):
    z [B, L] bf16; idx [B, K] int32/int64 expert ids; wk [B, K] fp32 routing weights; y [B, L] fp32 (accumulated
    with fp32 atomics: the order of a token's K terms is not fixed);
    w1, w3 [E, I, L] and w2 [E, L, I] in one of three formats:
      bf16    the values;
      fp8     e4m3fn values with one fp32 scale per output channel (w1/w3: per row of I, [E, I]; w2: per
              row of L, [E, L]): W = q * s. The scale multiplies the dot product of the row, so the dot runs
              on the exact e4m3 values (grouped: as bf16; gemv: as fp16 against z in fp16, exact for
              2^-14 <= |z| < 65504, and an fp16 activation);
      mxfp4   E2M1 codes packed two per byte along the input dim (element 2i in the low nibble) [E, out, in/2]
              uint8 and one E8M0 scale per 32 inputs [E, out, in/32] uint8 (k3lab.mxfp4): W = e2m1 * 2^(s-127),
              dequantized in registers (the H200 has no fp4 maths), exactly. Grouped (`_mxfp4_tile`): the fp16
              bit pattern (code&7)<<9 | (code&8)<<12 (= value * 2^-14, subnormals included), widened to fp32 and
              multiplied by 2^(s-113), to bf16; exact for s in 2..240. Simt: the same codes in the kernel layout
              ([E, out, in/8] int32; the caller passes these words, see k3lab.components.moe.kernel_layout),
              decoded to f16x2 of value * 2^-14 (`k3lab_kernels.mxfp4_ptx.decode_ptx`), exact for s in 0..246.

The grouped path, grouping without a host sync (the step is captured in a CUDA graph): grid (I / BN, B*K).
Program (n, p) takes pair p's expert e = idx[p]; it reads the [B, K] id tile and runs only if p is the first pair
that chose e (the group's leader: every selected expert runs once, however many tokens chose it; the other pairs'
programs exit at once). Its members (the tokens that chose e, at most one pair each) are ranked with a cumsum and
taken BT at a time (a group larger than BT loops, re-reading the expert's rows from L2). For its BN intermediate rows it
  1. streams W1_e, W3_e rows [BN, L] in BK chunks: tensor-core dots against the members' z^T [BK, BT] (bf16,
     fp32 accumulation; MXFP4 dequantized per chunk), then a = situ(g, u) in fp32, rounded to bf16;
  2. streams W2_e[:, n-block] [L, BN] in BL row chunks: W2 a [BL, BT] times the members' routing weights,
     atomically added into y.
Every weight byte of a selected expert is read once per call (plus the re-reads of groups larger than BT).
Batch 1, 16 experts, I = 384, BN = 64 (`default_blocks`): 96 programs, each one expert's 64 rows of w1/w3 and
64 columns of w2 (1.4 MB in bf16).

Floor (bytes, k3lab.ops.moe.experts_bytes): distinct experts touched x (3 * I * L * e) where e = 2 (bf16),
1 + 4/L (fp8, the scales), 0.5 + 1/32 (mxfp4), + z B*L*2 + ids and weights B*K*(8+4) + y B*L*4 written.
TP8, 16 experts: bf16 132 MB, fp8 66 MB, mxfp4 35 MB (28.7 / 14.4 / 7.6 us at 4.6 TB/s).
"""
from __future__ import annotations

import re

import torch
import triton
import triton.language as tl

from k3lab_kernels.mxfp4_ptx import decode_ptx
from k3lab_kernels.triton.mla_decode import dot_f32, rne_bf16
from k3lab_kernels.triton.pdl import chain_pdl, launch_kw, pdl_enter

FORMATS = ("bf16", "fp8", "mxfp4")
BLOCK_N_ALLOWED = (16, 32, 64, 128)
BLOCK_T_ALLOWED = (16, 32, 64)
MAX_BATCH = 256


@triton.jit
def _tanh(x):
    return 2.0 * tl.sigmoid(2.0 * x) - 1.0


@triton.jit
def _situ(g, u, B1: tl.constexpr, B2: tl.constexpr):
    return (B1 * _tanh(g / B1) * tl.sigmoid(g)) * (B2 * _tanh(u / B2))


@triton.jit
def _mm(a, b, acc, DOT_F32: tl.constexpr):
    """acc + a @ b on bf16 operands (tensor cores, fp32 accumulation); under the interpreter the same bf16
    values widened to fp32 first (its bf16 dot is wrong: k3lab_kernels.triton.mla_decode.dot_f32)."""
    if DOT_F32:
        return tl.dot(a.to(tl.float32), b.to(tl.float32), acc)
    return tl.dot(a, b, acc)


@triton.jit
def _mxfp4_tile(q, s, R: tl.constexpr, C: tl.constexpr):
    """Packed E2M1 [R, C/2] uint8 and E8M0 scales [R, C/32] uint8 -> [R, C] bf16, exactly (module docstring)."""
    lo = q & 0xF
    hi = q >> 4
    codes = tl.join(lo, hi).reshape(R, C).to(tl.int16)  # element 2i = low nibble of byte i
    bits = ((codes & 7) << 9) | ((codes & 8) << 12)
    v = bits.to(tl.float16, bitcast=True).to(tl.float32)  # e2m1 * 2^-14
    sc = ((s.to(tl.int32) + 14) << 23).to(tl.float32, bitcast=True)  # 2^(s - 113)
    w = v.reshape(R, C // 32, 32) * sc[:, :, None]
    return w.reshape(R, C).to(tl.bfloat16)


@triton.jit
def _group(idx, wk, p, B, K: tl.constexpr, KP: tl.constexpr, BB: tl.constexpr):
    """Pair p's expert e and its group: leader (p is the first pair that chose e), per token b of the batch
    whether it chose e (mem), its routing weight for e, its pair index b*K+k, the count and each member's rank."""
    e = tl.load(idx + p).to(tl.int64)
    bb = tl.arange(0, BB)
    kk = tl.arange(0, KP)
    pm = (bb < B)[:, None] & (kk < K)[None, :]
    flat = bb[:, None] * K + kk[None, :]
    eq = (tl.load(idx + flat, mask=pm, other=-1).to(tl.int64) == e) & pm
    leader = tl.min(tl.min(tl.where(eq, flat, BB * KP), axis=1), axis=0) == p
    mem = tl.max(eq.to(tl.int32), axis=1)
    w_tok = tl.sum(tl.where(eq, tl.load(wk + flat, mask=pm, other=0.0), 0.0), axis=1)
    q_tok = tl.sum(tl.where(eq, flat, 0), axis=1)
    return e, leader, mem, w_tok, q_tok, tl.sum(mem, axis=0), tl.cumsum(mem, axis=0) - 1


@triton.jit
def _slots(t0, mem, rank, w_tok, q_tok, BB: tl.constexpr, BT: tl.constexpr):
    """Members t0 .. t0+BT-1 of a group: token, routing weight, pair index (0 past the count) and validity."""
    slot = t0 + tl.arange(0, BT)
    sel = (rank[None, :] == slot[:, None]) & (mem[None, :] > 0)  # [BT, BB]
    tok = tl.sum(tl.where(sel, tl.arange(0, BB)[None, :], 0), axis=1)
    w_t = tl.sum(tl.where(sel, w_tok[None, :], 0.0), axis=1)
    q = tl.sum(tl.where(sel, q_tok[None, :], 0), axis=1)
    return tok, w_t, q, tl.sum(sel.to(tl.int32), axis=1) > 0


@triton.jit
def _up(z, w1e, w3e, s1e, s3e, tok, ok, rows, L: tl.constexpr, FMT: tl.constexpr, BN: tl.constexpr,
        BK: tl.constexpr, BT: tl.constexpr, B1: tl.constexpr, B2: tl.constexpr, DOT_F32: tl.constexpr):
    """a = situ(W1 z, W3 z) [BN, BT] fp32 for the BN rows `rows` of one expert and BT member tokens."""
    g = tl.zeros([BN, BT], tl.float32)
    u = tl.zeros([BN, BT], tl.float32)
    for k0 in range(0, L, BK):
        kc = k0 + tl.arange(0, BK)
        zt = tl.load(z + tok[None, :] * L + kc[:, None], mask=ok[None, :], other=0.0)
        if FMT == 2:
            kh = k0 // 2 + tl.arange(0, BK // 2)
            ks = k0 // 32 + tl.arange(0, BK // 32)
            q1 = tl.load(w1e + rows[:, None] * (L // 2) + kh[None, :])
            q3 = tl.load(w3e + rows[:, None] * (L // 2) + kh[None, :])
            c1 = tl.load(s1e + rows[:, None] * (L // 32) + ks[None, :])
            c3 = tl.load(s3e + rows[:, None] * (L // 32) + ks[None, :])
            g = _mm(_mxfp4_tile(q1, c1, BN, BK), zt, g, DOT_F32)
            u = _mm(_mxfp4_tile(q3, c3, BN, BK), zt, u, DOT_F32)
        else:
            g = _mm(tl.load(w1e + rows[:, None] * L + kc[None, :]).to(tl.bfloat16), zt, g, DOT_F32)
            u = _mm(tl.load(w3e + rows[:, None] * L + kc[None, :]).to(tl.bfloat16), zt, u, DOT_F32)
    if FMT == 1:
        g = g * tl.load(s1e + rows)[:, None]
        u = u * tl.load(s3e + rows)[:, None]
    return _situ(g, u, B1, B2)


@triton.jit
def _round_act(a, DOT_F32: tl.constexpr):
    """The activation as the w2 product's bf16 operand (nearest-even)."""
    if DOT_F32:
        a = rne_bf16(a)
    return a.to(tl.bfloat16)


@triton.jit
def _ptrs(w1, w3, w2, s1, s3, s2, e, L: tl.constexpr, I: tl.constexpr, FMT: tl.constexpr):
    """Expert e's weight and scale bases in its format."""
    if FMT == 2:
        return (w1 + e * (I * (L // 2)), w3 + e * (I * (L // 2)), w2 + e * (L * (I // 2)),
                s1 + e * (I * (L // 32)), s3 + e * (I * (L // 32)), s2 + e * (L * (I // 32)))
    return w1 + e * (I * L), w3 + e * (I * L), w2 + e * (L * I), s1 + e * I, s3 + e * I, s2 + e * L


@triton.jit
def _moe_experts_kernel(z, idx, wk, w1, w3, w2, s1, s3, s2, y, B,
                        L: tl.constexpr, I: tl.constexpr, K: tl.constexpr, KP: tl.constexpr, BB: tl.constexpr,
                        FMT: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, BL: tl.constexpr,
                        BT: tl.constexpr, B1: tl.constexpr, B2: tl.constexpr, DOT_F32: tl.constexpr):
    """Program (n, p) runs w1/w3 rows n*BN.. and the matching w2 columns of pair p's expert (if leader)."""
    n = tl.program_id(0)
    p = tl.program_id(1)
    e, leader, mem, w_tok, q_tok, cnt, rank = _group(idx, wk, p, B, K, KP, BB)
    if leader:
        w1e, w3e, w2e, s1e, s3e, s2e = _ptrs(w1, w3, w2, s1, s3, s2, e, L, I, FMT)
        rows = n * BN + tl.arange(0, BN)
        for t0 in range(0, cnt, BT):
            tok, w_t, q, ok = _slots(t0, mem, rank, w_tok, q_tok, BB, BT)
            act = _round_act(_up(z, w1e, w3e, s1e, s3e, tok, ok, rows, L, FMT, BN, BK, BT, B1, B2, DOT_F32), DOT_F32)
            for l0 in range(0, L, BL):  # y[tok] += w_t * W2[:, rows] a
                lr = l0 + tl.arange(0, BL)
                o = tl.zeros([BL, BT], tl.float32)
                if FMT == 2:
                    nh = n * (BN // 2) + tl.arange(0, BN // 2)
                    ns = n * (BN // 32) + tl.arange(0, BN // 32)
                    q2 = tl.load(w2e + lr[:, None] * (I // 2) + nh[None, :])
                    c2 = tl.load(s2e + lr[:, None] * (I // 32) + ns[None, :])
                    o = _mm(_mxfp4_tile(q2, c2, BL, BN), act, o, DOT_F32)
                else:
                    o = _mm(tl.load(w2e + lr[:, None] * I + rows[None, :]).to(tl.bfloat16), act, o, DOT_F32)
                if FMT == 1:
                    o = o * tl.load(s2e + lr)[:, None]
                o = o * w_t[None, :]
                tl.atomic_add(y + tok[None, :] * L + lr[:, None], o, mask=ok[None, :], sem="relaxed")


# ---- the tensor-core path on the kernel layout (MXFP4, `tc`) -------------------------------------------------
# The grouped kernel's programs and grouping, with the simt path's decode in front of f16 tensor cores: a 32-block's
# four kernel-layout words decode (the same 7 integer operations a word, PTX) to 32 f16 of e2m1 * 2^-14 (exact),
# in the order the joins below make (tile column f = 8 j + 4 a + 2 b + h holds input 2 (4 p + j) + h of the block,
# p = a + 2 b the part, j the word, h the half); the activations are gathered in that order (`_tc_perm`) as f16 of
# 2^6 x; each block is one K = 32 tensor-core dot (fp32 accumulation), times its factor 2^(s - 119) into the fp32
# sum. The up rows of a program are taken in the same order within each 32-row block, so that its activations are
# already in w2's decoded column order. Exactness: the simt path's (weights exact; z and the activations as f16 of
# 2^6 x, exact for |x| < 1023 and above 2^-20; products and sums fp32).


@triton.jit
def _kl_ptrs(w1, w3, w2, s1, s3, s2, e, L: tl.constexpr, I: tl.constexpr):
    """Expert e's bases in the kernel layout: words w1 / w3 [E, I, L/8], w2 [E, L, I/8]; scales as `_ptrs`."""
    return (w1 + e * (I * (L // 8)), w3 + e * (I * (L // 8)), w2 + e * (L * (I // 8)),
            s1 + e * (I * (L // 32)), s3 + e * (I * (L // 32)), s2 + e * (L * (I // 32)))


@triton.jit
def _tc_perm(f):
    """Input index within a 32-block of tile column f (the decoded tile's order)."""
    j = f // 8
    a = (f // 4) % 2
    b = (f // 2) % 2
    return 16 * b + 8 * a + 2 * j + f % 2


@triton.jit
def _tc_tile(wp, rows, cw, RW: tl.constexpr, R: tl.constexpr, INTERP: tl.constexpr):
    """One 32-block of R rows: words [R, 4] at word column cw of rows `rows` (row stride RW words) -> [R, 32] f16."""
    w = tl.load(wp + rows[:, None] * RW + cw + tl.arange(0, 4)[None, :])
    d0, d1, d2, d3 = _simt_decode(w, INTERP)
    d = tl.join(tl.join(d0, d1), tl.join(d2, d3))  # [R, 4 (j), 2 (a), 2 (b)]
    lo = (d & 0xFFFF).to(tl.int16).to(tl.float16, bitcast=True)
    hi = (d >> 16).to(tl.int16).to(tl.float16, bitcast=True)
    return tl.join(lo, hi).reshape(R, 32)


@triton.jit
def _tc_fac(sp, rows, cb, NBR: tl.constexpr):
    """The block factor 2^(s - 119) [R] fp32 of block cb of rows `rows` (NBR scale bytes a row)."""
    s = tl.load(sp + rows * NBR + cb).to(tl.int32)
    return ((s + 8) << 23).to(tl.float32, bitcast=True)


@triton.jit
def _dot16(a, b, INTERP: tl.constexpr):
    """a [M, 32] f16 @ b [32, N] f16 -> fp32 (tensor cores; the interpreter widens to fp32 first)."""
    if INTERP:
        return tl.dot(a.to(tl.float32), b.to(tl.float32))
    return tl.dot(a, b)


@triton.jit
def _moe_tc_kernel(z, idx, wk, w1, w3, w2, s1, s3, s2, y, lead, B,
                   L: tl.constexpr, I: tl.constexpr, K: tl.constexpr, KP: tl.constexpr, BB: tl.constexpr,
                   BN: tl.constexpr, BL: tl.constexpr, BT: tl.constexpr, B1: tl.constexpr, B2: tl.constexpr,
                   NBK: tl.constexpr, LEAD: tl.constexpr, INTERP: tl.constexpr):
    """Program (n, p): w1/w3 rows n*BN.. (in the decoded order of each 32-row block) and the matching w2 columns of
    pair p's expert, if p leads its group; BN = 64 (two w2 blocks). LEAD: program (n, j) takes the j-th leader of
    `_simt_leaders_kernel`'s list (lead[1 + j]) and exits at once past their count (lead[0]), so that the pairs
    that lead nothing cost one load instead of the group scan."""
    n = tl.program_id(0)
    p = tl.program_id(1)
    if LEAD:
        if p < tl.load(lead):
            _tc_program(z, idx, wk, w1, w3, w2, s1, s3, s2, y, B, n, tl.load(lead + 1 + p), L, I, K, KP, BB, BN, BL,
                        BT, B1, B2, NBK, INTERP)
    else:
        _tc_program(z, idx, wk, w1, w3, w2, s1, s3, s2, y, B, n, p, L, I, K, KP, BB, BN, BL, BT, B1, B2, NBK, INTERP)


@triton.jit
def _tc_program(z, idx, wk, w1, w3, w2, s1, s3, s2, y, B, n, p,
                L: tl.constexpr, I: tl.constexpr, K: tl.constexpr, KP: tl.constexpr, BB: tl.constexpr,
                BN: tl.constexpr, BL: tl.constexpr, BT: tl.constexpr, B1: tl.constexpr, B2: tl.constexpr,
                NBK: tl.constexpr, INTERP: tl.constexpr):
    """One program of `_moe_tc_kernel` for pair p (runs only if p leads its expert's group)."""
    e, leader, mem, w_tok, q_tok, cnt, rank = _group(idx, wk, p, B, K, KP, BB)
    if leader:
        f = tl.arange(0, BN)
        rows = n * BN + (f // 32) * 32 + _tc_perm(f % 32)
        kq = _tc_perm(tl.arange(0, 32))
        w1e, w3e, w2e, s1e, s3e, s2e = _kl_ptrs(w1, w3, w2, s1, s3, s2, e, L, I)
        for t0 in range(0, cnt, BT):
            tok, w_t, q, ok = _slots(t0, mem, rank, w_tok, q_tok, BB, BT)
            g = tl.zeros([BN, BT], tl.float32)
            u = tl.zeros([BN, BT], tl.float32)
            for c0 in range(0, L // 32, NBK):  # NBK 32-blocks a step
                for i in tl.static_range(NBK):
                    cb = c0 + i
                    zt = tl.load(z + tok[None, :] * L + cb * 32 + kq[:, None], mask=ok[None, :], other=0.0)
                    zt = (zt.to(tl.float32) * 64.0).to(tl.float16)
                    g += _dot16(_tc_tile(w1e, rows, cb * 4, L // 8, BN, INTERP), zt, INTERP) * \
                        _tc_fac(s1e, rows, cb, L // 32)[:, None]
                    u += _dot16(_tc_tile(w3e, rows, cb * 4, L // 8, BN, INTERP), zt, INTERP) * \
                        _tc_fac(s3e, rows, cb, L // 32)[:, None]
            act = (_situ(g, u, B1, B2) * 64.0).to(tl.float16)  # [BN, BT]: tile row f is intermediate rows[f]
            a0, a1 = tl.split(tl.permute(tl.reshape(act, [2, 32, BT]), (1, 2, 0)))
            for l0 in range(0, L, BL):  # y[tok] += w_t * W2[:, rows] act
                lr = l0 + tl.arange(0, BL)
                o = _dot16(_tc_tile(w2e, lr, n * (BN // 8), I // 8, BL, INTERP), a0, INTERP) * \
                    _tc_fac(s2e, lr, n * (BN // 32), I // 32)[:, None]
                o += _dot16(_tc_tile(w2e, lr, n * (BN // 8) + 4, I // 8, BL, INTERP), a1, INTERP) * \
                    _tc_fac(s2e, lr, n * (BN // 32) + 1, I // 32)[:, None]
                o = o * w_t[None, :]
                tl.atomic_add(y + tok[None, :] * L + lr[:, None], o, mask=ok[None, :], sem="relaxed")


# ---- the few-token path (batch <= 16): two roles in one launch -------------------------------------------

@triton.jit
def _load_w(wp, rows, c0, C: tl.constexpr, BC: tl.constexpr):
    """Columns c0 .. c0+BC of rows `rows` of one expert's bf16 / fp8 matrix ([*, C]): [R, BC]."""
    return tl.load(wp + rows[:, None] * C + c0 + tl.arange(0, BC)[None, :])


@triton.jit
def _load_x(xp, XS, c0, nrows, BB: tl.constexpr, BC: tl.constexpr, FMT: tl.constexpr, CG: tl.constexpr):
    """Activations [BB, BC] (row stride XS, rows past `nrows` zero) at columns c0.. as the dot's operand: bf16
    for bf16 weights, fp16 for fp8."""
    bb = tl.arange(0, BB)[:, None]
    rm = bb < nrows
    j = c0 + tl.arange(0, BC)[None, :]
    if CG:
        x = tl.load(xp + bb * XS + j, mask=rm, other=0.0, cache_modifier=".cg")
    else:
        x = tl.load(xp + bb * XS + j, mask=rm, other=0.0)
    if FMT == 1:
        x = x.to(tl.float16)
    return x


@triton.jit
def _dot_t(a, b, acc, INTERP: tl.constexpr):
    """acc + a @ b^T (b [N, K] as stored): tensor-core MMAs on 16-bit operands, fp32 accumulation; the
    interpreter widens the same values to fp32 first (its bf16 dot is wrong)."""
    if INTERP:
        return tl.dot(a.to(tl.float32), tl.trans(b.to(tl.float32)), acc)
    else:
        return tl.dot(a, tl.trans(b), acc)


@triton.jit
def _acc_w(acc, x, w, FMT: tl.constexpr, INTERP: tl.constexpr):
    """acc [BB, R] + x [BB, BC] @ W[R, BC]^T for one weight tile (`_load_w`) and activation tile (`_load_x`).
    fp8: e4m3 -> fp16 (exact; the channel scale is the caller's)."""
    if FMT == 1:
        return _dot_t(x, w.to(tl.float16), acc, INTERP)
    else:
        return _dot_t(x, w, acc, INTERP)


@triton.jit
def _gemv_up(z, idx, wk, w1, w3, s1, s3, act, flags, p, n, B, L: tl.constexpr, I: tl.constexpr,
             K: tl.constexpr, KP: tl.constexpr, BB: tl.constexpr, FMT: tl.constexpr, BN: tl.constexpr,
             BK: tl.constexpr, B1: tl.constexpr, B2: tl.constexpr, INTERP: tl.constexpr):
    """Role A, item (pair p, row tile n): if p leads its expert's group, act[p, b, rows] = wk_e[b] *
    situ(W1 z[b], W3 z[b]) for every token b < BB (0 where b did not choose e); flags[p] = p leads."""
    e, leader, mem, w_tok, q_tok, cnt, rank = _group(idx, wk, p, B, K, KP, BB)
    if n == 0:
        tl.store(flags + p, leader.to(tl.int32))
    if leader:
        w1e, w3e, s1e, s3e = w1 + e * (I * L), w3 + e * (I * L), s1 + e * I, s3 + e * I
        rows = n * BN + tl.arange(0, BN)
        g = tl.zeros([BB, BN], tl.float32)
        u = tl.zeros([BB, BN], tl.float32)
        for k0 in range(0, L, BK):  # software-pipelined by Triton (num_stages): the next chunks' loads in flight
            za = _load_x(z, L, k0, B, BB, BK, FMT, False)
            g = _acc_w(g, za, _load_w(w1e, rows, k0, L, BK), FMT, INTERP)
            u = _acc_w(u, za, _load_w(w3e, rows, k0, L, BK), FMT, INTERP)
        if FMT == 1:
            g = g * tl.load(s1e + rows)[None, :]
            u = u * tl.load(s3e + rows)[None, :]
        a = _situ(g, u, B1, B2) * w_tok[:, None]
        if FMT == 0:
            a = _round_act(a, INTERP)
        tl.store(act + p * (BB * I) + tl.arange(0, BB)[:, None] * I + rows[None, :], a.to(act.dtype.element_ty))


@triton.jit
def _gemv_down(idx, w2, s2, act, flags, y, p, lt, B, L: tl.constexpr, I: tl.constexpr, BB: tl.constexpr,
               FMT: tl.constexpr, BL: tl.constexpr, BI: tl.constexpr, INTERP: tl.constexpr):
    """Role B, item (pair p, latent tile lt): if p leads, y[b, lr] += W2_e[lr, :] act[p, b, :] (fp32 atomics)."""
    if tl.load(flags + p) != 0:
        e = tl.load(idx + p).to(tl.int64)
        w2e, s2e = w2 + e * (L * I), s2 + e * L
        lr = lt * BL + tl.arange(0, BL)
        acc = tl.zeros([BB, BL], tl.float32)
        for i0 in range(0, I, BI):
            acc = _acc_w(acc, _load_x(act + p * (BB * I), I, i0, BB, BB, BI, FMT, True), _load_w(w2e, lr, i0, I, BI),
                         FMT, INTERP)
        if FMT == 1:
            acc = acc * tl.load(s2e + lr)[None, :]
        bb = tl.arange(0, BB)[:, None]
        tl.atomic_add(y + bb * L + lr[None, :], acc, mask=bb < B, sem="relaxed")


@triton.jit
def _moe_gemv_kernel(z, idx, wk, w1, w3, w2, s1, s3, s2, y, act, ws, B, NA, NPROG,
                     L: tl.constexpr, I: tl.constexpr, K: tl.constexpr, KP: tl.constexpr, BB: tl.constexpr,
                     FMT: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, BL: tl.constexpr, BI: tl.constexpr,
                     B1: tl.constexpr, B2: tl.constexpr, INTERP: tl.constexpr):
    """NA role-A items (pairs x I/BN row tiles: w1/w3 + SiTU into act, and y zeroed) then B*K * L/BL role-B items
    (w2 into y), handed out by a ticket in the order programs start: a B item waits for every A item, and all
    of those were taken by programs already running, so the wait always ends. ws (int32, zero between calls):
    [0] ticket, [32] A items done, [64] programs done (the last resets all three), [96 + p] leader flags."""
    t = tl.atomic_add(ws, 1, sem="relaxed")
    flags = ws + 96
    if t < NA:
        zc = t * 1024 + tl.arange(0, 1024)
        for z0 in range(0, B * L, NA * 1024):  # y zeroed here, before any B item adds into it
            tl.store(y + z0 + zc, tl.zeros([1024], tl.float32), mask=z0 + zc < B * L)
        _gemv_up(z, idx, wk, w1, w3, s1, s3, act, flags, t // (I // BN), t % (I // BN), B, L, I, K, KP, BB, FMT,
                 BN, BK, B1, B2, INTERP)
        tl.debug_barrier()
        tl.atomic_add(ws + 32, 1, sem="release")
    else:
        # one thread polls with acquire loads and the CTA waits on its answer (a barrier each poll), so no load
        # of the B item can move above the wait; bounded: a broken counter gives wrong sums, never a hang
        _wait_a(ws + 32, NA)
        tb = t - NA
        _gemv_down(idx, w2, s2, act, flags, y, tb // (L // BL), tb % (L // BL), B, L, I, BB, FMT, BL, BI, INTERP)
    if tl.atomic_add(ws + 64, 1, sem="acq_rel") == NPROG - 1:
        tl.atomic_xchg(ws, 0)
        tl.atomic_xchg(ws + 32, 0)
        tl.atomic_xchg(ws + 64, 0)


# ---- the SIMT path (MXFP4, few tokens per expert): CUDA-core dequant-GEMV ---------------------------------
#
# No tensor cores, no 16-row padding: a program streams BN rows (w1 and w3 together) or BL rows (w2) of one
# expert as [rows, NB, 4] int32 tiles (one 16-byte load per row and 32-block: the block's four words in the
# kernel layout of k3lab.mxfp4.to_kernel_layout), the next step's tiles loaded before this step's arithmetic
# (registers double-buffered). Each word becomes four f16x2 with 7 integer instructions (no table, no
# conversion unit), multiplied by the activation pairs in f16x2 FMAs (a block's 32 products summed in f16); the
# block sum times its E8M0 factor goes into an fp32 accumulator. One or two member tokens share each decoded
# word (an accumulator slot each); a group of more tokens loops, re-reading its rows from L2. At batch 1 the
# pairs are the token's distinct top-k experts, so each pair leads a group of one (`_simt_group`: no id tile).
# Activations enter as f16 scaled by 2^6 (z from bf16 in registers every step; the SiTU activation stored so by
# role A); the decoded weights are e2m1 * 2^-14 (exact f16, subnormals included), so the block factor is 2^(s - 119).
# Exactness: every decoded weight is exact (weight = decoded * 2^14 * 2^(s - 127), s <= 246); the products
# and the block's sum are f16 (11-bit significand; a product under 2^-14 keeps an absolute error <= 2^-25,
# i.e. 2^-17 in the activation's units); activations must satisfy |x| < 1023 (2^6 |x| within f16).

def _simt_asm(tb: int, pack: int = 1) -> str:
    """One 32-block of one row for `tb` tokens: $0..$3 accumulator slots out (slot t = token t); inputs $4..$7 the
    block's four words, 8 + 16t + 4p + j token t's activation pair for part p of word j, then the block factor
    (pack=1: one; pack=4: four copies) and the four slots in. pack=1 takes each operand as its own [R, NB] tile
    (layout-independent), pack=4 a block's four words as one group of a [R, NB, 4] tile."""
    f0, a0 = 8 + 16 * tb, 8 + 16 * tb + pack  # pack=4: four copies of the factor (slot t reads copy t)
    hs = ", ".join(f"h{t}" for t in range(tb))
    lines = ["{", ".reg .b32 t, d0, d1, d2, d3, " + hs + ";", ".reg .b16 lo, hi;", ".reg .f32 a, b;"]
    lines += [f"mov.b32 h{t}, 0;" for t in range(tb)]
    for j in range(4):
        lines += decode_ptx(f"${4 + j}")
        for t in range(tb):
            lines += [f"fma.rn.f16x2 h{t}, d{p}, ${8 + 16 * t + 4 * p + j}, h{t};" for p in range(4)]
    for t in range(tb):
        lines += [f"mov.b32 {{lo, hi}}, h{t};", "cvt.f32.f16 a, lo;", "cvt.f32.f16 b, hi;", "add.f32 a, a, b;",
                  f"fma.rn.f32 ${t}, a, ${f0 + (t if pack == 4 else 0)}, ${a0 + t};"]
    lines += [f"mov.b32 ${t}, ${a0 + t};" for t in range(tb, 4)]
    return "\n".join(lines + ["}"])


_SIMT_ASM1 = tl.constexpr(_simt_asm(1))
_SIMT_ASM2 = tl.constexpr(_simt_asm(2))
_SIMT_CONS1 = tl.constexpr(",".join(["=r"] * 4 + ["r"] * 25))
_SIMT_CONS2 = tl.constexpr(",".join(["=r"] * 4 + ["r"] * 41))
_SIMT_ASM1_P4 = tl.constexpr(_simt_asm(1, 4))  # pack=4: the operands are [R, NB, 4] tiles, a block's words a group
_SIMT_ASM2_P4 = tl.constexpr(_simt_asm(2, 4))
_SIMT_CONS1_P4 = tl.constexpr(",".join(["=r"] * 4 + ["r"] * 28))
_SIMT_CONS2_P4 = tl.constexpr(",".join(["=r"] * 4 + ["r"] * 44))
_DECODE_ASM = tl.constexpr("\n".join(["{", ".reg .b32 t, d0, d1, d2, d3;"] + decode_ptx("$4")
                                     + ["mov.b32 $0, d0;", "mov.b32 $1, d1;", "mov.b32 $2, d2;", "mov.b32 $3, d3;",
                                        "}"]))
# bf16x2 -> f16x2 of 2^6 x (round to nearest). The 2^6 is an exponent add on the fp32 bit pattern: a zero or a
# bf16 subnormal becomes a value under 2^-120, which the conversion rounds to a zero of the same sign, as it
# rounds 2^6 times the subnormal.
_TO_F16_ASM = tl.constexpr("""{
.reg .b32 a, b;
mad.lo.u32 a, $1, 65536, 0x03000000;
and.b32 b, $1, 0xFFFF0000;
add.u32 b, b, 0x03000000;
cvt.rn.f16x2.f32 $0, b, a;
}""")

_M0 = tl.constexpr(0x8E008E00 - (1 << 32))


@triton.jit
def _brev32(x):
    """The interpreter's bit reversal of int32 words (PTX brev.b32): swaps of 1, 2, 4, 8 and 16 bits, each shift's
    sign extension masked off."""
    x = ((x >> 1) & 0x55555555) | ((x & 0x55555555) << 1)
    x = ((x >> 2) & 0x33333333) | ((x & 0x33333333) << 2)
    x = ((x >> 4) & 0x0F0F0F0F) | ((x & 0x0F0F0F0F) << 4)
    x = ((x >> 8) & 0x00FF00FF) | ((x & 0x00FF00FF) << 8)
    return ((x >> 16) & 0xFFFF) | (x << 16)


@triton.jit
def _simt_parts(w):
    """The interpreter's decode (the same bit operations as `decode_ptx`): int32 words -> 4 int32 parts."""
    d0 = w & _M0
    d1 = (w << 8) & _M0
    v = _brev32(w)
    d2 = v & _M0
    d3 = (v << 8) & _M0
    return d0, d1, d2, d3


@triton.jit
def _simt_decode(w, INTERP: tl.constexpr):
    """Kernel-layout words -> the four parts (f16x2 bits as int32): inline PTX, or the interpreter's twin."""
    if INTERP:
        return _simt_parts(w)
    else:
        return tl.inline_asm_elementwise(_DECODE_ASM, "=r,=r,=r,=r,r", [w], dtype=(tl.int32,) * 4, is_pure=True,
                                         pack=1)


@triton.jit
def _f16x2_f32(d):
    """f16x2 bits (int32, any shape) -> (low, high) as fp32 (interpreter)."""
    lo = (d & 0xFFFF).to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)
    hi = (d >> 16).to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)
    return lo, hi


@triton.jit
def _tok_interp(acc, dl, dh, f, x0, x1, x2, x3, t: tl.constexpr):
    """acc[..., t] += f * one token's products with the decoded parts dl, dh [R, NB, 4, 2, 2] (interpreter,
    fp32): its part operands stacked the same way."""
    xl, xh = _f16x2_f32(tl.join(tl.join(x0, x1), tl.join(x2, x3)))
    bs = tl.sum(tl.sum(tl.sum(dl * xl + dh * xh, axis=4), axis=3), axis=2)
    return acc + tl.where(tl.arange(0, 4)[None, None, :] == t, (bs * tl.max(f, axis=2))[:, :, None], 0.0)


@triton.jit
def _split4(t, R: tl.constexpr, NB: tl.constexpr):
    """[R, NB, 4] -> its four [R, NB] slices along the last axis (index 0..3)."""
    even, odd = tl.split(tl.reshape(t, (R, NB, 2, 2)))  # element j = 2 i + k: k = 0 even j, k = 1 odd j
    e0, e2 = tl.split(even)
    e1, e3 = tl.split(odd)
    return e0, e1, e2, e3


@triton.jit
def _join4(a0, a1, a2, a3, R: tl.constexpr, NB: tl.constexpr):
    """Four [R, NB] -> [R, NB, 4] (a_t at index t): `_split4`'s inverse."""
    return tl.reshape(tl.join(tl.join(a0, a2), tl.join(a1, a3)), (R, NB, 4))


@triton.jit
def _simt_acc(w, f, acc, xa0, xa1, xa2, xa3, xb0, xb1, xb2, xb3, TB: tl.constexpr, INTERP: tl.constexpr,
              NW: tl.constexpr):
    """acc [R, NB, 4] (slot t = token t) += block factor f [R, NB] * the block's products for tokens a and b (the
    first TB of them): w [R, NB, 4] words, x?p [1, NB, 4] the token's pairs for part p."""
    if INTERP:  # the decode once, then each token's products (fp32)
        d0, d1, d2, d3 = _simt_parts(w)
        dl, dh = _f16x2_f32(tl.join(tl.join(d0, d1), tl.join(d2, d3)))
        f4 = tl.broadcast_to(f[:, :, None], w.shape)
        acc = _tok_interp(acc, dl, dh, f4, xa0, xa1, xa2, xa3, 0)
        if TB >= 2:
            acc = _tok_interp(acc, dl, dh, f4, xb0, xb1, xb2, xb3, 1)
        return acc
    elif w.shape[0] * w.shape[1] >= 32 * NW:  # >= 4 words a thread (NW warps): pack=4 groups one block's
        # four words (measured: the fast form), IF the compiled layout keeps them in one thread: the launcher checks
        # every compiled kernel's TTGIR (`_require_pack4_layout`; 2 warps broke it on Triton 3.6)
        f4 = tl.broadcast_to(f[:, :, None], w.shape)
        if TB == 1:
            return tl.inline_asm_elementwise(_SIMT_ASM1_P4, _SIMT_CONS1_P4, [w, xa0, xa1, xa2, xa3, f4, acc],
                                             dtype=tl.float32, is_pure=True, pack=4)
        else:
            return tl.inline_asm_elementwise(_SIMT_ASM2_P4, _SIMT_CONS2_P4,
                                             [w, xa0, xa1, xa2, xa3, xb0, xb1, xb2, xb3, f4, acc],
                                             dtype=tl.float32, is_pure=True, pack=4)
    else:  # small tiles: split into [R, NB] operands, one PTX call an element (layout-independent; a
        # pack=4 call on a tile with fewer than four elements a thread grouped the wrong ones: H200, latent 32)
        R: tl.constexpr = w.shape[0]
        NB: tl.constexpr = w.shape[1]
        w0, w1, w2, w3 = _split4(w, R, NB)
        a0, a1, a2, a3 = _split4(acc, R, NB)
        p00, p01, p02, p03 = _split4(xa0, 1, NB)
        p10, p11, p12, p13 = _split4(xa1, 1, NB)
        p20, p21, p22, p23 = _split4(xa2, 1, NB)
        p30, p31, p32, p33 = _split4(xa3, 1, NB)
        if TB == 1:
            o0, o1, o2, o3 = tl.inline_asm_elementwise(
                _SIMT_ASM1, _SIMT_CONS1, [w0, w1, w2, w3, p00, p01, p02, p03, p10, p11, p12, p13, p20, p21, p22,
                                          p23, p30, p31, p32, p33, f, a0, a1, a2, a3],
                dtype=(tl.float32, tl.float32, tl.float32, tl.float32), is_pure=True, pack=1)
        else:
            q00, q01, q02, q03 = _split4(xb0, 1, NB)
            q10, q11, q12, q13 = _split4(xb1, 1, NB)
            q20, q21, q22, q23 = _split4(xb2, 1, NB)
            q30, q31, q32, q33 = _split4(xb3, 1, NB)
            o0, o1, o2, o3 = tl.inline_asm_elementwise(
                _SIMT_ASM2, _SIMT_CONS2, [w0, w1, w2, w3, p00, p01, p02, p03, p10, p11, p12, p13, p20, p21, p22,
                                          p23, p30, p31, p32, p33, q00, q01, q02, q03, q10, q11, q12, q13, q20, q21,
                                          q22, q23, q30, q31, q32, q33, f, a0, a1, a2, a3],
                dtype=(tl.float32, tl.float32, tl.float32, tl.float32), is_pure=True, pack=1)
        return _join4(o0, o1, o2, o3, R, NB)


@triton.jit
def _to_f16x2(x, INTERP: tl.constexpr):
    """bf16 pairs (int32 bits) -> f16 pairs of 2^6 x (int32 bits), nearest-even."""
    if INTERP:
        lo = ((x << 16).to(tl.float32, bitcast=True) * 64.0).to(tl.float16).to(tl.int16, bitcast=True)
        hi = ((x & -65536).to(tl.float32, bitcast=True) * 64.0).to(tl.float16).to(tl.int16, bitcast=True)
        return (hi.to(tl.int32) << 16) | (lo.to(tl.int32) & 0xFFFF)
    else:
        return tl.inline_asm_elementwise(_TO_F16_ASM, "=r,r", [x], dtype=tl.int32, is_pure=True, pack=1)


@triton.jit
def _xparts(xp, off, blk, CONV: tl.constexpr, INTERP: tl.constexpr):
    """One token's activation pairs at blocks `blk` as the four part operands [1, NB, 4] (int32 f16x2 bits):
    pair 16 b + 4 p + j for part p of word j (one 16-byte load a part). xp: int32 pairs, `off` the token's row
    offset (an empty slot points at a written row: finite values whose sums are never stored); CONV: the pairs
    are bf16 (z), converted to f16 of 2^6 z, else f16 already (the SiTU activation as role A stored it)."""
    base = tl.multiple_of(xp + off, 16) + blk[None, :, None] * 16 + tl.arange(0, 4)[None, None, :]
    x0 = tl.load(base)
    x1 = tl.load(base + 4)
    x2 = tl.load(base + 8)
    x3 = tl.load(base + 12)
    if CONV:
        if INTERP:  # one conversion of the four (fewer interpreted calls)
            x01, x23 = tl.split(_to_f16x2(tl.join(tl.join(x0, x1), tl.join(x2, x3)), INTERP))
            x0, x1 = tl.split(x01)
            x2, x3 = tl.split(x23)
        else:
            x0, x1, x2, x3 = (_to_f16x2(x0, INTERP), _to_f16x2(x1, INTERP), _to_f16x2(x2, INTERP),
                              _to_f16x2(x3, INTERP))
    return x0, x1, x2, x3


@triton.jit
def _slot(v, t: tl.constexpr):
    """Element t of a [4] tensor as a scalar."""
    return tl.sum(tl.where(tl.arange(0, 4) == t, v, 0), axis=0)


@triton.jit
def _simt_load(wp, sp, rows, b0, C: tl.constexpr, NB: tl.constexpr):
    """The 32-blocks b0 .. b0+NB-1 of rows `rows` of one kernel-layout matrix ([*, C] logical): words [R, NB, 4]
    and the E8M0 scales [R, NB] (int32). The words load as a 2D [R, 4 NB] tile reshaped in registers, so that
    their layout has the blocks, not the rows, next to the four words and the scales' [R, NB] layout is its slice
    (no data moves when they are broadcast over the words). A 3D load's layout on Triton 3.6 puts the rows second
    and costs a shared-memory conversion of the scales every step: slower (H200, docs/NOTES_moe.md, twelfth session)."""
    R: tl.constexpr = rows.shape[0]
    w = tl.reshape(tl.load(wp + rows[:, None] * (C // 8) + b0 * 4 + tl.arange(0, 4 * NB)[None, :]), (R, NB, 4))
    return w, tl.load(sp + rows[:, None] * (C // 32) + b0 + tl.arange(0, NB)[None, :]).to(tl.int32)


@triton.jit
def _factor(s):
    """Block factors [R, NB] for the scales s [R, NB]: 2^(s - 119) (the decoded e2m1 * 2^-14 times 2^6 x)."""
    return ((s + 8) << 23).to(tl.float32, bitcast=True)


@triton.jit
def _wait_a(cnt, NA):
    """Role B's wait until the counter `cnt` reaches NA (both two-role kernels: ws + 32 counting every role-A item;
    the simt kernel's per-expert wait: its pair's own counter, then the y-zeroing items'): one thread polls with
    acquire loads and the CTA waits on its answer, bounded (a broken counter gives wrong sums, never a hang)."""
    done = tl.atomic_add(cnt, 0, sem="acquire")
    spins = 0
    while (done < NA) & (spins < 100000):
        done = tl.atomic_add(cnt, 0, sem="acquire")
        spins += 1
    tl.debug_barrier()


@triton.jit
def _simt_rows(acc, acc3, wp, sp, wp3, sp3, xp, rows, C: tl.constexpr, NB: tl.constexpr, oa, ob, ws, NA, ws2, NA2,
               TWO: tl.constexpr, CONV: tl.constexpr, WAIT: tl.constexpr, WAIT2: tl.constexpr, TB: tl.constexpr,
               INTERP: tl.constexpr, NW: tl.constexpr):
    """acc [R, NB, 4] += rows `rows` of one kernel-layout matrix ([*, C] logical) times the tokens' activations
    (row offsets oa, ob) over all C columns, NB 32-blocks a step, the next step's weights loaded before this
    step's arithmetic; TWO: acc3 the same for a second matrix (wp3, sp3) on the same activations (w1 and w3:
    one load and conversion of z for both); WAIT: wait for role A (`_wait_a(ws, NA)`, and with WAIT2 also
    `_wait_a(ws2, NA2)`) after the first weight loads and before the first activation load (role B streams w2 while
    role A finishes); NW the program's warps.
    (Measured and lost, docs/NOTES_moe.md: the next step's activations loaded with its weights; the activations
    converted once an item, `zpre`; the weights through tensor descriptors pipelined 2..6 deep, `tma`.)"""
    NS: tl.constexpr = C // 32  # blocks a row
    w, f = _simt_load(wp, sp, rows, 0, C, NB)
    w3, f3 = w, f
    if TWO:
        w3, f3 = _simt_load(wp3, sp3, rows, 0, C, NB)
    if WAIT:
        _wait_a(ws, NA)
        if WAIT2:
            _wait_a(ws2, NA2)
    for c0 in range(0, NS, NB):
        blk = c0 + tl.arange(0, NB)
        nxt = tl.minimum(c0 + NB, NS - NB)  # the last step reloads itself (an L1/L2 hit)
        wn, fn = _simt_load(wp, sp, rows, nxt, C, NB)
        w3n, f3n = wn, fn
        if TWO:
            w3n, f3n = _simt_load(wp3, sp3, rows, nxt, C, NB)
        xa0, xa1, xa2, xa3 = _xparts(xp, oa, blk, CONV, INTERP)
        xb0, xb1, xb2, xb3 = xa0, xa1, xa2, xa3
        if TB >= 2:
            xb0, xb1, xb2, xb3 = _xparts(xp, ob, blk, CONV, INTERP)
        acc = _simt_acc(w, _factor(f), acc, xa0, xa1, xa2, xa3, xb0, xb1, xb2, xb3, TB, INTERP, NW)
        if TWO:
            acc3 = _simt_acc(w3, _factor(f3), acc3, xa0, xa1, xa2, xa3, xb0, xb1, xb2, xb3, TB, INTERP, NW)
        w, f, w3, f3 = wn, fn, w3n, f3n
    return acc, acc3


@triton.jit
def _simt_group(idx, wk, p, B, K: tl.constexpr, KP: tl.constexpr, BB: tl.constexpr, ONE: tl.constexpr):
    """`_group`, or at batch 1 (ONE) pair p as a group of its own: one token's top-k ids are its experts, so every
    pair leads (a repeated id in a row then adds its expert twice, each with its own weight: the same sum), and the
    id tile, its compares and reductions are skipped."""
    if ONE:
        z = tl.zeros([BB], tl.int32)
        return tl.load(idx + p).to(tl.int64), p >= 0, z, z.to(tl.float32), z, 1, z
    else:
        return _group(idx, wk, p, B, K, KP, BB)


@triton.jit
def _simt_members(t0, mem, rank, w_tok, q_tok, wk, p, BB: tl.constexpr, TB: tl.constexpr, ONE: tl.constexpr):
    """Members t0 .. t0+TB-1 of a group in four slots (slots >= TB invalid): token, weight, pair, validity (ONE:
    `_simt_group`'s group of one, token 0 with pair p's weight)."""
    if ONE:
        s4 = tl.arange(0, 4)
        return s4 * 0, tl.where(s4 == 0, tl.load(wk + p), 0.0), s4 * 0 + p, s4 < 1
    else:
        tok, w_t, q, ok = _slots(t0, mem, rank, w_tok, q_tok, BB, 4)
        return tok, w_t, q, ok & (tl.arange(0, 4) < TB)


@triton.jit
def _simt_up(zi, idx, wk, w1, w3, s1, s3, act, p, n, B, L: tl.constexpr, I: tl.constexpr, K: tl.constexpr,
             KP: tl.constexpr, BB: tl.constexpr, BN: tl.constexpr, NB: tl.constexpr, TB: tl.constexpr,
             B1: tl.constexpr, B2: tl.constexpr, INTERP: tl.constexpr, NW: tl.constexpr, ONE: tl.constexpr):
    """Role A, item (pair p, row tile n): if p leads its expert's group, act[q, rows] = 2^6 wk * situ(W1 z, W3 z)
    (f16) for each member pair q (token z, routing weight wk), TB members a pass."""
    e, leader, mem, w_tok, q_tok, cnt, rank = _simt_group(idx, wk, p, B, K, KP, BB, ONE)
    if leader:
        # every row starts 16-byte aligned (L % 32 == 0): one 16-byte load per row and block (the hint sits on
        # the pointer's defining op; on a function argument it would be lost)
        w1e = tl.multiple_of(w1 + e * (I * (L // 8)), 16)
        w3e = tl.multiple_of(w3 + e * (I * (L // 8)), 16)
        s1e, s3e = s1 + e * (I * (L // 32)), s3 + e * (I * (L // 32))
        rows = n * BN + tl.arange(0, BN)
        for t0 in range(0, cnt, TB):
            tok, w_t, q, ok = _simt_members(t0, mem, rank, w_tok, q_tok, wk, p, BB, TB, ONE)
            offs = tl.where(ok, tok, 0) * (L // 2)
            g, u = _simt_rows(tl.zeros([BN, NB, 4], tl.float32), tl.zeros([BN, NB, 4], tl.float32), w1e, s1e, w3e,
                              s3e, zi, rows, L, NB, _slot(offs, 0), _slot(offs, 1), zi, 0, zi, 0, True, True, False,
                              False, TB, INTERP, NW)
            a = _situ(tl.sum(g, axis=1), tl.sum(u, axis=1), B1, B2) * (w_t * 64.0)[None, :]  # [BN, 4]
            tl.store(act + q[None, :] * I + rows[:, None], a.to(tl.float16), mask=ok[None, :])


@triton.jit
def _simt_down(idx, wk, w2, s2, acti, y, ws, NA, ws2, NA2, p, lt, B, L: tl.constexpr, I: tl.constexpr,
               K: tl.constexpr, KP: tl.constexpr, BB: tl.constexpr, BL: tl.constexpr, NB2: tl.constexpr,
               TB: tl.constexpr, INTERP: tl.constexpr, NW: tl.constexpr, ONE: tl.constexpr, WAIT2: tl.constexpr):
    """Role B, item (pair p, latent tile lt): if p leads, y[b, lr] += W2_e[lr, :] act[q_b, :] for each member
    (token b, pair q_b), fp32 atomics; it waits for role A (counter ws reaching NA, and with WAIT2 ws2 reaching
    NA2) before reading act."""
    e, leader, mem, w_tok, q_tok, cnt, rank = _simt_group(idx, wk, p, B, K, KP, BB, ONE)
    if leader:
        w2e, s2e = tl.multiple_of(w2 + e * (L * (I // 8)), 16), s2 + e * (L * (I // 32))
        lr = lt * BL + tl.arange(0, BL)
        for t0 in range(0, cnt, TB):
            tok, w_t, q, ok = _simt_members(t0, mem, rank, w_tok, q_tok, wk, p, BB, TB, ONE)
            offs = tl.where(ok, q, p) * (I // 2)  # an empty slot reads the leader's own row (written)
            o, o3 = _simt_rows(tl.zeros([BL, NB2, 4], tl.float32), tl.zeros([BL, NB2, 4], tl.float32), w2e, s2e, w2e,
                               s2e, acti, lr, I, NB2, _slot(offs, 0), _slot(offs, 1), ws, NA, ws2, NA2, False,
                               False, True, WAIT2, TB, INTERP, NW)
            tl.atomic_add(y + tok[None, :] * L + lr[:, None], tl.sum(o, axis=1), mask=ok[None, :], sem="relaxed")


@triton.jit
def _simt_leaders_kernel(idx, first, lead, P, PB: tl.constexpr, BIG: tl.constexpr, PDL: tl.constexpr):
    """One program: the pairs that lead their expert's group (the first pair that chose it), listed in pair order
    in lead[1:], their count in lead[0]. first [E] int32 holds BIG between calls: each pair's atomic minimum there,
    read back after a barrier (a second minimum returns the settled value), then reset by the leaders."""
    pdl_enter(PDL)
    p = tl.arange(0, PB)
    ok = p < P
    e = tl.load(idx + p, mask=ok, other=0)
    tl.atomic_min(first + e, p, mask=ok, sem="relaxed")
    tl.debug_barrier()  # bar.sync: the minima above are performed for every thread of the program
    cur = tl.atomic_min(first + e, p, mask=ok, sem="relaxed")
    led = ok & (cur == p)
    tl.debug_barrier()
    tl.atomic_xchg(first + e, BIG, mask=led, sem="relaxed")
    n = led.to(tl.int32)
    tl.store(lead + tl.cumsum(n, axis=0), p, mask=led)  # leader j at lead[1 + j]
    tl.store(lead, tl.sum(n, axis=0))


@triton.jit
def _moe_simt_kernel(z, idx, wk, w1, w3, w2, s1, s3, s2, y, act, acti, ws, lead, B, NA, NITEMS, NPROG,
                     L: tl.constexpr, I: tl.constexpr, K: tl.constexpr, KP: tl.constexpr, BB: tl.constexpr,
                     BN: tl.constexpr, NB: tl.constexpr, BL: tl.constexpr, NB2: tl.constexpr, TB: tl.constexpr,
                     B1: tl.constexpr, B2: tl.constexpr, INTERP: tl.constexpr, NW: tl.constexpr,
                     ONE: tl.constexpr, LEAD: tl.constexpr, PDL: tl.constexpr, PER_EXPERT: tl.constexpr):
    """The gemv kernel's two roles and ticket order (`_moe_gemv_kernel`) with the SIMT bodies: NA role-A items
    (pairs x I/BN row tiles; y zeroed) then role-B items (pairs x L/BL latent tiles), NITEMS in all. Each of the
    NPROG programs takes tickets until none is left (NPROG = NITEMS: one item each; fewer: persistent). ws as
    there, [64] counting programs done. LEAD: the items run over the leaders `_simt_leaders_kernel` listed
    (their count read here: NA and NITEMS shrink to it) instead of over every pair. PDL: launched with
    programmatic dependent launch (every weight read depends on the routing, so nothing is read before the wait).
    PER_EXPERT (the `wait` knob "expert"): a B item waits only for its own pair's I/BN A items (ws[96 + p], each A
    item adds one) and for the A items that zeroed y (ws[32], the first NZ tickets), not for every A item, so the
    experts whose A items ended early stream their w2 while the last A items run; the last program zeroes the
    pairs' counters with the three others."""
    pdl_enter(PDL)
    na = NA
    nitems = NITEMS
    if LEAD:
        nl = tl.load(lead)
        na = nl * (I // BN)
        nitems = na + nl * (L // BL)
    nz = tl.minimum(na, (B * L + 1023) // 1024)  # the A items that zero a part of y (tickets 0 .. nz-1)
    t = tl.atomic_add(ws, 1, sem="relaxed")
    while t < nitems:
        if t < na:
            zc = t * 1024 + tl.arange(0, 1024)
            for z0 in range(0, B * L, na * 1024):
                tl.store(y + z0 + zc, tl.zeros([1024], tl.float32), mask=z0 + zc < B * L)
            if PER_EXPERT:
                if t < nz:
                    tl.debug_barrier()
                    tl.atomic_add(ws + 32, 1, sem="release")
            pa = t // (I // BN)
            if LEAD:
                pa = tl.load(lead + 1 + pa)
            _simt_up(z, idx, wk, w1, w3, s1, s3, act, pa, t % (I // BN), B, L, I, K, KP, BB, BN, NB,
                     TB, B1, B2, INTERP, NW, ONE)
            tl.debug_barrier()
            if PER_EXPERT:
                tl.atomic_add(ws + 96 + pa, 1, sem="release")
            else:
                tl.atomic_add(ws + 32, 1, sem="release")
        else:  # waits for role A inside, after its first weight loads
            tb = t - na
            pb = tb // (L // BL)
            if LEAD:
                pb = tl.load(lead + 1 + pb)
            if PER_EXPERT:
                _simt_down(idx, wk, w2, s2, acti, y, ws + 32, nz, ws + 96 + pb, I // BN, pb, tb % (L // BL), B, L,
                           I, K, KP, BB, BL, NB2, TB, INTERP, NW, ONE, True)
            else:
                _simt_down(idx, wk, w2, s2, acti, y, ws + 32, na, ws + 32, na, pb, tb % (L // BL), B, L, I, K, KP,
                           BB, BL, NB2, TB, INTERP, NW, ONE, False)
        t = tl.atomic_add(ws, 1, sem="relaxed")
    if tl.atomic_add(ws + 64, 1, sem="acq_rel") == NPROG - 1:
        tl.atomic_xchg(ws, 0)
        tl.atomic_xchg(ws + 32, 0)
        tl.atomic_xchg(ws + 64, 0)
        if PER_EXPERT:  # every pair's counter (B * K of them; LEAD counts by the leader's pair index too)
            for c0 in range(0, B * K, 1024):
                cc = c0 + tl.arange(0, 1024)
                tl.store(ws + 96 + cc, tl.zeros([1024], tl.int32), mask=cc < B * K)


@triton.jit
def _simt_dequant_kernel(w, s, out, C: tl.constexpr, INTERP: tl.constexpr):
    """Row r of a kernel-layout matrix [R, C] through the SIMT path's decode and block factor (tests): out[r, c]
    = decoded * 2^14 * 2^(s - 127) in fp32 at the natural column c."""
    r = tl.program_id(0)
    nb = tl.arange(0, C // 32)
    words = tl.load(w + r * (C // 8) + nb[:, None] * 4 + tl.arange(0, 4)[None, :])  # [NB, 4]
    f = (((tl.load(s + r * (C // 32) + nb).to(tl.int32) + 14) << 23).to(tl.float32, bitcast=True))[:, None]
    d0, d1, d2, d3 = _simt_decode(words, INTERP)
    o = out + r * C + nb[:, None] * 32 + 2 * tl.arange(0, 4)[None, :]  # word j part p: column 32 b + 2 (4 p + j)
    _store_pair(o, d0, f)
    _store_pair(o + 8, d1, f)
    _store_pair(o + 16, d2, f)
    _store_pair(o + 24, d3, f)


@triton.jit
def _store_pair(o, d, f):
    lo, hi = _f16x2_f32(d)
    tl.store(o, lo * f)
    tl.store(o + 1, hi * f)


def mxfp4_dequant_simt(words: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """Kernel-layout words [R, C/8] int32 + scales [R, C/32] uint8 -> [R, C] fp32 through the SIMT path's
    decode (C a power of two >= 32)."""
    R, C = words.shape[0], words.shape[1] * 8
    out = torch.empty(R, C, dtype=torch.float32, device=words.device)
    _simt_dequant_kernel[(R,)](words.contiguous(), scales.contiguous(), out, C=C, INTERP=dot_f32())
    return out


def _pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


GEMV_MAX_BATCH = 16
SIMT_MAX_BATCH = 64
SIMT_TOKENS = (1, 2)
SIMT_WAITS = ("all", "expert")  # what a simt role-B item waits for (`_moe_simt_kernel`'s PER_EXPERT)
SIMT_LEADERS_FROM = 16  # from this batch, tickets over the leaders only (`_simt_leaders_kernel`; default_blocks)
LEAD_BIG = 1 << 30
PATHS = ("gemv", "grouped", "simt", "tc")


def default_path(B: int, fmt: str) -> str:
    """The path the H200 sweeps chose (docs/NOTES_moe.md, eighth and ninth sessions): MXFP4 runs the simt kernel
    up to 64 tokens (it loses only where many tokens share an expert: 8 same16), fp8 the two-role gemv kernel up to
    16 tokens, bf16 never; MXFP4 above 64 tokens the tc path (nineteenth session, moe_tc.json.gz, retired: git
    history at b82bd1c; it loses to simt at 8..64); everything else the grouped kernel."""
    if fmt == "fp8" and B <= GEMV_MAX_BATCH:
        return "gemv"
    if fmt == "mxfp4":
        return "simt" if B <= SIMT_MAX_BATCH else "tc"
    return "grouped"


def default_blocks(B: int, K: int, I: int, L: int, fmt: str, path: str | None = None) -> dict:
    """The kernels' tile choice, from the H200 sweeps (docs/NOTES_moe.md).
    simt: BN = 16 intermediate rows an A item, NB = 16 32-blocks a step (block_k 512), BL = 128 latent rows a B
    item (256 at batch 1: sixteenth session's moe_items.json.gz, git history at 9d3aa7c), 4 of w2's blocks a
    step, one token a pass at batch 1 (else two), 8 warps at batch 1 (4 to 64 tokens lose at 8), else 4, one item a
    program at batch 1
    (else persistent, 4 programs a multiprocessor, registers capped at 128 a thread so that the four fit: 190
    uncapped at two tokens a pass, two programs an SM); the weight steps are register double-buffered in the
    kernel (num_stages is not used); from batch 16 (`SIMT_LEADERS_FROM`) a one-program prologue lists the groups'
    leaders and the tickets run over them only (`leaders`; with the 2D word loads batch 2..8 lose, 16..64 gain);
    a role-B item waits for its own expert's role-A items from batch 2 (`wait` "expert"; "all" at batch 1, where its
    last experts' few w2 items would run alone at the end; seventeenth session's moe_wait.json.gz (retired for room,
    git history at 93364f5)).
    gemv: BN = 32 intermediate rows an A item (bf16 16), BK latent columns a step (fp8 512 at batch 1, else 256;
    MXFP4 512; bf16 256), BL latent rows a B item (bf16 128, else 64), BI = 128 intermediate columns a step,
    4 warps, 3 stages (Triton's software pipeline keeps the next two chunks' loads in flight).
    grouped: BN = 64 intermediate rows a program (bf16 and MXFP4 at every batch; fp8 32 at batch <= 4), BK
    (bf16 128, fp8 and MXFP4 256), BL = 128 rows of w2 a step, BT = 16 tokens a tile, 4 warps (MXFP4 8), 3 stages
    (bf16 4: 144 KB of shared memory, one program an SM; faster than 3 at every measured batch and routing, block_n
    32 lost, 128 with 4 stages does not fit: docs/NOTES_moe.md, fortieth section, measured on an H100 only)."""
    path = path or default_path(B, fmt)
    if path == "simt":  # MXFP4: NB 32-blocks a step in w1/w3 rows, NB2 in w2's rows
        nb = 16
        while (L // 32) % nb:
            nb //= 2
        nb2 = 4
        while (I // 32) % nb2:
            nb2 //= 2
        bl = min(256 if B == 1 else 128, L & -L)
        return dict(block_n=min(16, I), block_k=32 * nb, block_l=bl, block_t=1 if B == 1 else 2,
                    num_warps=8 if B == 1 else 4, num_stages=1, block_i=32 * nb2, persist=0 if B == 1 else 4,
                    maxnreg=None if B == 1 else 128, leaders=B >= SIMT_LEADERS_FROM,
                    wait="all" if B == 1 else "expert")
    if path == "tc":  # BN 64 (two w2 blocks); one 32-block a step (128 lost); the leaders' list (twentieth
        # session's moe_tc3.json.gz, git history at b82bd1c; block_l 32 lost)
        bl = 128
        while L % bl:
            bl //= 2
        return dict(block_n=64, block_k=32, block_l=bl, block_t=16, num_warps=4, num_stages=3, leaders=True)
    if path == "gemv":
        bn = min(16 if fmt == "bf16" else 32, I)
        bk = {"bf16": 256, "fp8": 512 if B == 1 else 256}[fmt]
        while L % bk:
            bk //= 2
        bl = min(128 if fmt == "bf16" else 64, L & -L)
        return dict(block_n=bn, block_k=bk, block_l=bl, block_t=16, num_warps=4, num_stages=3,
                    block_i=min(128, I & -I))
    bn = min(32 if (fmt == "fp8" and B <= 4) else 64, I)
    bk = {"bf16": 128, "fp8": 256, "mxfp4": 256}[fmt]
    while L % bk:
        bk //= 2
    bl = 128
    while L % bl:
        bl //= 2
    return dict(block_n=bn, block_k=bk, block_l=bl, block_t=16, num_warps=8 if fmt == "mxfp4" else 4,
                num_stages=4 if fmt == "bf16" else 3)


_workspaces: dict[tuple, tuple[torch.Tensor, torch.Tensor]] = {}
_sms: dict[str, int] = {}


def _sm_count(device) -> int:
    """Multiprocessors of `device` (the persistent simt grid's unit; 4 under the interpreter)."""
    key = str(device)
    if key not in _sms:
        dev = torch.device(device)
        _sms[key] = torch.cuda.get_device_properties(dev).multi_processor_count if dev.type == "cuda" else 4
    return _sms[key]


_pack4_seen: dict[str, list] = {}


def pack4_layout_problems(ttgir: str) -> list:
    """The operands of the packed (pack=4) inline-PTX calls in a compiled kernel's TTGIR whose layout does not give
    each thread a block's four words in four consecutive registers (sizePerThread along the words a multiple of 4,
    the words the fastest dimension). pack=4 groups a thread's registers four by four, so such a layout makes wrong
    sums: Triton 3.6 chose sizePerThread [1, 1, 1] for the w1/w3 tile at 2 warps (H200: every check failed, twelfth
    session). Empty when every packed operand is laid out as the call assumes."""
    defs = dict(re.findall(r"^(#\w+) = (.*)$", ttgir, flags=re.M))
    bad = []
    for line in ttgir.splitlines():
        if "elementwise_inline_asm" not in line or "packed_element = 4" not in line:
            continue
        for shape, enc in sorted(set(re.findall(r"tensor<([^>]*?),\s*(#\w+)>", line))):
            m = re.search(r"sizePerThread = \[([\d, ]+)\].*order = \[([\d, ]+)\]", defs.get(enc, ""))
            spt = [int(v) for v in m.group(1).split(",")] if m else None
            order = [int(v) for v in m.group(2).split(",")] if m else None
            if spt is None or spt[-1] % 4 or order[0] != len(spt) - 1:
                bad.append((shape, defs.get(enc, enc)[:160]))
    return bad


def _require_pack4_layout(k, knobs: dict) -> None:
    """After a simt launch: refuse (RuntimeError naming the knobs) a compiled kernel whose packed operands are not
    laid out as the PTX assumes (`pack4_layout_problems`; checked once per compiled kernel; nothing to check under
    the interpreter, which has no layouts)."""
    asm = getattr(k, "asm", None)
    if not asm or "ttgir" not in asm:
        return
    key = getattr(k, "hash", None) or str(id(k))
    if key not in _pack4_seen:
        _pack4_seen[key] = pack4_layout_problems(asm["ttgir"])
    if _pack4_seen[key]:
        raise RuntimeError(f"moe_experts (simt): the compiled layout splits a block's four words across threads, so "
                           f"the packed PTX would sum the wrong words; refused for {knobs} (Triton "
                           f"{triton.__version__}): {_pack4_seen[key][:2]}. Use 4 or 8 warps or the default tiles.")


_leader_ws: dict[tuple, tuple[torch.Tensor, torch.Tensor]] = {}


def _leaders(device, E: int, pairs: int) -> tuple[torch.Tensor, torch.Tensor]:
    """`_simt_leaders_kernel`'s buffers on `device`: first [E] int32 (LEAD_BIG between calls: the kernel resets
    what it used) and lead [1 + pairs] (count, then the leaders). Kept per device and size; make the first call
    outside a CUDA graph capture."""
    key = (str(device), E, _pow2(pairs))
    if key not in _leader_ws:
        _leader_ws[key] = (torch.full((E,), LEAD_BIG, dtype=torch.int32, device=device),
                           torch.zeros(1 + _pow2(pairs), dtype=torch.int32, device=device))
    return _leader_ws[key]


def workspace(device, pairs: int, I: int, dtype: torch.dtype, path: str = "gemv") -> tuple[torch.Tensor, torch.Tensor]:
    """The two-role paths' scratch on `device`: counters (int32, zero between calls: the kernel's last program
    resets them) + the gemv path's leader flags (rewritten every call, not reset) or the simt path's per-pair
    counters (reset), so each path has its own, and the activations [pairs, 16, I]. Kept per device, path and size,
    so make the first call outside a CUDA graph capture; calls on one device must not overlap (one stream)."""
    key = (str(device), path, _pow2(pairs), I, dtype)
    if key not in _workspaces:
        ws = torch.zeros(96 + _pow2(pairs), dtype=torch.int32, device=device)
        act = torch.empty(_pow2(pairs), GEMV_MAX_BATCH, I, dtype=dtype, device=device)
        _workspaces[key] = (ws, act)
    return _workspaces[key]


def moe_experts(z: torch.Tensor, idx: torch.Tensor, wk: torch.Tensor, w1: torch.Tensor, w3: torch.Tensor,
                w2: torch.Tensor, y: torch.Tensor, *, fmt: str, s1=None, s3=None, s2=None, b1: float = 4.0,
                b2: float = 25.0, path: str | None = None, block_n: int | None = None, block_k: int | None = None,
                block_l: int | None = None, block_t: int | None = None, num_warps: int | None = None,
                num_stages: int | None = None, persist: int | None = None, maxnreg: int | None = None,
                leaders: bool | None = None, pdl: bool | None = None, wait: str | None = None) -> torch.Tensor:
    """y [B, L] fp32 = the routed experts' sum (module docstring). Arguments are validated by
    k3lab.components.moe.experts; `path` None takes `default_path`. pdl (simt path): launched with programmatic
    dependent launch (None: the enclosing pdl.pdl_chain's setting; the other paths launch plainly). wait (simt
    path): what a role-B item waits for, "all" the role-A items or its own "expert"'s (`_moe_simt_kernel`; None:
    `default_blocks`)."""
    B, K = idx.shape
    L = z.shape[1]
    I = w1.shape[1]
    path = path or default_path(B, fmt)
    d = default_blocks(B, K, I, L, fmt, path)
    bn, bk, bl = block_n or d["block_n"], block_k or d["block_k"], block_l or d["block_l"]
    nw, ns = num_warps or d["num_warps"], num_stages or d["num_stages"]
    dummy = torch.empty(1, dtype=torch.float32, device=z.device)
    sc = [t if t is not None else dummy for t in (s1, s3, s2)]
    common = dict(L=L, I=I, K=K, KP=_pow2(K), FMT=FORMATS.index(fmt), BN=bn, BK=bk, BL=bl, B1=float(b1),
                  B2=float(b2), num_warps=nw, num_stages=ns)
    if path == "simt":
        pdl = chain_pdl(pdl)
        ws, act = workspace(z.device, B * K, I, torch.float16, "simt")
        na = B * K * (I // bn)
        nitems = na + B * K * (L // bl)
        per_sm = persist if persist is not None else d["persist"]
        nprog = min(nitems, per_sm * _sm_count(z.device)) if per_sm else nitems
        cap = maxnreg if maxnreg is not None else d["maxnreg"]
        extra = {} if cap is None or dot_f32() else dict(maxnreg=cap)  # the interpreter takes no register cap
        lead_on = d["leaders"] if leaders is None else leaders
        lead = ws  # unread unless lead_on
        if lead_on:
            first, lead = _leaders(z.device, w1.shape[0], B * K)
            _simt_leaders_kernel[(1,)](idx, first, lead, B * K, PB=_pow2(B * K), BIG=LEAD_BIG, PDL=pdl, num_warps=4,
                                       **launch_kw(pdl))
        k = _moe_simt_kernel[(nprog,)](z.view(torch.int32), idx, wk, w1, w3, w2, *sc, y, act, act.view(torch.int32), ws,
                                   lead, B, na, nitems, nprog, L=L, I=I, K=K, KP=_pow2(K), BB=max(16, _pow2(B)), BN=bn,
                                   NB=bk // 32, BL=bl, NB2=d["block_i"] // 32, TB=block_t or d["block_t"],
                                   B1=float(b1), B2=float(b2), INTERP=dot_f32(), NW=nw,
                                   ONE=B == 1 and not lead_on, LEAD=lead_on, PDL=pdl,
                                   PER_EXPERT=(wait or d["wait"]) == "expert", num_warps=nw,
                                   num_stages=1, **extra, **launch_kw(pdl))
        _require_pack4_layout(k, dict(B=B, block_n=bn, block_k=bk, block_l=bl, num_warps=nw))
        return y
    if path == "gemv":
        ws, act = workspace(z.device, B * K, I, torch.bfloat16 if fmt == "bf16" else torch.float16)
        na = B * K * (I // bn)
        nprog = na + B * K * (L // bl)
        _moe_gemv_kernel[(nprog,)](z, idx, wk, w1, w3, w2, *sc, y, act, ws, B, na, nprog, BB=GEMV_MAX_BATCH,
                                   BI=d["block_i"], INTERP=dot_f32(), **common)
        return y
    if path == "tc":
        y.zero_()
        lead = y  # unread unless leaders
        leaders = d["leaders"] if leaders is None else leaders
        if leaders:
            first, lead = _leaders(z.device, w1.shape[0], B * K)
            _simt_leaders_kernel[(1,)](idx, first, lead, B * K, PB=_pow2(B * K), BIG=LEAD_BIG, PDL=False, num_warps=4)
        _moe_tc_kernel[(I // 64, B * K)](z, idx, wk, w1, w3, w2, *sc, y, lead, B, L=L, I=I, K=K, KP=_pow2(K),
                                         BB=max(16, _pow2(B)), BN=64, BL=bl, BT=block_t or d["block_t"], B1=float(b1),
                                         B2=float(b2), NBK=bk // 32, LEAD=bool(leaders), INTERP=dot_f32(),
                                         num_warps=nw, num_stages=ns)
        return y
    y.zero_()
    _moe_experts_kernel[(I // bn, B * K)](
        z, idx, wk, w1, w3, w2, *sc, y, B, BB=max(16, _pow2(B)), BT=block_t or d["block_t"], DOT_F32=dot_f32(),
        **common)
    return y
