"""Latent-MoE routed experts for decode in one Triton launch (after zeroing y): the token x top-k pairs grouped by
expert on the device, w1/w3 with SiTU-GLU fused, w2 with the routing weights applied, and the sum over a token's
experts.

    y[b] = sum_k wk[b,k] * W2_e situ(W1_e z[b], W3_e z[b]),   e = idx[b,k]        (fp32 [B, L])
    situ(g, u) = b1 tanh(g/b1) sigmoid(g) * b2 tanh(u/b2)                          (k3lab.ref.situ)

Layout (k3lab.ref.moe.ExpertWeight, one GPU's TP slice; L = latent 3584, I = per-GPU intermediate 384 at TP8):
    z [B, L] bf16; idx [B, K] int32/int64 expert ids; wk [B, K] fp32 routing weights; y [B, L] fp32 (zeroed
    by the launcher, then accumulated with fp32 atomics: the order of a token's K terms is not fixed);
    w1, w3 [E, I, L] and w2 [E, L, I] in one of three formats:
      bf16    the values;
      fp8     e4m3fn values with one fp32 scale per output channel (w1/w3: per row of I, [E, I]; w2: per
              row of L, [E, L]): W = q * s. The scale multiplies the dot product of the row, so the dot runs
              on the exact e4m3 -> bf16 values;
      mxfp4   E2M1 codes packed two per byte along the input dim (element 2i in the low nibble) [E, out, in/2]
              uint8 and one E8M0 scale per 32 inputs [E, out, in/32] uint8 (k3lab.mxfp4): W = e2m1 * 2^(s-127).
              Dequantized in the kernel to bf16, exactly (E2M1 times a power of two has two significant bits):
              the fp16 bit pattern of an E2M1 code is (code&7)<<9 | (code&8)<<12 (= value * 2^-14, subnormals
              included), widened to fp32 and multiplied by 2^(s-113). Exact for s in 2..240 (every result a
              normal fp32; realistic weights sit near s = 120); the H200 has no fp4 maths.

Grouping without a host sync (the step is captured in a CUDA graph): grid (I / BN, B*K). Program (n, p) takes
pair p's expert e = idx[p]; it reads the [B, K] id tile and runs only if p is the first pair that chose e (the
group's leader: every selected expert runs once, however many tokens chose it; the other pairs' programs exit
at once). Its members (the tokens that chose e, at most one pair each) are ranked with a cumsum and taken BT at
a time (a group larger than BT loops, re-reading the expert's rows from L2). For its BN intermediate rows it
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

import torch
import triton
import triton.language as tl

from k3lab_kernels.triton.mla_decode import dot_f32, rne_bf16

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
def _mxfp4_dequant_kernel(q, s, out, C: tl.constexpr, BR: tl.constexpr):
    """The in-kernel dequantization alone (tests: bit-exact against k3lab.mxfp4.unpack_mxfp4)."""
    r = tl.program_id(0) * BR + tl.arange(0, BR)
    q_t = tl.load(q + r[:, None] * (C // 2) + tl.arange(0, C // 2)[None, :])
    s_t = tl.load(s + r[:, None] * (C // 32) + tl.arange(0, C // 32)[None, :])
    w = _mxfp4_tile(q_t, s_t, BR, C)
    tl.store(out + r[:, None] * C + tl.arange(0, C)[None, :], w.to(tl.float32))


def mxfp4_dequant(packed: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """[R, C/2] uint8 + [R, C/32] uint8 -> [R, C] fp32 through the kernels' dequantization (R % 16 == 0)."""
    R, C = packed.shape[0], packed.shape[1] * 2
    out = torch.empty(R, C, dtype=torch.float32, device=packed.device)
    _mxfp4_dequant_kernel[(R // 16,)](packed.contiguous(), scales.contiguous(), out, C=C, BR=16)
    return out


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


def _pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


def default_blocks(B: int, K: int, I: int, L: int, fmt: str) -> dict:
    """The kernel's tile choice, from the H200 sweeps (docs/NOTES_moe.md): BN = 64 intermediate rows a program
    (bf16 and MXFP4 at every batch; fp8 takes 32 at batch <= 4), BK latent columns a step (bf16 128, fp8 and
    MXFP4 256: a [BN, BK] tile of w1 and of w3 in flight per stage, 8-16 KB each), BL = 128 rows of w2 a step,
    BT = 16 tokens a tile, 4 warps (8 for MXFP4, whose dequantized tile lives in registers), 3 stages."""
    bn = min(32 if (fmt == "fp8" and B <= 4) else 64, I)
    bk = {"bf16": 128, "fp8": 256, "mxfp4": 256}[fmt]
    while L % bk:
        bk //= 2
    bl = 128
    while L % bl:
        bl //= 2
    return dict(block_n=bn, block_k=bk, block_l=bl, block_t=16, num_warps=8 if fmt == "mxfp4" else 4,
                num_stages=3)


def moe_experts(z: torch.Tensor, idx: torch.Tensor, wk: torch.Tensor, w1: torch.Tensor, w3: torch.Tensor,
                w2: torch.Tensor, y: torch.Tensor, *, fmt: str, s1=None, s3=None, s2=None, b1: float = 4.0,
                b2: float = 25.0, block_n: int | None = None, block_k: int | None = None,
                block_l: int | None = None, block_t: int | None = None, num_warps: int | None = None,
                num_stages: int | None = None) -> torch.Tensor:
    """y [B, L] fp32 = the routed experts' sum (module docstring). Arguments are validated by
    k3lab.components.moe.experts; this zeroes y and launches the one kernel."""
    B, K = idx.shape
    L = z.shape[1]
    I = w1.shape[1]
    d = default_blocks(B, K, I, L, fmt)
    bn, bk, bl = block_n or d["block_n"], block_k or d["block_k"], block_l or d["block_l"]
    dummy = torch.empty(1, dtype=torch.float32, device=z.device)
    sc = [t if t is not None else dummy for t in (s1, s3, s2)]
    y.zero_()
    _moe_experts_kernel[(I // bn, B * K)](
        z, idx, wk, w1, w3, w2, *sc, y, B, L=L, I=I, K=K, KP=_pow2(K), BB=max(16, _pow2(B)), FMT=FORMATS.index(fmt),
        BN=bn, BK=bk, BL=bl, BT=block_t or d["block_t"], B1=float(b1), B2=float(b2), DOT_F32=dot_f32(),
        num_warps=num_warps or d["num_warps"], num_stages=num_stages or d["num_stages"])
    return y
