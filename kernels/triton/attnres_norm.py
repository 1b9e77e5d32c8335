"""AttnRes + RMSNorm in one Triton launch: the partial-sum update, the softmax mix over the block list
and the partial, and the RMSNorm of the mix (k3lab.ref.attnres, docs/MODEL.md, The stack).

    p      = prefix                        update "none"   (the attention side: x is the partial)
           = bf16(prefix + a)              update "add"    (p = prefix + a; written to partial_out)
           = a                             update "fresh"  (the first layer of a block: p = a; written)
    score_i = dot(s_i, w_norm * w_proj) / sqrt(mean(s_i^2) + eps)   for s_i in blocks + [p]
    alpha   = softmax(score)                                          over the n + 1 sources
    mix     = sum_i alpha_i s_i                                       fp32, never stored
    out     = mix / sqrt(mean(mix^2) + eps) * norm_w                  out's dtype (bf16)

The updated partial is rounded once to bf16 (fp32 sum of two bf16 values, then round to nearest even:
the same bits as torch's bf16 add) and the mix reads that rounded value, as the layer reference does.

Layout: every source row [B, D] with unit stride along D (D = 7168; the block list as up to MAX_BLOCKS
separate tensors, each with its own row stride); w_norm, w_proj, norm_w [D].

Two paths (knob `path`; None = "split" up to batch SPLIT_MAX_BATCH = 8 with at least SPLIT_MIN_BLOCKS = 5 blocks,
"row" otherwise. Measured crossover by batch at 9 blocks: split ahead at batch 8, row at batch 16; by blocks at
batch 1: split ahead at 9 blocks (trunk bench), row at 0-1 blocks (the decode step's AttnRes of block 0, the eighth
session's two step bundles); 2..8 blocks are not measured, 5 is the midpoint; H200, docs/NOTES_trunk.md):

"row": grid (B,), one program per row (pass 1 streams the sources for their two sums, pass 2 reads them
again from L2 for the mix; 8 warps).

"split": grid (P, B): each row is split over P programs of BLOCK_D columns (default 128: D = 7168 over 56
programs; 256, 512, 1024 give 28, 14, 7), so a batch-1 call puts 56 SMs to work instead of one (block_d
512 and 1024 measured far slower, unexplained: docs/NOTES_trunk.md). A program loads its [16, BLOCK_D] tile of the
sources in one go (the blocks' rows, then p in row n; all loads in flight together) and keeps it in
registers. Every full-D sum the maths needs is a sum over the row's programs of per-program sums:
  * for the scores: sum_d s_i w (sw_i) and sum_d s_i^2;
  * for the norm of the mix: mean(mix^2) = alpha^T G alpha / D with the Gram matrix G_ij = sum_d s_i s_j
    (one 16 x 16 bf16 MMA per program: the products are exact, the sums fp32), so the mix itself never
    needs a second cross-program sum.
Each program writes its 16 + 256 partial sums to a workspace, then the row's programs meet at one
barrier (an arrival counter per row, acq_rel; a departure counter lets the last one reset both, so they
are zero between calls); every program then sums the P partials in the same order (the same alpha and
norm in each, deterministic), mixes its own columns from the registers and writes its slice of out.
The barrier needs the row's P programs resident together: launched in order, a row's programs are
adjacent, so rows complete in order whatever fits on the GPU. Under TRITON_INTERPRET=1 (programs run one
after another) the last program to arrive finishes every program's columns instead of waiting.

Numerics: alpha^T G alpha equals sum_d mix_d^2 up to fp32 rounding of the 16 x 16 sums; the mix is a
convex combination of the sources, so no cancellation beyond what sum mix^2 itself has (checked against
fp64 with the output tolerance 4e-3).

Floor (bytes, `k3lab.ops.trunk.attnres_bytes`): sources (n + 1 + [a given]) * B * D * 2 + the three
weight vectors + out B*D*2 (+ partial_out B*D*2), at the read bandwidth: 9 blocks, "add", batch 1:
0.19 MB (launch-bound); batch 64: 10.1 MB = 2.2 us at 4.6 TB/s.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from k3lab_kernels.triton.mla_decode import _pow2, dot_f32, rne_bf16
from k3lab_kernels.triton.pdl import chain_pdl, launch_kw, pdl_enter

MAX_BLOCKS = 9
UPDATES = ("none", "add", "fresh")
NS = tl.constexpr(16)  # source rows of a program's tile (<= MAX_BLOCKS + 1 used; 16 = the MMA's smallest side)
NPART = tl.constexpr(16 + 16 * 16)  # per-program partial sums: sw [16], G [16, 16]
_COUNTERS: dict[str, torch.Tensor] = {}  # per device: arrival / departure counters per row, zero between calls


def _counters(device: torch.device, n: int) -> torch.Tensor:
    key = str(device)
    c = _COUNTERS.get(key)
    if c is None or c.numel() < n:
        c = torch.zeros(max(n, 1 << 12), dtype=torch.int32, device=device)
        _COUNTERS[key] = c
    return c


@triton.jit
def _src(ptr, s, b, d, dm):
    return tl.load(ptr + b.to(tl.int64) * s + d, mask=dm, other=0.0).to(tl.float32)


@triton.jit
def _score(x, wv, D, eps):
    return tl.sum(x * wv, 0) / tl.sqrt(tl.sum(x * x, 0) / D + eps)


@triton.jit
def _attnres_row_kernel(b0, b1, b2, b3, b4, b5, b6, b7, b8, t0, t1, t2, t3, t4, t5, t6, t7, t8,
                         prefix, new, p_out, w_norm, w_proj, norm_w, out, s_p, s_a, s_po, s_o, D, eps,
                         NB: tl.constexpr, UPDATE: tl.constexpr, DP: tl.constexpr, RNE: tl.constexpr,
                         PDL: tl.constexpr):
    """The row path: one program per row holds p, w_norm * w_proj and the mix ([D] fp32 each) in registers;
    pass 1 streams the blocks for their two sums, pass 2 reads them again (L2) for the mix."""
    b = tl.program_id(0)
    d = tl.arange(0, DP)
    dm = d < D
    wv = (tl.load(w_norm + d, mask=dm, other=0.0).to(tl.float32)
          * tl.load(w_proj + d, mask=dm, other=0.0).to(tl.float32))
    pdl_enter(PDL)  # the weights above, then the rows the kernels before wrote
    if UPDATE == 0:
        p = _src(prefix, s_p, b, d, dm)
    else:
        if UPDATE == 1:
            p = _src(prefix, s_p, b, d, dm) + _src(new, s_a, b, d, dm)
        else:
            p = _src(new, s_a, b, d, dm)
        if RNE:
            p = rne_bf16(p)
        pb = p.to(p_out.dtype.element_ty)
        tl.store(p_out + b.to(tl.int64) * s_po + d, pb, mask=dm)
        p = pb.to(tl.float32)
    jj = tl.arange(0, 16)
    sc = tl.where(jj == NB, _score(p, wv, D, eps), float("-inf"))
    if NB > 0:
        sc = tl.where(jj == 0, _score(_src(b0, t0, b, d, dm), wv, D, eps), sc)
    if NB > 1:
        sc = tl.where(jj == 1, _score(_src(b1, t1, b, d, dm), wv, D, eps), sc)
    if NB > 2:
        sc = tl.where(jj == 2, _score(_src(b2, t2, b, d, dm), wv, D, eps), sc)
    if NB > 3:
        sc = tl.where(jj == 3, _score(_src(b3, t3, b, d, dm), wv, D, eps), sc)
    if NB > 4:
        sc = tl.where(jj == 4, _score(_src(b4, t4, b, d, dm), wv, D, eps), sc)
    if NB > 5:
        sc = tl.where(jj == 5, _score(_src(b5, t5, b, d, dm), wv, D, eps), sc)
    if NB > 6:
        sc = tl.where(jj == 6, _score(_src(b6, t6, b, d, dm), wv, D, eps), sc)
    if NB > 7:
        sc = tl.where(jj == 7, _score(_src(b7, t7, b, d, dm), wv, D, eps), sc)
    if NB > 8:
        sc = tl.where(jj == 8, _score(_src(b8, t8, b, d, dm), wv, D, eps), sc)
    ex = tl.exp(sc - tl.max(sc, 0))
    alpha = ex / tl.sum(ex, 0)
    mix = tl.sum(tl.where(jj == NB, alpha, 0.0), 0) * p
    if NB > 0:
        mix += tl.sum(tl.where(jj == 0, alpha, 0.0), 0) * _src(b0, t0, b, d, dm)
    if NB > 1:
        mix += tl.sum(tl.where(jj == 1, alpha, 0.0), 0) * _src(b1, t1, b, d, dm)
    if NB > 2:
        mix += tl.sum(tl.where(jj == 2, alpha, 0.0), 0) * _src(b2, t2, b, d, dm)
    if NB > 3:
        mix += tl.sum(tl.where(jj == 3, alpha, 0.0), 0) * _src(b3, t3, b, d, dm)
    if NB > 4:
        mix += tl.sum(tl.where(jj == 4, alpha, 0.0), 0) * _src(b4, t4, b, d, dm)
    if NB > 5:
        mix += tl.sum(tl.where(jj == 5, alpha, 0.0), 0) * _src(b5, t5, b, d, dm)
    if NB > 6:
        mix += tl.sum(tl.where(jj == 6, alpha, 0.0), 0) * _src(b6, t6, b, d, dm)
    if NB > 7:
        mix += tl.sum(tl.where(jj == 7, alpha, 0.0), 0) * _src(b7, t7, b, d, dm)
    if NB > 8:
        mix += tl.sum(tl.where(jj == 8, alpha, 0.0), 0) * _src(b8, t8, b, d, dm)
    y = mix / tl.sqrt(tl.sum(mix * mix, 0) / D + eps) * tl.load(norm_w + d, mask=dm, other=0.0).to(tl.float32)
    if RNE:
        y = rne_bf16(y)
    tl.store(out + b.to(tl.int64) * s_o + d, y.to(out.dtype.element_ty), mask=dm)


@triton.jit
def _row(S, r, i: tl.constexpr, ptr, stride, b, d, dm):
    """S with source row i loaded from ptr[b, d] (bf16)."""
    v = tl.load(ptr + b.to(tl.int64) * stride + d, mask=dm, other=0.0)
    return tl.where((r == i)[:, None], v[None, :], S)


@triton.jit
def _tile(b0, b1, b2, b3, b4, b5, b6, b7, b8, t0, t1, t2, t3, t4, t5, t6, t7, t8, prefix, new, p_out,
          s_p, s_a, s_po, r, b, d, dm, WRITE_P: tl.constexpr, NB: tl.constexpr, UPDATE: tl.constexpr,
          BLOCK_D: tl.constexpr, RNE: tl.constexpr):
    """The [NS, BLOCK_D] bf16 tile of sources (blocks in rows 0..NB-1, p in row NB, zeros below; every load
    issued before the first use) and p's columns written to p_out when updated (WRITE_P)."""
    S = tl.zeros((NS, BLOCK_D), dtype=tl.bfloat16)
    if NB > 0:
        S = _row(S, r, 0, b0, t0, b, d, dm)
    if NB > 1:
        S = _row(S, r, 1, b1, t1, b, d, dm)
    if NB > 2:
        S = _row(S, r, 2, b2, t2, b, d, dm)
    if NB > 3:
        S = _row(S, r, 3, b3, t3, b, d, dm)
    if NB > 4:
        S = _row(S, r, 4, b4, t4, b, d, dm)
    if NB > 5:
        S = _row(S, r, 5, b5, t5, b, d, dm)
    if NB > 6:
        S = _row(S, r, 6, b6, t6, b, d, dm)
    if NB > 7:
        S = _row(S, r, 7, b7, t7, b, d, dm)
    if NB > 8:
        S = _row(S, r, 8, b8, t8, b, d, dm)
    if UPDATE == 0:
        pb = tl.load(prefix + b.to(tl.int64) * s_p + d, mask=dm, other=0.0)
    else:
        if UPDATE == 1:
            p = (tl.load(prefix + b.to(tl.int64) * s_p + d, mask=dm, other=0.0).to(tl.float32)
                 + tl.load(new + b.to(tl.int64) * s_a + d, mask=dm, other=0.0).to(tl.float32))
        else:
            p = tl.load(new + b.to(tl.int64) * s_a + d, mask=dm, other=0.0).to(tl.float32)
        if RNE:
            p = rne_bf16(p)
        pb = p.to(tl.bfloat16)
        if WRITE_P:
            tl.store(p_out + b.to(tl.int64) * s_po + d, pb, mask=dm)
    return tl.where((r == NB)[:, None], pb[None, :], S)


