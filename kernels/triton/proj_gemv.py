"""Trunk projections in one Triton launch: y_i[B, N_i] = x[B, K] @ W[N, K]^T over the rows of W that
belong to output i (a fused group is ONE weight, the concatenation of the parts' weights by rows), with
fp32 accumulation, an optional per-output-channel fp8 scale and an optional residual epilogue.

    y[b, n] = (sum_k x[b, k] * W[n, k]) * scale[n]  (+ residual[b, n])       stored in out_i's dtype
    out_i[b, n - start_i] = y[b, n]  for start_i <= n < end_i                 (up to MAX_OUTPUTS outputs)

Layout: x [B, K] bf16 with unit stride along K; W [N, K] row-major (nn.Linear), bf16 or float8_e4m3fn;
scale [N] fp32 (fp8 only: W_true[n, :] = W_fp8[n, :] * scale[n], one scale per output channel,
scale = amax|W[n, :]| / 448, so the row's largest entry maps to e4m3's largest finite value); residual
[B, N] (one output only); each out_i [B, N_i] with unit stride along N_i (any row stride: an output can
be a column slice of a wider buffer its consumer reads), bf16 or fp32 (the router's logits).

Three paths (`config`, knob `path`; `default_path` picks by shape), one launch each (two where a second kernel sums
the split-K partials, below):
  * "tma" (bf16 weights with >= 1024 outputs; fp8 with as many from batch 33 over inputs longer than 2048):
    tensor-core tiles whose W [BN, BK] and x [BM, BK] blocks come through the copy engine (tensor descriptors;
    zero-filled past N, M and K), pipelined num_stages deep in shared memory (6 to batch 32, 4 above; capped to
    fit). Split-K: as many K ranges as keep every program resident in ONE wave of the default stages (cap = SMs x
    programs per SM by shared memory). (Spreading the programs evenly over the SMs lost to this rule almost
    everywhere: git history, docs/NOTES_trunk.md.)
    The partials reduced as below.
  * "dot" (fp8 weights but those above, fewer outputs, misaligned operands): the same tiles from pointer loads:
      - small batch (B <= 16): the batch is one 16-row tile (the MMA's smallest N), a program owns BN output
        rows (32, bf16 and fp8 alike) and a range of K (split-K), so even a 576-row projection puts every SM of
        the GPU to work. The
        programs of one output tile write fp32 partials to a workspace; the last to arrive (an atomic counter
        per tile, reset by that program) sums them in split order (deterministic) and runs the epilogue.
      - larger batch (B > 16, up to MAX_BATCH): BM = 32..128-row tiles of the batch over the grid, BN x BK
        weight tiles; split-K only while the tiles alone leave SMs idle; loads 4 stages deep to a batch tile of
        32 (as at small batch), 3 above. From a batch tile of RED_MIN_BM (64) (knob `reduce`, both paths): bf16
        tiles of 64 W rows, one program an SM, and each program stores its partial and lets `_proj_sum_kernel`
        (launched after it with PDL, waiting on griddepcontrol) sum a tile's partials in split order across many
        programs and run the epilogue, instead of the tile's last program alone behind the counter; so too from
        batch 2 where at most RED_MAX_TILES output tiles split K. Few outputs (<= FEW_N): 16-row W tiles. fp8
        at a batch tile of 32 over inputs of at most FP8_SHORT_K: 64-row W tiles in one K range where those give
        half the SMs a program, else 16-row tiles (inputs of at least FP8_NARROW_MIN_K).
    fp8 tiles are widened to bf16 in registers (exact) before the MMA.
  * "rows" (B <= 8; the default at batch 1 for <= 64 outputs): a register GEMV without shared memory or
    split-K: a program owns BN (2..8) rows of W over all of K in chunks of BN*BK = 4096 weights, the next
    chunk's load issued before the current chunk's fp32 FMAs, the batch padded to a power of two as the
    middle axis of a [BN, BP, BK] product reduced along K.
The fp8 scale multiplies the fp32 sum in the shared epilogue.

Input prologues (`prologue`, paths tma and dot; the op that would otherwise run alone before the projection,
one launch saved): each program transforms the x tiles it reads, in fp32, rounded once to bf16 exactly as the
stand-alone kernel rounds them, before the MMA:
  * ("situ", b1, b2): x is [g | u] [M, 2K] (a fused w1/w3 projection's output) and the projection reads
    situ(g, u) (`situ_glu.py`'s formula): the shared experts' and the dense MLP's w2.
  * ("rms", weight [K], eps): x [M, K] bf16 or fp32, the projection reads rms(x) * weight; each program first
    sums its valid rows' squares over all of K (from L2, whole rows a load: one round trip per 8192 values, not
    one per K chunk; docs/NOTES_trunk.md), then scales its own K range: the MoE's routed_norm before Wup and the
    MLA q_norm before Wuq.
  * two input segments (`x2`, `prologue2`): W = [W1 | W2] along K, out = rms(x) W1^T + situ(x2) W2^T: the MoE's
    routed norm + Wup and the shared experts' w2 summed in one launch (the columns below K1 = x's width come
    from x through the rms prologue, the rest from x2 = [g | u] through SiTU; K1 a multiple of the K tile).
With a prologue x is read through pointers (the copy engine cannot transform), W still through the copy engine.

Fused router selection (`select`, batch <= SELECT_MAX_BATCH; the MoE input group, whose output 0 is the router's
fp32 logits [M, E]): the programs that finish a tile of the logits count themselves on a per-batch-tile counter;
the last of the cdiv(E, BN) such tiles runs `router_topk.select_row` for each of the tile's rows (the top-k and
the renormalized weights, the stand-alone kernel's code and tie rule), then resets the counter. One launch
fewer a MoE layer; the selection itself runs in one program, row after row, hence the batch limit.

Floor (bytes, `k3lab.ops.trunk.proj_bytes`): weights N*K*e (e = 2 bf16, 1 fp8, + 4*N for fp8 scales) +
x B*K*2 + outputs B*N*e_out (+ residual B*N*2), at the read bandwidth. The split-K workspace
(SPLIT*B*N*4 written and read back: the batch rows only) stays in L2 and is not counted.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from k3lab_kernels.triton.mla_decode import _pow2, dot_f32, rne_bf16
from k3lab_kernels.triton.pdl import chain_pdl, launch_kw, pdl_enter, pdl_on
from k3lab_kernels.triton.router_topk import select_row
from k3lab_kernels.triton.situ_glu import situ

MAX_OUTPUTS = 6
FP8_F16 = True  # fp8 weights on the dot path as f16 MMAs (`proj(f16=...)`): faster than widening to bf16
# (H200, batch 1 and 8, TP8 kda_q / kda_o / moe_down: profiles/h200/trunk_fp8.json.gz, git history at 3bae41e)
SELECT_MAX_BATCH = 16  # the fused router selection (one program selects for every row of its batch tile)
SMALL_BATCH = 16  # up to this batch: the split-K GEMV configuration
MAX_BATCH = 1024  # the batch tiles over the grid; 1024 rows cover a verify of 128 sequences x 8 positions
# per device: split-K arrival counters, always zero between calls. One set for every stream: split-K calls must not
# run concurrently on two streams (the decode step's shared-expert stream runs its w1/w3 beside the routed experts,
# which use counters of their own; a per-stream set would be allocated, and zeroed, inside a graph capture)
_COUNTERS: dict[str, torch.Tensor] = {}


def _counters(device: torch.device, n: int) -> torch.Tensor:
    key = str(device)
    c = _COUNTERS.get(key)
    if c is None or c.numel() < n:
        c = torch.zeros(max(n, 1 << 16), dtype=torch.int32, device=device)
        _COUNTERS[key] = c
    return c


@triton.jit
def _store_out(o, lo, hi, so, y, n, m, M, RNE: tl.constexpr):
    """The rows lo <= n < hi of the [BN, BM] tile y into out[m, n - lo] (row stride so)."""
    msk = (n[:, None] >= lo) & (n[:, None] < hi) & (m[None, :] < M)
    if RNE and o.dtype.element_ty == tl.bfloat16:
        y = rne_bf16(y)
    tl.store(o + m[None, :].to(tl.int64) * so + (n[:, None] - lo), y.to(o.dtype.element_ty), mask=msk)


@triton.jit
def _x_in(x, pw, m, mok, kc, kok, s_xm, K, inv, b1, b2, PRO: tl.constexpr, RNE: tl.constexpr):
    """The [BM, BK] tile of the projection's input at columns kc (kok: inside the range), the prologue
    applied (module docstring) and rounded to bf16 once."""
    p = x + m[:, None].to(tl.int64) * s_xm + kc[None, :]
    msk = mok[:, None] & kok[None, :]
    v = tl.load(p, mask=msk, other=0.0)
    if PRO == 1:
        v = situ(v.to(tl.float32), tl.load(p + K, mask=msk, other=0.0).to(tl.float32), b1, b2)
    if PRO == 2:
        v = v.to(tl.float32) * inv[:, None] * tl.load(pw + kc, mask=kok, other=0.0).to(tl.float32)[None, :]
    if PRO != 0:
        if RNE:
            v = rne_bf16(v)
        v = v.to(tl.bfloat16)
    return v


@triton.jit
def _x_seg(x, x2, pw, m, mok, k0, kk, kok, s_xm, s_x2m, K, K1, inv, b1, b2, PRO: tl.constexpr, RNE: tl.constexpr):
    """The input tile at columns k0 + kk for PRO 1 / 2 (x through its prologue) and 3 (columns below K1 from x
    through the rms prologue, the others from x2 through SiTU; a tile lies in one segment)."""
    if PRO == 3:
        if k0 < K1:
            v = _x_in(x, pw, m, mok, k0 + kk, kok & (k0 + kk < K1), s_xm, K1, inv, b1, b2, 2, RNE)
        else:
            v = _x_in(x2, pw, m, mok, k0 - K1 + kk, kok, s_x2m, K - K1, inv, b1, b2, 1, RNE)
    else:
        v = _x_in(x, pw, m, mok, k0 + kk, kok, s_xm, K, inv, b1, b2, PRO, RNE)
    return v


@triton.jit
def _proj_kernel(x, w, scale, res, ws, cnt,
                 o0, o1, o2, o3, o4, o5, e0, e1, e2, e3, e4, e5, s0, s1, s2, s3, s4, s5,
                 M, N, K, s_xm, s_rm, KSPLIT, pw, b1, b2, eps, x2, s_x2m, K1, rbias, ridx, rwts, rcnt, rscale,
                 NSEG: tl.constexpr, SPLIT: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
                 FP8: tl.constexpr, RES: tl.constexpr, EVEN_K: tl.constexpr, DOT_F32: tl.constexpr,
                 TMA: tl.constexpr, PRO: tl.constexpr, TOPK: tl.constexpr, EP: tl.constexpr, KP: tl.constexpr,
                 KXP: tl.constexpr, RR: tl.constexpr, PDL: tl.constexpr, F16: tl.constexpr = False,
                 RCH: tl.constexpr = 16, RED: tl.constexpr = False, PDL2: tl.constexpr = False):
    """TMA: w (and x without a prologue) are tensor descriptors (blocks [BN, BK] and [BM, BK]; the copy engine
    zero-fills past N, M and K, and the loop's loads are pipelined num_stages deep in shared memory); otherwise
    pointers. PRO: 0 none, 1 SiTU, 2 RMSNorm of x, 3 both as two K segments (x2, K1) (module docstring; b1, b2,
    eps, the norm weight pw). TOPK > 0:
    the fused router selection over output 0 (e0 experts; bias rbias, outputs ridx / rwts, counters rcnt).
    PDL: launched with programmatic dependent launch (waits at the top: an L2 prefetch of the program's W slice
    before the wait measured slower over the step, docs/NOTES_trunk.md)."""
    pid_n = tl.program_id(0)
    pid_m = tl.program_id(1)
    pid_s = tl.program_id(2)
    n = pid_n * BN + tl.arange(0, BN)
    m = pid_m * BM + tl.arange(0, BM)
    nok = n < N
    mok = m < M
    k_lo = pid_s * KSPLIT
    k_hi = tl.minimum(k_lo + KSPLIT, K)
    kk = tl.arange(0, BK)
    pdl_enter(PDL)
    inv = tl.zeros((BM,), dtype=tl.float32)
    if PRO >= 2:  # the valid rows' sums of squares over all of x first, RR whole rows a round trip (one wide load)
        KX = K1 if PRO == 3 else K
        cx = tl.arange(0, KXP)
        rr = tl.arange(0, RR)
        ss = tl.zeros((BM,), dtype=tl.float32)
        m0 = pid_m * BM
        for r0 in range(0, tl.minimum(BM, M - m0), RR):
            rows = m0 + r0 + rr
            v = tl.load(x + rows[:, None].to(tl.int64) * s_xm + cx[None, :],
                        mask=(rows < M)[:, None] & (cx < KX)[None, :], other=0.0).to(tl.float32)
            sr = tl.sum(v * v, axis=1)
            ss += tl.sum(tl.where(tl.arange(0, BM)[:, None] == (r0 + rr)[None, :], sr[None, :], 0.0), axis=1)
        inv = 1.0 / tl.sqrt(ss / KX + eps)
    acc = tl.zeros((BN, BM), dtype=tl.float32)
    if TMA:
        for k0 in range(k_lo, k_hi, BK):
            wt = w.load([pid_n * BN, k0])
            if PRO == 0:
                xt = x.load([pid_m * BM, k0])
            else:
                xt = _x_seg(x, x2, pw, m, mok, k0, kk, (k0 + kk) < k_hi, s_xm, s_x2m, K, K1, inv, b1, b2, PRO,
                            DOT_F32)
            if DOT_F32:
                acc = tl.dot(wt.to(tl.float32), xt.to(tl.float32).T, acc)
            else:
                if FP8:
                    wt = wt.to(tl.bfloat16)
                acc = tl.dot(wt, xt.T, acc)
    else:
        wp = w + n[:, None].to(tl.int64) * K + kk[None, :]
        xp = x + m[:, None].to(tl.int64) * s_xm + kk[None, :]
        for k0 in range(k_lo, k_hi, BK):
            if EVEN_K:
                wt = tl.load(wp + k0, mask=nok[:, None], other=0.0)
                if PRO == 0:
                    xt = tl.load(xp + k0, mask=mok[:, None], other=0.0)
                else:
                    xt = _x_seg(x, x2, pw, m, mok, k0, kk, kk < BK, s_xm, s_x2m, K, K1, inv, b1, b2, PRO, DOT_F32)
            else:
                kok = (k0 + kk) < k_hi
                wt = tl.load(wp + k0, mask=nok[:, None] & kok[None, :], other=0.0)
                if PRO == 0:
                    xt = tl.load(xp + k0, mask=mok[:, None] & kok[None, :], other=0.0)
                else:
                    xt = _x_seg(x, x2, pw, m, mok, k0, kk, kok, s_xm, s_x2m, K, K1, inv, b1, b2, PRO, DOT_F32)
            if DOT_F32:  # the interpreter: exact fp32 products of the same bf16 / e4m3 (/ f16) values
                if F16:
                    xt = xt.to(tl.float16)
                acc += tl.dot(wt.to(tl.float32), tl.trans(xt.to(tl.float32)))
            else:
                if F16:  # fp8 on f16 MMAs: one cvt.rn.f16x2.e4m3x2 per two weights, x rounded to f16
                    acc += tl.dot(wt.to(tl.float16), tl.trans(xt.to(tl.float16)))
                else:
                    if FP8:
                        wt = wt.to(tl.bfloat16)  # Triton 3.6 on sm_90: e4m3x2 -> f16x2, then one cvt a weight
                    acc += tl.dot(wt, tl.trans(xt))
    done = True
    if SPLIT > 1:
        MP = tl.num_programs(1) * BM
        NP = tl.num_programs(0) * BN
        tile = ws + m[None, :].to(tl.int64) * NP + n[:, None]
        valid = mok[None, :]  # the batch rows only (batch 1: one of the tile's 16), so the partials' traffic is B rows
        tl.store(tile + pid_s.to(tl.int64) * MP * NP, acc, mask=valid)
    if SPLIT > 1 and RED:  # the partials are summed by _proj_sum_kernel, launched after this one (with PDL)
        if PDL2:
            tl.extra.cuda.gdc_launch_dependents()
        done = False
    elif SPLIT > 1:
        tl.debug_barrier()  # every thread's partial is stored before the release below
        c = cnt + pid_m * tl.num_programs(0) + pid_n
        old = tl.atomic_add(c, 1, sem="acq_rel")
        done = old == SPLIT - 1
        if done:  # the last program of this output tile: sum the partials in split order, RCH batch columns
            # at a time (every partial's load of a piece in flight together, unrolled; the whole tile at once
            # measured slower at batch 64: docs/NOTES_trunk.md), each piece through the epilogue
            for c0 in tl.static_range(0, BM, RCH):
                mc = pid_m * BM + c0 + tl.arange(0, RCH)
                mcok = mc < M
                pc = ws + mc[None, :].to(tl.int64) * NP + n[:, None]
                a = tl.load(pc, mask=mcok[None, :], other=0.0, cache_modifier=".cg")
                for q in tl.static_range(1, SPLIT):
                    a += tl.load(pc + q * MP * NP, mask=mcok[None, :], other=0.0, cache_modifier=".cg")
                _epilogue(a, n, mc, nok, mcok, M, scale, res, s_rm, o0, o1, o2, o3, o4, o5, e0, e1, e2, e3, e4,
                          e5, s0, s1, s2, s3, s4, s5, NSEG, FP8, RES, DOT_F32)
            tl.atomic_xchg(c, 0)  # the counter is zero again for the next call
    else:
        _epilogue(acc, n, m, nok, mok, M, scale, res, s_rm, o0, o1, o2, o3, o4, o5, e0, e1, e2, e3, e4, e5,
                  s0, s1, s2, s3, s4, s5, NSEG, FP8, RES, DOT_F32)
    if done:
        if TOPK > 0:
            if pid_n * BN < e0:  # a tile of the router's logits: the last of them selects
                tl.debug_barrier()  # every thread's logits are stored before the release below
                c = rcnt + pid_m
                if tl.atomic_add(c, 1, sem="acq_rel") == tl.cdiv(e0, BN) - 1:
                    e = tl.arange(0, EP)
                    ok = e < e0
                    eb = tl.load(rbias + e, mask=ok, other=0.0).to(tl.float32)
                    for r in range(pid_m * BM, tl.minimum(pid_m * BM + BM, M)):
                        select_row(o0 + r * s0, eb, e, ok, ridx + r * TOPK, rwts + r * TOPK, rscale, TOPK, EP, KP,
                                   KP >= 2)  # (r < SELECT_MAX_BATCH: no 64-bit offsets needed)
                    tl.atomic_xchg(c, 0)  # zero again for the next call


@triton.jit
def _epilogue(acc, n, m, nok, mok, M, scale, res, s_rm, o0, o1, o2, o3, o4, o5, e0, e1, e2, e3, e4, e5,
              s0, s1, s2, s3, s4, s5, NSEG: tl.constexpr, FP8: tl.constexpr, RES: tl.constexpr, RNE: tl.constexpr):
    """acc [BN, BM] (rows n of W, batch rows m): the fp8 scale, the residual, the stores into the outputs."""
    if FP8:
        acc = acc * tl.load(scale + n, mask=nok, other=0.0)[:, None]
    if RES:
        r = tl.load(res + m[None, :].to(tl.int64) * s_rm + n[:, None], mask=nok[:, None] & mok[None, :], other=0.0)
        acc += r.to(tl.float32)
    _store_out(o0, 0, e0, s0, acc, n, m, M, RNE)
    if NSEG > 1:
        _store_out(o1, e0, e1, s1, acc, n, m, M, RNE)
    if NSEG > 2:
        _store_out(o2, e1, e2, s2, acc, n, m, M, RNE)
    if NSEG > 3:
        _store_out(o3, e2, e3, s3, acc, n, m, M, RNE)
    if NSEG > 4:
        _store_out(o4, e3, e4, s4, acc, n, m, M, RNE)
    if NSEG > 5:
        _store_out(o5, e4, e5, s5, acc, n, m, M, RNE)


@triton.jit
def _proj_sum_kernel(ws, scale, res, o0, o1, o2, o3, o4, o5, e0, e1, e2, e3, e4, e5, s0, s1, s2, s3, s4, s5,
                     M, N, s_rm, MP, NP, SPLIT: tl.constexpr, NSEG: tl.constexpr, BN: tl.constexpr, BM: tl.constexpr,
                     FP8: tl.constexpr, RES: tl.constexpr, RNE: tl.constexpr, PDL: tl.constexpr):
    """The split-K partials of _proj_kernel (RED) summed in split order (deterministic), [BN, BM] outputs a program,
    then the shared epilogue. Launched right after the projection with PDL: the launch and the programs' start
    overlap its tail, and griddepcontrol.wait holds every read until all its partials are stored."""
    pdl_enter(PDL)
    n = tl.program_id(0) * BN + tl.arange(0, BN)
    m = tl.program_id(1) * BM + tl.arange(0, BM)
    nok = n < N
    mok = m < M
    p = ws + m[None, :].to(tl.int64) * NP + n[:, None]
    msk = mok[None, :] & nok[:, None]
    acc = tl.load(p, mask=msk, other=0.0)
    for q in tl.static_range(1, SPLIT):  # unrolled: every partial's load in flight at once (a runtime loop was
        acc += tl.load(p + q * MP * NP, mask=msk, other=0.0)  # unrolled by 4: SPLIT / 4 round trips to L2)
    _epilogue(acc, n, m, nok, mok, M, scale, res, s_rm, o0, o1, o2, o3, o4, o5, e0, e1, e2, e3, e4, e5,
              s0, s1, s2, s3, s4, s5, NSEG, FP8, RES, RNE)


@triton.jit
def _proj_rows_kernel(x, w, scale, res, o0, o1, o2, o3, o4, o5, e0, e1, e2, e3, e4, e5, s0, s1, s2, s3, s4, s5,
                      M, N, K, s_xm, s_rm,
                      NSEG: tl.constexpr, BP: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
                      FP8: tl.constexpr, RES: tl.constexpr, RNE: tl.constexpr, PDL: tl.constexpr):
    """The rows path (small batch): a program owns BN rows of W over all of K, in chunks of BK held in
    registers (no shared memory, no split-K); the next chunk's load is issued before the current chunk's
    products, so two chunks per program are in flight. y[n, b] = sum over the chunk of W[n, k] * x[b, k]
    as a [BN, BP, BK] product reduced along K (fp32 FMAs; BP = the batch padded to a power of two)."""
    pid = tl.program_id(0)
    n = pid * BN + tl.arange(0, BN)
    m = tl.arange(0, BP)
    nok = n < N
    mok = m < M
    kk = tl.arange(0, BK)
    wp = w + n[:, None].to(tl.int64) * K + kk[None, :]
    xp = x + m[:, None].to(tl.int64) * s_xm + kk[None, :]
    acc = tl.zeros((BN, BP), dtype=tl.float32)
    wt = tl.load(wp, mask=nok[:, None] & (kk < K)[None, :], other=0.0)
    pdl_enter(PDL)  # W's first chunk above, then x
    nk = tl.cdiv(K, BK)
    for i in range(1, nk + 1):
        kn = i * BK
        wn = tl.load(wp + kn, mask=nok[:, None] & ((kn + kk) < K)[None, :], other=0.0)  # past K: nothing read
        kc = kn - BK
        xt = tl.load(xp + kc, mask=mok[:, None] & ((kc + kk) < K)[None, :], other=0.0).to(tl.float32)
        acc += tl.sum(wt.to(tl.float32)[:, None, :] * xt[None, :, :], 2)
        wt = wn
    _epilogue(acc, n, m, nok, mok, M, scale, res, s_rm, o0, o1, o2, o3, o4, o5, e0, e1, e2, e3, e4, e5,
              s0, s1, s2, s3, s4, s5, NSEG, FP8, RES, RNE)


def sm_count(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return 132  # the H200's, so the interpreter runs the same split choices as the GPU


PATHS = ("tma", "dot", "rows")
ROWS_MAX_BATCH = 8  # the rows path takes batches up to this
ROWS_CHUNK = 4096  # W elements a rows-path program holds per chunk (BN x BK)
ROWS_MAX_N = 64  # path None: rows at batch 1 for at most this many output rows (the KDA beta)
# at most this many outputs (the KDA beta: 12 at TP8, 6 at TP16), where x, not W, is most of the bytes: one 16-row W
# tile on the dot path, and on the rows path (batch 1) the whole K in one chunk up to ROWS_WHOLE_K (one round trip
# instead of four; H100, docs/NOTES_trunk.md, forty-fourth session)
FEW_N = 16
ROWS_WHOLE_K = 8192
TMA_MIN_N = 1024  # path None: tma for bf16 weights with at least this many output rows, dot below and for fp8
REDUCES = ("last", "kernel")
RED_MIN_BM = 64  # from this batch tile (batch > 32): the partials summed by a second kernel, dot tiles of 64 W rows
RED_MAX_TILES = 32  # and from batch 2 where at most this many output tiles split K (their last programs would be few)
# bf16, one program an SM (H200, experiments/proj_b64/split2_h200.json.gz; docs/NOTES_trunk.md, forty-third session)
SUM_BN, SUM_BM = 32, 16  # the summing kernel's largest tile (W rows x batch rows); see `sum_tiles`
FP8_SHORT_K = 2048  # fp8 at batch 17..32 (a 32-row batch tile): inputs up to this long take 64-row W tiles in one K
# range where those tiles give at least half the SMs a program (7,168 outputs: kda_o / mla_o at TP8 batch 32, H100,
# profiles/h100-80gb-hbm3/fp8_b64_tiles.json.gz, git history at b23339a; H200, profiles/h200/proj_fp8_47.json.gz;
# the 2,304 / 1,152 outputs of mla_uq left 36 / 18 programs; at batch 64 64-row tiles lose; docs/NOTES_trunk.md)
FP8_NARROW_MIN_K = 128  # ... and where 64-row tiles would leave fewer than half the SMs a program (mla_uq's 2,304 /
# 1,152 outputs, kda_fb's 1,536 / 768), inputs of at least this length take 16-row W tiles: TP8 / TP16 mla_uq at batch
# 32 (H100; cuBLAS still ahead, 64-row tiles behind), profiles/h100-80gb-hbm3/fp8_b32_combo.json.gz (git history at
# `cb373f1`); kda_fb (K = 128), ahead of cuBLAS, profiles/h100-80gb-hbm3/fp8_b32_rule.json.gz, git history at 3ca0ea1
# (1024 before that measurement); docs/NOTES_trunk.md
FP8_LONG_K = 7168  # fp8 on the dot path at batch <= SMALL_BATCH over inputs at least this long: K split until up to
FP8_MORE = 3       # FP8_MORE programs an SM run (the one-wave default leaves ~1.7, each warp issuing every 4.7 cycles:
FP8_MIN_CHUNKS = 7  # instruction latency on few warps), each K range keeping >= FP8_MIN_CHUNKS chunks of BK. H100, TP8,
# batch 1 and 8: moe_down (split 2 -> 4), kda_q (5 -> 8); kda_o (short input) and mla_dkv (split 14 already) keep
# theirs: more splits lose. profiles/h100-80gb-hbm3/fp8_split_small.json.gz (git history at ab6ca59)
FP8_TMA_MIN_BATCH = 33  # fp8 from this batch (a batch tile of 64) over inputs longer than FP8_SHORT_K: path tma, W
# through the copy engine, widened in registers as the MMA's A operand (H100, TP8 batch 33 / 64: moe_down, kda_q ahead;
# TP16's 768-row kda_q ties or loses: profiles/h100-80gb-hbm3/fp8_paths.json.gz, git history at e0d6f9e)
FP8_WIDE_BATCH, FP8_WIDE_MIN_N = 65, 768  # fp8 from batch 65 (a batch tile of 128): tma for >= 768 outputs, short
# inputs too (H100 batch 128: TP8 kda_o, TP16 kda_q, moe_router; the same bundle; docs/NOTES_trunk.md)
RED_BYTES = 256  # a thread's share of the partials in flight while a tile's last program sums them (64 registers)
SMEM_BYTES = 220 * 1024  # shared memory a tma-path SM offers its programs' stages (H200: 228 KB per SM)
TMA_MAX_BOX = 256  # the copy engine's largest box side (elements)


def sum_tiles(M: int, N: int, sms: int) -> tuple[int, int, int]:
    """The summing kernel's tile (W rows, batch rows) and warps: at most SUM_BN x SUM_BM, W rows no more than N
    needs (a power of two), the batch rows halved while fewer than half the SMs would sum (a projection of few
    outputs, e.g. the KDA beta's 12: [16, 1] tiles, 64 programs at batch 64 instead of 4); one warp for a tile of
    at most 64 outputs."""
    bn = min(SUM_BN, _pow2(N))
    bm = SUM_BM
    while bm > 1 and triton.cdiv(N, bn) * triton.cdiv(M, bm) < sms // 2:
        bm //= 2
    return bn, bm, 1 if bn * bm <= 64 else 4


def tma_ok(x: torch.Tensor, w: torch.Tensor) -> bool:
    """The copy engine's rules: 16-byte aligned bases and row strides (x and W)."""
    return (x.data_ptr() % 16 == 0 and w.data_ptr() % 16 == 0
            and (x.stride(0) * x.element_size()) % 16 == 0 and (w.stride(0) * w.element_size()) % 16 == 0)


def _split(tiles: int, chunks: int, split_k, cap: int, more: int = 0) -> int:
    """Default split-K: as many K ranges as keep every program in one wave of `cap` resident programs; `more` (the
    fp8 long-input rule, FP8_LONG_K): up to `more` programs where each K range keeps >= FP8_MIN_CHUNKS chunks."""
    if split_k is None:
        split_k = max(1, min(chunks, cap // max(1, tiles)))
        if more:
            split_k = max(split_k, min(-(-more // max(1, tiles)), chunks // FP8_MIN_CHUNKS))
    return max(1, min(split_k, chunks))


def default_path(M: int, N: int, fp8: bool, tma: bool = True, prologue: bool = False, *, K: int) -> str:
    """The measured rule (docs/NOTES_trunk.md, profiles/h200/trunk_explore2.json.gz, git history at ff8d02f): rows
    at batch 1 for at most ROWS_MAX_N outputs; tma for bf16 weights with at least TMA_MIN_N outputs (faster
    on the 22-51 MB projections at batch 1-8); for fp8 weights with as many outputs from batch
    FP8_TMA_MIN_BATCH over inputs longer than FP8_SHORT_K (K: the input's length), and with at least
    FP8_WIDE_MIN_N outputs from batch FP8_WIDE_BATCH whatever the input; dot for fp8 weights otherwise and fewer
    outputs (MLA kv down) and where the copy engine's alignment rules fail."""
    if M == 1 and N <= ROWS_MAX_N and not prologue:
        return "rows"
    if not tma:
        return "dot"
    if not fp8:
        return "tma" if N >= TMA_MIN_N else "dot"
    if M >= FP8_WIDE_BATCH and N >= FP8_WIDE_MIN_N:
        return "tma"
    return "tma" if M >= FP8_TMA_MIN_BATCH and K > FP8_SHORT_K and N >= TMA_MIN_N else "dot"


def config(M: int, N: int, K: int, device: torch.device, *, path=None, block_n=None, block_k=None, split_k=None,
           num_warps=None, num_stages=None, fp8: bool = False, tma: bool = True, prologue: bool = False,
           reduce=None) -> dict:
    """The launch configuration for batch M (module docstring); any knob given overrides its default.
    path: "tma" (tensor-core tiles fed by the copy engine, split-K sized to one wave), "dot" (the same tiles
    from pointer loads) or "rows" (batch <= ROWS_MAX_BATCH: register GEMV, no split-K); None =
    `default_path` (tma False: the copy engine's alignment rules fail); split_k: the number of K ranges
    (1 = none); num_stages of the tma path is capped so the stages fit SMEM_BYTES; prologue: an input prologue
    runs (paths tma and dot only); reduce: who sums a split-K tile's partials, "last" (its last program, behind an
    atomic counter) or "kernel" (a second kernel launched with PDL; None: "kernel" from a batch tile of RED_MIN_BM,
    or from batch 2 for at most RED_MAX_TILES tiles)."""
    path = path or default_path(M, N, fp8, tma, prologue, K=K)
    if path not in PATHS:
        raise ValueError(f"proj_gemv: path must be one of {PATHS}, got {path!r}")
    if prologue and path == "rows":
        raise ValueError("proj_gemv: an input prologue runs on paths 'tma' and 'dot', not 'rows'")
    if path == "rows":
        if reduce is not None:
            raise ValueError(f"proj_gemv: reduce applies to the split-K paths 'tma' and 'dot', not 'rows' (got "
                             f"reduce={reduce!r})")
        if M > ROWS_MAX_BATCH or split_k not in (None, 1):
            raise ValueError(f"proj_gemv: the rows path takes batch <= {ROWS_MAX_BATCH} and no split_k, got "
                             f"batch {M}, split_k {split_k}")
        BN = block_n or next((b for b in (8, 4) if triton.cdiv(N, b) >= 2 * sm_count(device)), 2)
        BK = min(block_k or (ROWS_WHOLE_K if N <= FEW_N else ROWS_CHUNK // BN), max(16, _pow2(K)))
        BP = max(1, _pow2(M))
        return dict(path=path, BN=BN, BK=BK, BP=BP, num_warps=num_warps or (4 if BP <= 2 else 8),
                    num_stages=num_stages or 1)
    small = M <= SMALL_BATCH
    BM = 16 if small else min(128, max(32, _pow2(M)))
    sms = sm_count(device)
    if path == "tma":
        BN = min(block_n or 64, TMA_MAX_BOX)
        BK = min(block_k or 128, TMA_MAX_BOX, max(16, _pow2(K)))
        stage = BN * BK * (1 if fp8 else 2) + BM * BK * 2
        stages = max(1, min(num_stages or (6 if BM <= 32 else 4), SMEM_BYTES // stage))
        cap = sms * max(1, SMEM_BYTES // (stages * stage))
    else:
        few = N <= FEW_N
        wide = BM >= RED_MIN_BM and not fp8 and not few  # bf16 from a batch tile of 64: 64-row tiles, one program an SM
        # fp8 short inputs at batch 17..32: 64-row tiles in one K range where those give half the SMs a program
        # (short32), else 16-row tiles over inputs of at least FP8_NARROW_MIN_K (narrow32)
        fp8_short = fp8 and BM == 32 and not few and K <= FP8_SHORT_K
        short32 = fp8_short and triton.cdiv(N, 64) * triton.cdiv(M, BM) >= sms // 2
        narrow32 = fp8_short and not short32 and K >= FP8_NARROW_MIN_K
        BN = block_n or (16 if few or narrow32 else 64 if wide or short32 else 32)
        if short32 and split_k is None:
            split_k = 1
        BK = min(block_k or 128, max(16, _pow2(K)))
        stages = num_stages or (4 if BM <= 32 else 3)
        cap = sms if wide else 2 * sms
    tiles = triton.cdiv(N, BN) * triton.cdiv(M, BM)
    chunks = triton.cdiv(K, BK)
    more = FP8_MORE * sms if path == "dot" and fp8 and small and K >= FP8_LONG_K else 0
    ksplit = triton.cdiv(chunks, _split(tiles, chunks, split_k, cap, more)) * BK
    split = triton.cdiv(K, ksplit)
    warps = num_warps or 4
    rchunk = BM  # the last program's sum (reduce "last"): whole tiles to a batch tile of 32; above, pieces of
    while BM > 32 and rchunk > 1 and split * BN * rchunk * 4 > RED_BYTES * 32 * warps:  # RED_BYTES a thread
        rchunk //= 2
    if reduce is None:
        reduce = "kernel" if BM >= RED_MIN_BM or (M >= 2 and tiles <= RED_MAX_TILES) else "last"
    elif reduce not in REDUCES:
        raise ValueError(f"proj_gemv: reduce must be one of {REDUCES}, got {reduce!r}")
    red = reduce == "kernel" and split > 1
    return dict(path=path, BM=BM, BN=BN, BK=BK, SPLIT=split, KSPLIT=ksplit, RCH=rchunk, RED=red,
                SUM=sum_tiles(M, N, sms) if red else None, num_warps=warps, num_stages=stages)


def proj(x: torch.Tensor, w: torch.Tensor, outs: list[torch.Tensor], *, w_scale: torch.Tensor | None = None,
         residual: torch.Tensor | None = None, prologue: tuple | None = None, x2: torch.Tensor | None = None,
         prologue2: tuple | None = None, select: tuple | None = None,
         path: str | None = None,
         block_n: int | None = None, block_k: int | None = None, split_k: int | None = None,
         num_warps: int | None = None, num_stages: int | None = None, pdl: bool | None = None,
         f16: bool | None = None, reduce: str | None = None,
         plan: dict | None = None) -> list:
    """x [M, K] (unit stride along K), w [N, K] contiguous bf16 or float8_e4m3fn (then w_scale [N] fp32),
    outs: 1..MAX_OUTPUTS tensors [M, N_i] with unit inner stride, sum N_i = N, written in place; residual
    [M, N] (one output only) added before the store; prologue None, ("situ", b1, b2) (x then [M, 2K]) or
    ("rms", weight [K], eps); x2 with prologue2 ("situ", b1, b2) and prologue ("rms", weight [K1], eps): the two
    K segments (x [M, K1], x2 [M, 2 (K - K1)]); select None or (e_bias [E] fp32, idx [M, k] int64, weights [M, k]
    fp32, k, scaling): the router selection over outs[0] (fp32 logits [M, E]) fused (module docstring). Returns
    outs. The caller validates (path "tma" with misaligned x or W is refused here: ValueError). pdl: launched with
    programmatic dependent launch (None: the enclosing pdl.pdl_chain's setting). f16 (fp8 weights on the dot path;
    None: FP8_F16): the e4m3 weights widened to f16 (one conversion per two) and x rounded to f16 for f16 MMAs
    (exact for 2^-17 <= |x| < 65520 and 0; beyond 65504 the sum is inf), instead of both in bf16; True with bf16
    weights or on another path is refused (ValueError). plan: a dict the call fills with the configuration it ran
    (path, tiles, K ranges, stages, warps, the reduction), for the caller's record."""
    pdl = chain_pdl(pdl)
    M = x.shape[0]
    N, K = w.shape
    pro = 0 if prologue is None else {"situ": 1, "rms": 2}[prologue[0]]
    pw, b1, b2, eps, K1 = x, 0.0, 0.0, 0.0, K
    if pro == 1:
        b1, b2 = float(prologue[1]), float(prologue[2])
    elif pro == 2:
        pw, eps = prologue[1], float(prologue[2])
    if x2 is not None:
        if pro != 2 or prologue2 is None or prologue2[0] != "situ":
            raise ValueError("proj_gemv: two segments take prologue ('rms', ...) and prologue2 ('situ', ...)")
        pro, K1 = 3, x.shape[1]
        b1, b2 = float(prologue2[1]), float(prologue2[2])
    aligned = tma_ok(x, w) if pro == 0 else tma_ok(w, w)  # with a prologue x is read through pointers
    if path == "tma" and not aligned:
        raise ValueError("proj_gemv: path 'tma' needs 16-byte aligned x, W and row strides; use 'dot' or None")
    if pro == 3:  # a K tile must not straddle the two segments
        block_k = block_k or 128
        while K1 % block_k:
            block_k //= 2
        if block_k < 16:
            raise ValueError(f"proj_gemv: the first segment's width {K1} must be a multiple of 16")
    cfg = config(M, N, K, x.device, path=path, block_n=block_n, block_k=block_k, split_k=split_k,
                 num_warps=num_warps, num_stages=num_stages, fp8=w.dtype == torch.float8_e4m3fn, tma=aligned,
                 prologue=pro != 0, reduce=reduce)
    ends, o = [], list(outs)
    e = 0
    for t in outs:
        e += t.shape[1]
        ends.append(e)
    strides = [t.stride(0) for t in outs]
    while len(o) < MAX_OUTPUTS:
        o.append(outs[0])
        ends.append(e)
        strides.append(0)
    fp8 = w.dtype == torch.float8_e4m3fn
    if f16 and not (fp8 and cfg["path"] == "dot"):
        raise ValueError(f"proj_gemv: f16=True applies to fp8 weights on path 'dot', got {w.dtype} weights on path "
                         f"{cfg['path']!r}")
    f16 = fp8 and cfg["path"] == "dot" and (FP8_F16 if f16 is None else bool(f16))
    sc = w_scale if fp8 else x
    res_t = residual if residual is not None else x
    s_rm = residual.stride(0) if residual is not None else 0
    if select is not None and (cfg["path"] == "rows" or M > SELECT_MAX_BATCH):
        raise ValueError(f"proj_gemv: the fused selection runs on paths 'tma' and 'dot' at batch <= {SELECT_MAX_BATCH}"
                         f", got path {cfg['path']!r}, batch {M}")
    if cfg["path"] == "rows":
        if plan is not None:
            plan.update(cfg)
        _proj_rows_kernel[(triton.cdiv(N, cfg["BN"]),)](
            x, w, sc, res_t, *o, *ends, *strides, M, N, K, x.stride(0), s_rm, NSEG=len(outs), BP=cfg["BP"],
            BN=cfg["BN"], BK=cfg["BK"], FP8=fp8, RES=residual is not None, RNE=dot_f32(), PDL=pdl,
            num_warps=cfg["num_warps"], num_stages=cfg["num_stages"], **launch_kw(pdl))
        return outs
    BM, BN, BK, split = cfg["BM"], cfg["BN"], cfg["BK"], cfg["SPLIT"]
    gn, gm = triton.cdiv(N, BN), triton.cdiv(M, BM)
    ws = torch.empty(split * gm * BM * gn * BN, dtype=torch.float32, device=x.device) if split > 1 else x
    cnt = _counters(x.device, gn * gm + gm) if split > 1 or select is not None else x  # x: unused
    rb, ri, rw, rc, rk, rs = x, x, x, x, 0, 1.0
    if select is not None:
        rb, ri, rw, rk, rs = select[0], select[1], select[2], int(select[3]), float(select[4])
        rc = cnt[gn * gm:]  # the selection's counters after the split-K ones
    kxp = _pow2(K1) if pro >= 2 else 1  # the rms pre-pass: one load of RR whole rows (<= 8192 values) a round trip
    if select is not None and reduce == "kernel":
        raise ValueError("proj_gemv: the fused selection needs reduce 'last' (the last program of a tile selects)")
    red = cfg["RED"] and select is None  # the fused selection counts finished tiles: the last program sums them
    if plan is not None:
        plan.update(cfg, RED=red)
    tma = cfg["path"] == "tma"
    if tma:
        from triton.tools.tensor_descriptor import TensorDescriptor

        xa = TensorDescriptor(x, [M, K], [x.stride(0), 1], [BM, BK]) if pro == 0 else x
        wa = TensorDescriptor(w, [N, K], [w.stride(0), 1], [BN, BK])
    else:
        xa, wa = x, w
    _proj_kernel[(gn, gm, split)](
        xa, wa, sc, res_t, ws, cnt, *o, *ends, *strides, M, N, K, x.stride(0), s_rm, cfg["KSPLIT"], pw, b1, b2, eps,
        x2 if x2 is not None else x, x2.stride(0) if x2 is not None else 0, K1, rb, ri, rw, rc, rs, NSEG=len(outs),
        SPLIT=split, BM=BM, BN=BN, BK=BK, FP8=fp8, RES=residual is not None,
        EVEN_K=K % cfg["KSPLIT"] == 0 and cfg["KSPLIT"] % BK == 0, DOT_F32=dot_f32(), TMA=tma, PRO=pro, TOPK=rk,
        EP=_pow2(outs[0].shape[1]) if rk else 1, KP=_pow2(rk) if rk else 1, KXP=kxp, RR=max(1, min(BM, 8192 // kxp)),
        PDL=pdl, F16=f16, RCH=cfg["RCH"], RED=red, PDL2=red and pdl_on(True),
        num_warps=cfg["num_warps"], num_stages=cfg["num_stages"], **launch_kw(pdl))
    if red:
        sbn, sbm, sw = cfg["SUM"]
        _proj_sum_kernel[(triton.cdiv(N, sbn), triton.cdiv(M, sbm))](
            ws, sc, res_t, *o, *ends, *strides, M, N, s_rm, gm * BM, gn * BN, SPLIT=split, NSEG=len(outs), BN=sbn,
            BM=sbm, FP8=fp8, RES=residual is not None, RNE=dot_f32(), PDL=pdl_on(True), num_warps=sw,
            **launch_kw(True))
    return outs


def quantize_fp8(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """W [N, K] (any float) -> (W_fp8 [N, K] float8_e4m3fn, scale [N] fp32): one scale per output channel,
    amax / 448 (rows of zeros get scale 1)."""
    wf = w.float()
    amax = wf.abs().amax(dim=1)
    scale = torch.where(amax > 0, amax / 448.0, torch.ones_like(amax))
    return (wf / scale[:, None]).clamp(-448, 448).to(torch.float8_e4m3fn), scale.contiguous()


def describe(plan: dict) -> str:
    """One line of what a call ran, from the `plan` it filled (the components' record of the call)."""
    if not plan:
        return ""
    if plan["path"] == "rows":
        return f"path rows, {plan['BN']} W rows x {plan['BK']} columns a chunk, {plan['num_warps']} warps"
    split = plan["SPLIT"]
    red = "" if split == 1 else (f", partials summed by a second kernel ({plan['SUM'][0]} x {plan['SUM'][1]} a program)"
                                 if plan.get("RED") else
                                 ", partials summed by each tile's last program")
    return (f"path {plan['path']}, tiles {plan['BN']} W rows x {plan['BM']} batch rows x {plan['BK']} columns, "
            f"{split} K range{'s' if split > 1 else ''}{red}, {plan['num_stages']} stages, {plan['num_warps']} warps")
