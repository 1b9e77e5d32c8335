"""The gated-MLA absorbed query step as one Triton kernel (the twin of kernels/cute/mla_query.py; the same maths,
grid and reduction order per head):

    r[b]            = rsqrt(mean_k cq[b, k]^2 + eps)                                     (fp32)
    q[b, h, d]      = r[b] * sum_k (cq[b, k] q_norm[k]) Wuq[h (Dn + Dr) + d, k]        (fp32)
    q_rope[b, h, :] = q[b, h, Dn:]   (bf16);   q_lat[b, h, c] = sum_{d < Dn} q[b, h, d] Wuk[h, d, c]   (bf16)

Layout. One program per 8 rows of Wuq [H (Dn + Dr), Q] (ROWS; Dn and Dr multiples of 8, so a program's rows are all
nope or all rope rows of one head), over all of Q in BQ-column steps, the batch rows as a [BB, BQ] tile; each
program sums cq^2 from the same loads. A rope program stores its rows. A nope program multiplies its rows by their
Wuk rows [8, C], stores the partial [B, C] (fp32) into a workspace [H, NP, B, C] (NP = Dn / 8), counts itself on the
head's arrival counter (acq_rel), and the head's last program sums the NP partials in program order into q_lat and
resets the counter. No program waits for another.

Floor (k3lab.ops.mla.query_bytes; read bandwidth): Wuq H (Dn + Dr) Q 2 + Wuk H Dn C 2 + q_norm Q 2 + cq B Q 2 +
outputs B H (C + Dr) 2. pdl: the weights' first loads are not hoisted before the wait here (Triton's pdl_enter
comes first); the CuTe kernel is the batch-1 path.

Contract: mla_query(cq, q_norm, w_uq, w_uk, q_lat, q_rope, *, eps, pdl=None) as the CuTe kernel's (the same
checks), B = 1..MAX_BATCH; the counters and the workspace are one per device and shape (no concurrent calls on two
streams).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from k3lab_kernels.triton.mla_decode import dot_f32, rne_bf16
from k3lab_kernels.triton.pdl import chain_pdl, launch_kw, pdl_enter

MAX_BATCH = 4
MAX_HEADS = 128
ROWS = 8
C_ALLOWED = (32, 64, 128, 256, 512)

__all__ = ["MAX_BATCH", "mla_query"]


@triton.jit
def _mla_query_kernel(cq, s_x, g, wq, wk, lat, s_lb, s_lh, rope, s_rb, s_rh, part, cnt, eps,
                      B: tl.constexpr, BB: tl.constexpr, Q: tl.constexpr, BQ: tl.constexpr, Dn: tl.constexpr,
                      Dr: tl.constexpr, C: tl.constexpr, RNE: tl.constexpr, PDL: tl.constexpr):
    R: tl.constexpr = Dn + Dr
    CPH: tl.constexpr = R // 8
    NP: tl.constexpr = Dn // 8
    pid = tl.program_id(0)
    h = pid // CPH
    j = pid - h * CPH
    d = j * 8 + tl.arange(0, 8)                     # the program's rows within the head
    bb = tl.arange(0, BB)
    bok = bb < B
    kk = tl.arange(0, BQ)
    pdl_enter(PDL)
    acc = tl.zeros((8, BB), dtype=tl.float32)
    ss = tl.zeros((BB,), dtype=tl.float32)
    for k0 in range(0, Q, BQ):
        kok = (k0 + kk) < Q
        w = tl.load(wq + (h * R + d)[:, None] * Q + (k0 + kk)[None, :], mask=kok[None, :], other=0.0).to(tl.float32)
        x = tl.load(cq + bb[:, None] * s_x + (k0 + kk)[None, :], mask=bok[:, None] & kok[None, :],
                    other=0.0).to(tl.float32)
        gk = tl.load(g + k0 + kk, mask=kok, other=0.0).to(tl.float32)
        ss += tl.sum(x * x, axis=1)
        acc += tl.sum(w[:, None, :] * (x * gk[None, :])[None, :, :], axis=2)
    acc = acc * (1.0 / tl.sqrt(ss / Q + eps))[None, :]
    if j >= NP:  # rope rows
        if RNE:  # the interpreter's bf16 cast truncates: round to nearest-even first, as the GPU's cast does
            acc = rne_bf16(acc)
        tl.store(rope + bb[None, :] * s_rb + h * s_rh + (d - Dn)[:, None], acc.to(rope.dtype.element_ty),
                 mask=bok[None, :])
    else:
        cc = tl.arange(0, C)
        uk = tl.load(wk + (h * Dn + d)[:, None] * C + cc[None, :]).to(tl.float32)      # [8, C]
        p = tl.sum(acc[:, :, None] * uk[:, None, :], axis=0)                              # [BB, C]
        tile = part + ((h * NP + j) * B + bb[:, None]) * C + cc[None, :]
        tl.store(tile, p, mask=bok[:, None])
        tl.debug_barrier()  # every thread's partial is stored before the release below
        c = cnt + h
        if tl.atomic_add(c, 1, sem="acq_rel") == NP - 1:  # the head's last program: q_lat, partials in order
            base = part + (h * NP * B + bb[:, None]) * C + cc[None, :]
            y = tl.load(base, mask=bok[:, None], other=0.0, cache_modifier=".cg")
            for q in tl.static_range(1, NP):
                y += tl.load(base + q * B * C, mask=bok[:, None], other=0.0, cache_modifier=".cg")
            if RNE:
                y = rne_bf16(y)
            tl.store(lat + bb[:, None] * s_lb + h * s_lh + cc[None, :], y.to(lat.dtype.element_ty), mask=bok[:, None])
            tl.atomic_xchg(c, 0)  # zero again for the next call


_COUNTERS: dict[str, torch.Tensor] = {}
_PARTS: dict[tuple, torch.Tensor] = {}


class MLAQueryError(ValueError):
    """An argument of the Triton MLA query step has the wrong type, shape, dtype, layout or device."""


def _fail(name: str, msg: str):
    raise MLAQueryError(f"mla_query triton: {name!r} {msg}")


def check_args(cq, q_norm, w_uq, w_uk, q_lat, q_rope, eps, fail=_fail, max_batch=MAX_BATCH, cuda=False):
    """The shared argument checks of both kernels (the CuTe wrapper's `fail` names its backend; cuda=True: on a CUDA
    device, Triton's interpreter runs on CPU tensors). Returns (B, Q, H, Dn, Dr, C)."""
    where = "the CUDA device of cq" if cuda else "the device of cq"

    def tensor(name, t, dim, dev):
        if not isinstance(t, torch.Tensor):
            fail(name, f"must be a torch.Tensor, got {type(t).__name__}")
        if (cuda and t.device.type != "cuda") or (dev is not None and t.device != dev):
            fail(name, f"must be on {where}, got {t.device}")
        if t.dtype != torch.bfloat16:
            fail(name, f"must be bf16, got {t.dtype}")
        if t.dim() != dim:
            fail(name, f"must have {dim} dims, got shape {tuple(t.shape)}")

    tensor("cq", cq, 2, None)
    dev = cq.device
    B, Q = cq.shape
    if not 1 <= B <= max_batch or Q % 8 or cq.stride(1) != 1 or cq.stride(0) % 8 or cq.data_ptr() % 16:
        fail("cq", f"must be [1..{max_batch}, Q] with Q a multiple of 8, unit stride along Q, a row stride of 8 "
                   f"elements and a 16-byte aligned base, got {tuple(cq.shape)} strides {cq.stride()}")
    tensor("q_norm", q_norm, 1, dev)
    if q_norm.shape[0] != Q or not q_norm.is_contiguous() or q_norm.data_ptr() % 16:
        fail("q_norm", f"must be a contiguous 16-byte aligned [{Q}] tensor, got {tuple(q_norm.shape)}")
    tensor("w_uk", w_uk, 3, dev)
    H, Dn, C = w_uk.shape
    if not 1 <= H <= MAX_HEADS or Dn % ROWS or C not in C_ALLOWED or not w_uk.is_contiguous() \
            or w_uk.data_ptr() % 16:
        fail("w_uk", f"must be a contiguous 16-byte aligned [H <= {MAX_HEADS}, Dn (a multiple of {ROWS}), C in "
                     f"{C_ALLOWED}] tensor, got {tuple(w_uk.shape)}")
    tensor("w_uq", w_uq, 2, dev)
    R = w_uq.shape[0] // H if w_uq.shape[0] % H == 0 else 0
    Dr = R - Dn
    if w_uq.shape[1] != Q or R <= Dn or Dr % ROWS or not w_uq.is_contiguous() or w_uq.data_ptr() % 16:
        fail("w_uq", f"must be a contiguous 16-byte aligned [{H} (Dn {Dn} + Dr), {Q}] tensor with Dr > 0 a multiple "
                     f"of {ROWS}, got {tuple(w_uq.shape)}")
    for name, t, w in (("q_lat", q_lat, C), ("q_rope", q_rope, Dr)):
        tensor(name, t, 3, dev)
        if tuple(t.shape) != (B, H, w) or t.stride(2) != 1:
            fail(name, f"must be [{B}, {H}, {w}] with unit inner stride, got {tuple(t.shape)} strides {t.stride()}")
    if isinstance(eps, bool) or not isinstance(eps, (int, float)) or not eps > 0:
        fail("eps", f"must be a positive number, got {eps!r}")
    return B, Q, H, Dn, Dr, C


def scratch(dev: torch.device, H: int, NP: int, B: int, C: int, counters: dict, parts: dict, tm=torch):
    """The heads' arrival counters (zero between calls) and the partials' workspace, one per device (and shape);
    tm: the torch the caller's module allocates with (the CuTe emulator's stand-in in its tests)."""
    cnt = counters.get(str(dev))
    if cnt is None:
        cnt = counters[str(dev)] = tm.empty(MAX_HEADS, dtype=torch.int32, device=dev).zero_()
    key = (str(dev), H, NP, B, C)
    if key not in parts:
        parts[key] = tm.empty(H * NP * B * C, dtype=torch.float32, device=dev)
    return cnt, parts[key]


def mla_query(cq: torch.Tensor, q_norm: torch.Tensor, w_uq: torch.Tensor, w_uk: torch.Tensor, q_lat: torch.Tensor,
              q_rope: torch.Tensor, *, eps: float = 1e-6, pdl: bool | None = None) -> tuple:
    """q_lat [B, H, C], q_rope [B, H, Dr] from cq [B, Q] (module doc). Returns (q_lat, q_rope)."""
    pdl = chain_pdl(pdl)
    B, Q, H, Dn, Dr, C = check_args(cq, q_norm, w_uq, w_uk, q_lat, q_rope, eps)
    cnt, part = scratch(cq.device, H, Dn // ROWS, B, C, _COUNTERS, _PARTS)
    BB = triton.next_power_of_2(B)
    BQ = min(256, triton.next_power_of_2(Q))
    _mla_query_kernel[(H * (Dn + Dr) // ROWS,)](
        cq, cq.stride(0), q_norm, w_uq, w_uk, q_lat, q_lat.stride(0), q_lat.stride(1), q_rope, q_rope.stride(0),
        q_rope.stride(1), part, cnt, float(eps), B=B, BB=BB, Q=Q, BQ=BQ, Dn=Dn, Dr=Dr, C=C, RNE=dot_f32(), PDL=pdl,
        num_warps=4,
        **launch_kw(pdl))
    return q_lat, q_rope