@triton.jit
def _finish(ws, wrow, S, r, d, dm, b, norm_w, out, s_o, D, eps, P,
            NB: tl.constexpr, PP: tl.constexpr, RNE: tl.constexpr):
    """Sum the row's P partials (in program order), alpha and the mix norm, then out[b, d] for this tile."""
    jj = tl.arange(0, PP)
    jm = jj < P
    e = tl.arange(0, NS * NS)
    base = ws + wrow
    sw = tl.sum(tl.load(base + jj[:, None] * NPART + r[None, :], mask=jm[:, None], other=0.0,
                        cache_modifier=".cg"), 0)
    g = tl.sum(tl.load(base + jj[:, None] * NPART + NS + e[None, :], mask=jm[:, None], other=0.0,
                       cache_modifier=".cg"), 0)
    g = tl.reshape(g, (NS, NS))  # [i, j] = sum_d s_i s_j
    eye = r[:, None] == r[None, :]
    ss = tl.sum(tl.where(eye, g, 0.0), 1)
    sc = tl.where(r <= NB, sw / tl.sqrt(ss / D + eps), float("-inf"))
    ex = tl.exp(sc - tl.max(sc, 0))
    alpha = ex / tl.sum(ex, 0)
    ms = tl.sum(tl.sum(g * alpha[None, :], 1) * alpha, 0) / D  # alpha^T G alpha / D = mean(mix^2)
    mix = tl.sum(alpha[:, None] * S.to(tl.float32), 0)
    y = mix / tl.sqrt(ms + eps) * tl.load(norm_w + d, mask=dm, other=0.0).to(tl.float32)
    if RNE:
        y = rne_bf16(y)
    tl.store(out + b.to(tl.int64) * s_o + d, y.to(out.dtype.element_ty), mask=dm)


@triton.jit
def _attnres_norm_kernel(b0, b1, b2, b3, b4, b5, b6, b7, b8, t0, t1, t2, t3, t4, t5, t6, t7, t8,
                         prefix, new, p_out, w_norm, w_proj, norm_w, out, ws, cnt, s_p, s_a, s_po, s_o, D, eps,
                         NB: tl.constexpr, UPDATE: tl.constexpr, BLOCK_D: tl.constexpr, PP: tl.constexpr,
                         INTERP: tl.constexpr, PDL: tl.constexpr):
    j = tl.program_id(0)
    b = tl.program_id(1)
    P = tl.num_programs(0)
    r = tl.arange(0, NS)
    d = j * BLOCK_D + tl.arange(0, BLOCK_D)
    dm = d < D
    wv = (tl.load(w_norm + d, mask=dm, other=0.0).to(tl.float32)
          * tl.load(w_proj + d, mask=dm, other=0.0).to(tl.float32))
    pdl_enter(PDL)  # the weights above, then the rows (and the counters) the kernels before wrote
    S = _tile(b0, b1, b2, b3, b4, b5, b6, b7, b8, t0, t1, t2, t3, t4, t5, t6, t7, t8, prefix, new, p_out,
              s_p, s_a, s_po, r, b, d, dm, True, NB, UPDATE, BLOCK_D, INTERP)
    sw = tl.sum(S.to(tl.float32) * wv[None, :], 1)
    if INTERP:  # the interpreter's tl.dot on bf16 is wrong (mla_decode.dot_f32); fp32 products are exact here
        g = tl.dot(S.to(tl.float32), tl.trans(S.to(tl.float32)))
    else:
        g = tl.dot(S, tl.trans(S))  # exact bf16 products, fp32 sums
    wrow = b.to(tl.int64) * P * NPART
    me = ws + wrow + j * NPART
    tl.store(me + r, sw)
    tl.store(me + NS + r[:, None] * NS + r[None, :], g)
    if P == 1:
        _finish(ws, wrow, S, r, d, dm, b, norm_w, out, s_o, D, eps, P, NB, PP, INTERP)
    else:
        tl.debug_barrier()  # every thread's partials stored before the release below
        arrive = cnt + 2 * b
        old = tl.atomic_add(arrive, 1, sem="acq_rel")
        if INTERP:  # programs run one after another: the last to arrive finishes every tile of the row
            if old == P - 1:
                for jt in range(0, P):
                    dt = jt * BLOCK_D + tl.arange(0, BLOCK_D)
                    dtm = dt < D
                    St = _tile(b0, b1, b2, b3, b4, b5, b6, b7, b8, t0, t1, t2, t3, t4, t5, t6, t7, t8,
                               p_out if UPDATE != 0 else prefix, p_out, p_out, s_po if UPDATE != 0 else s_p,
                               s_po, s_po, r, b, dt, dtm, False, NB, 0, BLOCK_D, INTERP)
                    _finish(ws, wrow, St, r, dt, dtm, b, norm_w, out, s_o, D, eps, P, NB, PP, INTERP)
                tl.atomic_xchg(arrive, 0)
        else:
            n = old + 1
            while n < P:
                n = tl.atomic_add(arrive, 0, sem="acquire")
            left = tl.atomic_add(cnt + 2 * b + 1, 1, sem="relaxed")
            if left == P - 1:  # every program of the row is past the barrier: both counters back to zero
                tl.atomic_xchg(cnt + 2 * b + 1, 0, sem="relaxed")
                tl.atomic_xchg(arrive, 0, sem="relaxed")
            _finish(ws, wrow, S, r, d, dm, b, norm_w, out, s_o, D, eps, P, NB, PP, INTERP)


PATHS = ("split", "row")
BLOCK_D = 128  # split path: columns per program (D = 7168: 56 programs per row)
SPLIT_MAX_BATCH = 8  # path None: split up to this batch, row above (measured: profiles/h200/trunk.json.gz)
SPLIT_MIN_BLOCKS = 5  # path None: row below this many blocks (its fixed cross-program cost loses at 0-1 blocks)


def attnres_norm(blocks: list[torch.Tensor], prefix: torch.Tensor, new: torch.Tensor | None, w_norm: torch.Tensor,
                 w_proj: torch.Tensor, norm_w: torch.Tensor, out: torch.Tensor, partial_out: torch.Tensor | None,
                 *, update: str = "none", eps: float = 1e-6, num_warps: int | None = None,
                 block_d: int | None = None, path: str | None = None, pdl: bool | None = None) -> torch.Tensor:
    """blocks: 0..MAX_BLOCKS tensors [B, D]; prefix [B, D] (the partial before the update; unused for
    update "fresh"); new [B, D] (the attention/MLP output; None for "none"); partial_out [B, D] written
    for "add"/"fresh" (may be prefix itself); out [B, D] written. path: "split" (a row over D / block_d
    programs) or "row" (one program per row); None = split up to SPLIT_MAX_BATCH rows with at least
    SPLIT_MIN_BLOCKS blocks, else row. block_d: the split
    path's columns per program (a power of two >= 16; None = BLOCK_D). pdl: launched with programmatic dependent
    launch (None: the enclosing pdl.pdl_chain's setting). Returns out. The caller validates."""
    pdl = chain_pdl(pdl)
    B, D = out.shape
    path = path or ("split" if B <= SPLIT_MAX_BATCH and len(blocks) >= SPLIT_MIN_BLOCKS else "row")
    u = UPDATES.index(update)
    a = new if new is not None else out
    po = partial_out if partial_out is not None else out
    src = list(blocks) + [out] * (MAX_BLOCKS - len(blocks))
    strides = [t.stride(0) for t in src]
    if path == "row":
        _attnres_row_kernel[(B,)](*src, *strides, prefix, a, po, w_norm, w_proj, norm_w, out,
                                  prefix.stride(0), a.stride(0), po.stride(0), out.stride(0), D, float(eps),
                                  NB=len(blocks), UPDATE=u, DP=_pow2(D), RNE=dot_f32(), PDL=pdl,
                                  num_warps=num_warps or 8, **launch_kw(pdl))
        return out
    bd = max(16, min(block_d or BLOCK_D, _pow2(D)))
    P = triton.cdiv(D, bd)
    ws = torch.empty(B * P * NPART.value, dtype=torch.float32, device=out.device)
    cnt = _counters(out.device, 2 * B) if P > 1 else ws
    _attnres_norm_kernel[(P, B)](*src, *strides, prefix, a, po, w_norm, w_proj, norm_w, out,
                                 ws, cnt, prefix.stride(0), a.stride(0), po.stride(0), out.stride(0), D, float(eps),
                                 NB=len(blocks), UPDATE=u, BLOCK_D=bd, PP=max(2, _pow2(P)), INTERP=dot_f32(),
                                 PDL=pdl, num_warps=num_warps or 4, **launch_kw(pdl))
    return out
