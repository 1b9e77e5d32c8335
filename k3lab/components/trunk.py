"""Trunk component API: projections (one, or a group fused by shared input), the router's selection.
AttnRes + RMSNorm lives in k3lab.components.attnres (update_mix_norm). Maths: k3lab.ref.situ.linear,
k3lab.ref.router; the fp64 oracles and byte formulas: k3lab.ops.trunk.

    proj(x, w, out=None, *, w_scale=None, residual=None, prologue=None, backend="reference", ran=None, **knobs)
        out = pro(x) W^T (+ residual) [B, N]; W [N, K] bf16, or float8_e4m3fn with w_scale [N] fp32 (W = W_fp8 *
        scale per output channel); out bf16 or fp32 (allocated bf16 when None), any row stride, unit inner stride.
        prologue (the op before the projection, in its launch; rounded to bf16 as the stand-alone op rounds):
          None; ("situ", b1, b2): x = [g | u] [B, 2K], pro(x) = situ(g, u) (the shared experts' / dense w2);
          ("rms", weight [K], eps): x [B, K] bf16 or fp32, pro(x) = RMSNorm(x) * weight (routed_norm, q_norm).
        x2, prologue2 = ("situ", b1, b2) with prologue ("rms", weight [K1], eps): two K segments, W = [W1 | W2],
          out = rms(x) W1^T + situ(x2) W2^T (+ residual): the MoE's Wup on the routed sum and the shared experts'
          w2 in one launch (x [B, K1], x2 = [g | u] [B, 2 K2], K1 a multiple of 16 on triton).
    proj_group(x, w, outs, *, w_scale=None, select=None, backend="reference", ran=None, **knobs) -> outs
        one launch over the concatenated weight W = cat(W_1..W_n) [sum N_i, K] (n <= 6), output i into outs[i]
        [B, N_i] (each where its consumer reads it: a column slice of a wider buffer is fine).
        select=Select(e_bias, idx, weights, scaling): the router's selection (router_topk's maths and tie rule)
        over outs[0], the router's fp32 logits [B, E], in the same launch (triton: batch <= 16): the MoE input
        group's last step.
    router_topk(logits, e_bias, *, top_k=16, scaling=1.0, idx=None, weights=None, backend, ran) -> (idx, weights)
        sigmoid, the selection-only bias, top-k (ties: lower expert id first), renormalized weights * scaling.
    route(h, router, *, backend="reference", ran=None) -> (idx [B, k] int64, weights [B, k] fp32)
        the router projection (fp32 logits) then router_topk (triton up to SELECT_MAX_BATCH rows: the selection in
        the projection's launch): what the layer's router component calls.
    prefetch_l2(w, batch, *, budget, prologue=False, record=None, backend="triton", ran=None) -> dict
        the `prefetch` switch: pull into L2 the first columns of every split-K range that proj(x [batch, K], w)
        will stream, at most `budget` bytes (launch it on a side stream during a phase that moves few bytes).
        Nothing is computed; record (int64 [lines]) takes each line's first element index instead (tests).
        backend "cute" (kernels/cute/l2_prefetch.py): the same lines as one bulk prefetch a contiguous range.

Backends (the one dispatcher, k3lab.components.dispatch; kernels named in k3lab.ops.trunk):
  reference      torch in fp32 (fp64 for fp64 inputs); for proj/proj_group a matmul of the dequantized weight
  torch_compile  torch.compile of the same function (router_topk; a projection's torch.compile is cuBLAS)
  triton         k3lab_kernels.triton.proj_gemv / router_topk (bf16 activations; batch <= 1024)
  cute           k3lab_kernels.cute.router_topk (E <= 1024 experts) and proj_gemv (proj / proj_group:
                 bf16 or fp8 weights, batch <= 16, K a multiple of 8, no input prologue but rmsp; the fused selection
                 at batch <= 4); path "mma": kernels/cute/proj_mma.py (tensor cores for a few tokens, K a
                 multiple of 32 bf16 / 64 fp8, the plain outputs and the residual; cluster, tile_m: its split
                 of K and rows a CTA)
  auto           data/trunk_defaults.json (proj / proj_group at batch 1: the cute GEMV for bf16 weights over
                 K <= 2048 or >= 3584 rows over K 7168, for fp8 weights over >= 768 rows; at batch 2 for fp8 on
                 the shapes it won (mla_uq, moe_down, TP16 shared_w2); triton otherwise), else the reference
Knobs (triton): path ("tma": tensor-core tiles fed by the copy engine; "dot": the same from pointer
loads; "rows": register GEMV for batch <= 8), block_n, block_k, split_k, num_warps, num_stages, reduce ("last": a
split-K tile's last program sums its partials; "kernel": a second kernel under PDL) (proj, proj_group);
num_warps, pdl (router_topk: launched with PDL; cute takes pdl only); (cute) path (None / "gemv": one warp a row;
"mma": tensor cores, measured and in no auto rule: docs/NOTES_trunk.md), cluster and tile_m (proj, proj_group);
None = the kernel's measured default.
Argument errors are TrunkArgumentError (a ValueError) naming the argument.
"""
from __future__ import annotations

import torch

from k3lab import registry
from typing import NamedTuple

from k3lab.components import dispatch
from k3lab.ref.router import RouterWeights

COMPONENT = "trunk"
MAX_BATCH = 1024  # the triton projections' batch (kernels/triton/proj_gemv.py MAX_BATCH)
MAX_OUTPUTS = 6
W_DTYPES = (torch.bfloat16, torch.float8_e4m3fn)
OUT_DTYPES = (torch.bfloat16, torch.float32)


class Select(NamedTuple):
    """The router selection fused into a projection group (proj_group's `select`): over outs[0], the router's
    fp32 logits [B, E]; e_bias [E] fp32; idx [B, k] int64 and weights [B, k] fp32 written (k = idx's width)."""
    e_bias: torch.Tensor
    idx: torch.Tensor
    weights: torch.Tensor
    scaling: float = 1.0


class TrunkArgumentError(ValueError):
    """An argument of the trunk component API has the wrong type, shape, dtype, device or value."""


def _fail(name: str, msg: str):
    raise TrunkArgumentError(f"{COMPONENT}: {name!r} {msg}")


def _dt(ds) -> list[str]:
    return [str(d).replace("torch.", "") for d in ds]


def _tensor(name, t, dim, dtypes=None, device=None):
    if not isinstance(t, torch.Tensor):
        _fail(name, f"must be a torch.Tensor, got {type(t).__name__}")
    if t.dim() != dim:
        _fail(name, f"must have {dim} dims, got shape {tuple(t.shape)}")
    if dtypes is not None and t.dtype not in dtypes:
        _fail(name, f"must have dtype in {_dt(dtypes)}, got {t.dtype}")
    if device is not None and t.device != device:
        _fail(name, f"must be on {device} (x's device), got {t.device}")
    return t


def _knobs(op_name: str, be: str, knobs: dict) -> dict:
    """The kernel knobs checked against the registry's allowed values for backend `be`."""
    op = registry.get(op_name)
    for k, v in knobs.items():
        if k not in op.option_axes:
            _fail(k, f"is not an option of {op_name}; options: {sorted(op.option_axes)}")
        if v is None:
            continue
        if be not in op.option_axes[k]:
            _fail(k, f"is a {'/'.join(sorted(op.option_axes[k]))} kernel option; backend {be!r} takes none "
                     f"(pass None)")
        allowed = op.option_axes[k][be]
        if isinstance(v, bool) != (k in ("pdl", "f16")) or v not in allowed:
            _fail(k, f"must be one of {[a for a in allowed if a is not None]} or None, got {v!r}")
    return {k: v for k, v in knobs.items() if v is not None}


def _select(op_name: str, backend: str, B: int, knobs: dict, facts: dict | None = None) -> tuple[str, dict, str]:
    # auto passes over a backend that cannot take the call (the op's `supports`: the batch, and for a projection its
    # weight format, input prologue and fused selection, which with its rows are `facts`, also what the rules filter
    # on); a named backend is validated by the call's own argument checks, which name the argument
    be, opts, why = dispatch.select(op_name, backend, B=B,
                                    shape={"batch": B, **(facts or {})} if backend == "auto" else None)
    given = {k: v for k, v in knobs.items() if v is not None}
    return be, {**opts, **_knobs(op_name, be, given)}, why


# ---- projections -------------------------------------------------------------------------------------

def _dense(w: torch.Tensor, w_scale: torch.Tensor | None, dt: torch.dtype) -> torch.Tensor:
    return w.to(dt) * w_scale.to(dt)[:, None] if w.dtype == torch.float8_e4m3fn else w.to(dt)


def _linear_ref(x, w, w_scale, residual):
    dt = torch.float64 if x.dtype == torch.float64 else torch.float32
    y = x.to(dt) @ _dense(w, w_scale, dt).T
    return y if residual is None else y + residual.to(dt)


PROLOGUES = ("situ", "rms", "rmsp")


def _check_prologue(prologue, x, w, backend, arg: str = "prologue", K: int | None = None) -> str | None:
    """The input prologue (module docstring): None, ("situ", b1, b2), ("rms", weight [K], eps) or ("rmsp", ssp
    [B, P] fp32, k1, eps) (x's first k1 columns times rsqrt(sum_p ssp[b, p] / k1 + eps): the norm's weight already
    applied and its sum of squares given as P partials, k3lab.step.moe_glue_fold); K: the width the prologue's
    output has (w's K, or x's for the first of two segments)."""
    if prologue is None:
        return None
    if (not isinstance(prologue, tuple) or not prologue or prologue[0] not in PROLOGUES
            or len(prologue) != (4 if prologue[0] == "rmsp" else 3)):
        _fail(arg, f"must be None, ('situ', b1, b2), ('rms', weight, eps) or ('rmsp', ssp, k1, eps), got "
                   f"{prologue!r:.80}")
    if prologue[0] == "rmsp":
        _, ssp, k1, eps = prologue
        B = x.shape[0] if isinstance(x, torch.Tensor) and x.dim() == 2 else None
        if (not isinstance(ssp, torch.Tensor) or ssp.dim() != 2 or ssp.shape[0] != B or not ssp.is_contiguous()
                or ssp.dtype not in (torch.float32, torch.float64)):
            _fail(arg, f"the partial sums of squares must be a contiguous fp32 [{B}, P] tensor, got "
                       f"{getattr(ssp, 'dtype', type(ssp).__name__)} {tuple(getattr(ssp, 'shape', ()))}")
        if isinstance(x, torch.Tensor) and ssp.device != x.device:
            _fail(arg, f"the partial sums must be on {x.device} (x's device), got {ssp.device}")
        Kx = x.shape[1] if isinstance(x, torch.Tensor) and x.dim() == 2 else 0
        if isinstance(k1, bool) or not isinstance(k1, int) or not 1 <= k1 <= Kx:
            _fail(arg, f"k1 (the scaled columns) must be an int in 1..{Kx}, got {k1!r}")
        if isinstance(eps, bool) or not isinstance(eps, (int, float)) or not eps > 0:
            _fail(arg, f"the rms eps must be a positive number, got {eps!r}")
        return "rmsp"
    kind, a, b = prologue
    if kind == "situ":
        for name, v in (("b1", a), ("b2", b)):
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not v > 0:
                _fail(arg, f"SiTU constant {name} must be a positive number, got {v!r}")
        return kind
    if K is None:
        K = w.shape[1] if isinstance(w, torch.Tensor) and w.dim() == 2 else None
    if not isinstance(a, torch.Tensor) or a.dim() != 1 or a.shape[0] != K:
        _fail(arg, f"the rms weight must be a 1-D tensor of {K} (the width it normalizes), got "
                          f"{tuple(getattr(a, 'shape', ())) or type(a).__name__}")
    if isinstance(x, torch.Tensor) and a.device != x.device:
        _fail(arg, f"the rms weight must be on {x.device} (x's device), got {a.device}")
    if backend == "triton" and (not a.is_contiguous() or a.dtype not in (torch.bfloat16, torch.float32)):
        _fail(arg, f"the rms weight must be a contiguous bf16 or fp32 tensor for the triton backend, got "
                          f"{a.dtype}")
    if isinstance(b, bool) or not isinstance(b, (int, float)) or not b > 0:
        _fail(arg, f"the rms eps must be a positive number, got {b!r}")
    return kind


def _prologue_ref(x: torch.Tensor, prologue) -> torch.Tensor:
    """The prologue in fp32 (fp64 for the fp64 oracle), rounded to bf16 as the stand-alone kernels round it."""
    if prologue is None:
        return x
    from k3lab.ref.rmsnorm import rms_norm
    from k3lab.ref.situ import situ

    dt = torch.float64 if x.dtype == torch.float64 else torch.float32
    if prologue[0] == "rmsp":
        _, ssp, k1, eps = prologue
        inv = torch.rsqrt(ssp.to(dt).sum(1, keepdim=True) / k1 + eps)
        y = torch.cat([x[:, :k1].to(dt) * inv, x[:, k1:].to(dt)], 1)
        return y if dt == torch.float64 else y.to(torch.bfloat16)
    K = x.shape[1] // 2 if prologue[0] == "situ" else x.shape[1]
    y = (situ(x[:, :K].to(dt), x[:, K:].to(dt), prologue[1], prologue[2]) if prologue[0] == "situ"
         else rms_norm(x.to(dt), prologue[1].to(dt), float(prologue[2]), out_dtype=dt))
    return y if dt == torch.float64 else y.to(torch.bfloat16)


def _check_proj(x, w, w_scale, outs, residual, backend, group: bool, pro: str | None = None, glu: bool = False):
    _tensor("x", x, 2)
    dev = x.device
    if not x.is_floating_point():
        _fail("x", f"must be a floating tensor [B, K], got {x.dtype}")
    B = x.shape[0]
    K = x.shape[1] // 2 if pro == "situ" else w.shape[1] if pro == "rms+situ" else x.shape[1]
    triton = backend == "triton"
    if B < 1 or (triton and B > MAX_BATCH):
        _fail("x", f"must have a batch of 1..{MAX_BATCH} rows for the triton backend, got {B}" if triton
              else f"must have at least one row, got shape {tuple(x.shape)}")
    xdt = (torch.bfloat16, torch.float32) if pro in ("rms", "rms+situ") else (torch.bfloat16,)
    if triton and (x.dtype not in xdt or x.stride(1) != 1):
        _fail("x", f"must be {_dt(xdt)} with unit stride along K for the triton backend, got {x.dtype}, "
                   f"strides {x.stride()}")
    _tensor("w", w, 2, W_DTYPES if triton else None, dev)
    if pro == "situ" and x.shape[1] != 2 * w.shape[1]:
        _fail("x", f"must be [B, 2K] = [g | u] for the situ prologue (w's K = {w.shape[1]}), got {tuple(x.shape)}")
    if w.shape[1] != K:
        _fail("w", f"must be [N, {K}] (x's K), got {tuple(w.shape)}")
    if triton and not w.is_contiguous():
        _fail("w", "must be contiguous for the triton backend")
    N = w.shape[0]
    if w.dtype == torch.float8_e4m3fn:
        if w_scale is None:
            _fail("w_scale", "must be given for float8_e4m3fn weights: [N] fp32, one scale per output channel")
        _tensor("w_scale", w_scale, 1, (torch.float32,), dev)
        if w_scale.shape[0] != N or not w_scale.is_contiguous():
            _fail("w_scale", f"must be a contiguous [{N}] fp32 tensor, got {tuple(w_scale.shape)}")
    elif w_scale is not None:
        _fail("w_scale", f"is for float8_e4m3fn weights only; w is {w.dtype}")
    if not 1 <= len(outs) <= MAX_OUTPUTS:
        _fail("outs", f"must hold 1..{MAX_OUTPUTS} output tensors, got {len(outs)}")
    total = 0
    for i, o in enumerate(outs):
        name = f"outs[{i}]" if group else "out"
        _tensor(name, o, 2, OUT_DTYPES if triton else None, dev)
        if not o.is_floating_point():
            _fail(name, f"must be a floating tensor, got {o.dtype}")
        if o.shape[0] != B or o.shape[1] < 1 or o.stride(1) != 1:
            _fail(name, f"must be [{B}, N_i >= 1] with unit inner stride, got {tuple(o.shape)} strides {o.stride()}")
        total += o.shape[1] * (2 if glu and i == len(outs) - 1 else 1)  # the GLU output: two rows a column
    if total != N:
        _fail("outs" if group else "out", f"widths must add up to w's {N} rows"
                                          f"{' (the GLU output counting twice)' if glu else ''}, got {total}")
    if residual is not None:
        if len(outs) != 1:
            _fail("residual", "is an epilogue of a single projection (proj), not of a group")
        _tensor("residual", residual, 2, (torch.bfloat16,) if triton else None, dev)
        if tuple(residual.shape) != (B, N) or residual.stride(1) != 1:
            _fail("residual", f"must be [{B}, {N}] with unit inner stride, got {tuple(residual.shape)}")


def _check_select(select, outs, B, backend, path):
    if select is None:
        return
    if not isinstance(select, Select):
        _fail("select", f"must be None or trunk.Select(e_bias, idx, weights, scaling), got {type(select).__name__}")
    lg = outs[0]
    if lg.dtype not in (torch.float32, torch.float64):
        _fail("outs[0]", f"must be the router's fp32 logits [B, E] when select is given, got {lg.dtype}")
    E = lg.shape[1]
    _tensor("select.e_bias", select.e_bias, 1, (torch.float32, torch.float64), lg.device)
    if select.e_bias.shape[0] != E or not select.e_bias.is_contiguous():
        _fail("select.e_bias", f"must be a contiguous [{E}] tensor (outs[0]'s experts), got "
                               f"{tuple(select.e_bias.shape)}")
    _tensor("select.idx", select.idx, 2, (torch.int64,), lg.device)
    k = select.idx.shape[1]
    if select.idx.shape[0] != B or not 1 <= k <= min(E, 32) or not select.idx.is_contiguous():
        _fail("select.idx", f"must be a contiguous [{B}, k] int64 tensor with 1 <= k <= {min(E, 32)}, got "
                            f"{tuple(select.idx.shape)}")
    _tensor("select.weights", select.weights, 2, (torch.float32, torch.float64), lg.device)
    if tuple(select.weights.shape) != (B, k) or not select.weights.is_contiguous():
        _fail("select.weights", f"must be a contiguous [{B}, {k}] tensor, got {tuple(select.weights.shape)}")
    sc = select.scaling
    if isinstance(sc, bool) or not isinstance(sc, (int, float)):
        _fail("select.scaling", f"must be a number, got {sc!r}")
    if backend == "triton":
        from k3lab_kernels.triton.proj_gemv import SELECT_MAX_BATCH

        if lg.dtype != torch.float32 or select.e_bias.dtype != torch.float32 or select.weights.dtype != torch.float32:
            _fail("select", "takes fp32 logits, e_bias and weights on the triton backend")
        if B > SELECT_MAX_BATCH:
            _fail("select", f"is fused at batch <= {SELECT_MAX_BATCH} (one program selects every row), got {B}; "
                            "run router_topk after the group")
        if path == "rows":
            _fail("path", "'rows' runs no fused selection; use 'tma', 'dot' or None")
    if backend == "cute":
        from k3lab_kernels.cute.proj_gemv import SELECT_MAX_BATCH as CUTE_SELECT_MAX_BATCH

        if lg.dtype != torch.float32 or select.e_bias.dtype != torch.float32 or select.weights.dtype != torch.float32:
            _fail("select", "takes fp32 logits, e_bias and weights on the cute backend")
        if B > CUTE_SELECT_MAX_BATCH:
            _fail("select", f"is fused at batch <= {CUTE_SELECT_MAX_BATCH} on cute (one CTA selects every row), got "
                            f"{B}; run router_topk after the group")


def _check_second(x, x2, w, prologue, prologue2, backend) -> int:
    """Two K segments (proj's x2): x [B, K1] through ('rms', weight [K1], eps), x2 = [g | u] [B, 2 K2] through
    ('situ', b1, b2), w [N, K1 + K2]. Returns K1."""
    _tensor("x", x, 2)
    _tensor("x2", x2, 2, (torch.bfloat16,) if backend == "triton" else None, x.device)
    K1 = x.shape[1]
    if prologue is None or prologue[0] != "rms" or prologue2 is None or prologue2[0] != "situ":
        _fail("prologue2", "two segments take prologue=('rms', weight, eps) for x and prologue2=('situ', b1, b2) for "
                           f"x2, got {prologue!r:.80} and {prologue2!r}")
    _check_prologue(prologue, x, w, backend, K=K1)
    _check_prologue(prologue2, x, w, backend, arg="prologue2")
    if x2.shape[0] != x.shape[0] or x2.shape[1] % 2 or x2.stride(1) != 1:
        _fail("x2", f"must be [{x.shape[0]}, 2 K2] = [g | u] with unit inner stride, got {tuple(x2.shape)}")
    if not isinstance(w, torch.Tensor) or w.dim() != 2 or w.shape[1] != K1 + x2.shape[1] // 2:
        _fail("w", f"must be [N, {K1 + x2.shape[1] // 2}] = [W1 | W2] (x's {K1} + x2's {x2.shape[1] // 2} columns), "
                   f"got {tuple(getattr(w, 'shape', ()))}")
    if backend == "triton" and K1 % 16:
        _fail("x", f"must have a width that is a multiple of 16 (a K tile never straddles the segments), got {K1}")
    return K1


def _cute_ran(opts: dict, x: torch.Tensor, w: torch.Tensor) -> dict:
    """The cute projection's options as they ran, for the record: path None is the GEMV; path "mma" with tile_m or
    cluster None took kernels/cute/proj_mma.py's plan on this device."""
    ran = {**opts, "path": opts.get("path") or "gemv"}
    if ran["path"] == "mma" and x.device.type == "cuda":
        from k3lab_kernels.cute.proj_mma import plan, sm_count

        ran["tile_m"], ran["cluster"] = plan(w.shape[0], w.shape[1], w.dtype == torch.float8_e4m3fn,
                                             sm_count(x.device), ran.get("tile_m"), ran.get("cluster"),
                                             x.shape[0] if x.dim() == 2 else 1)
    return ran


def _proj_facts(w, prologue, x2, select) -> dict:
    """The facts of a projection call the auto rules and the backends' `supports` read (k3lab.ops.trunk.proj_facts
    for a bench case): weight format, output rows, input width, input prologue, fused selection. Bad arguments pass
    through unlabelled; the checks after the backend's choice name them."""
    if not isinstance(w, torch.Tensor) or w.dim() != 2:
        return {}
    fmt = "fp8" if w.dtype == torch.float8_e4m3fn else "bf16"
    pro = "rms+situ" if x2 is not None else (prologue[0] if isinstance(prologue, (tuple, list)) and prologue
                                              else "none")
    return {"fmt": fmt, "n": int(w.shape[0]), "k": int(w.shape[1]), "prologue": pro,
            "select": select is not None}


def _run_proj(op_name, x, w, outs, w_scale, residual, backend, ran, knobs, prologue=None, select=None, x2=None,
              prologue2=None, chain=None, glu=None):
    B = x.shape[0] if isinstance(x, torch.Tensor) and x.dim() == 2 else 1
    be, opts, why = _select(op_name, backend, B, knobs, _proj_facts(w, prologue, x2, select))
    notes = ""
    for name, v, what in (("chain", chain, "f = outs[0] w2^T in the same launch"),
                          ("glu", glu, "the last output as situ over pairs of rows")):
        if v is not None and be not in ("cute", "reference", "torch_compile"):
            _fail(name, f"({what}) is taken by the cute backend (and the reference ones), not {be!r}")
    if glu is not None:
        if (not isinstance(glu, (tuple, list)) or len(glu) != 2
                or not all(isinstance(v, (int, float)) and not isinstance(v, bool) and v > 0 for v in glu)):
            _fail("glu", f"must be None or (b1, b2), two positive numbers, got {glu!r:.60}")
    if x2 is not None or prologue2 is not None:
        if x2 is None:
            _fail("x2", "must be given with prologue2 (the second K segment)")
        _check_second(x, x2, w, prologue, prologue2, be)
        pro = "rms+situ"
        _check_proj(x, w, w_scale, outs, residual, be, op_name == "proj_group", "rms+situ", glu is not None)
    else:
        pro = _check_prologue(prologue, x, w, be)
        _check_proj(x, w, w_scale, outs, residual, be, op_name == "proj_group", pro, glu is not None)
    _check_select(select, outs, B, be, opts.get("path"))
    if pro == "rmsp" and be not in ("cute", "reference", "torch_compile"):
        _fail("prologue", f"('rmsp', ...) is taken by the cute backend (and the reference ones), not {be!r}: the "
                          "Triton kernel's form (x through pointers) lost inside the decode step (git history at "
                          "9f789eb)")
    if pro is not None and opts.get("path") == "rows":
        _fail("path", "'rows' runs no input prologue; use 'tma', 'dot' or None")
    if opts.get("path") == "rows":
        from k3lab_kernels.triton.proj_gemv import ROWS_MAX_BATCH

        if B > ROWS_MAX_BATCH:
            _fail("path", f"'rows' takes a batch of at most {ROWS_MAX_BATCH}, got {B}; use 'dot' or None")
        if opts.get("split_k", 1) != 1:
            _fail("split_k", "applies to path 'dot' only (the rows path splits no K)")
    if be == "cute":  # bf16 or fp8 weights; the one input prologue it takes is rmsp (kernels/cute/proj_gemv.py)
        rmsp = None
        if pro == "rmsp":
            rmsp = (prologue[1], int(prologue[2]), float(prologue[3]))
        for name, v in (("prologue", None if rmsp else prologue), ("x2", x2)):
            if v is not None:
                _fail(name, "is not taken by the cute projection (an input prologue only as ('rmsp', ssp, k1, eps): "
                            "kernels/cute/proj_gemv.py); use backend 'triton'")
        sel = None if select is None else (select.e_bias, select.idx, select.weights, float(select.scaling))
        extra = {k: v for k, v in (("chain", None if chain is None else tuple(chain)), ("rmsp", rmsp),
                                   ("glu", None if glu is None else tuple(glu))) if v is not None}
        if w_scale is not None:
            extra["w_scale"] = w_scale
        dispatch.kernel(op_name, be)(x, w, outs, residual=residual, select=sel, **extra, **opts)
        opts = _cute_ran(opts, x, w)
    elif be == "triton":
        sel = None if select is None else (select.e_bias, select.idx, select.weights, select.idx.shape[1],
                                           float(select.scaling))
        two = dict(x2=x2, prologue2=prologue2) if x2 is not None else {}
        plan: dict | None = {} if ran is not None else None  # what ran, described only for a caller that records
        dispatch.kernel(op_name, be)(x, w, outs, w_scale=w_scale, residual=residual, prologue=prologue, select=sel,
                                     **two, **opts, plan=plan)
        if plan is not None:
            from k3lab_kernels.triton.proj_gemv import describe

            notes = describe(plan)
    else:
        xin = _prologue_ref(x, prologue)
        if x2 is not None:
            xin = torch.cat([xin, _prologue_ref(x2, prologue2).to(xin.dtype)], 1)
        y = _linear_ref(xin, w, w_scale, residual)
        a = 0
        for i, o in enumerate(outs):
            if glu is not None and i == len(outs) - 1:  # rows [g | u], each a stored (rounded) output first
                from k3lab.ref.situ import situ

                gi = o.shape[1]
                gu = y[:, a:a + 2 * gi]
                gu = gu if gu.dtype == torch.float64 else gu.to(torch.bfloat16).float()
                o.copy_(situ(gu[:, :gi], gu[:, gi:], float(glu[0]), float(glu[1])))
                continue
            o.copy_(y[:, a:a + o.shape[1]])
            a += o.shape[1]
        if select is not None:
            i, wt = topk_reference(outs[0], select.e_bias, select.idx.shape[1], float(select.scaling))
            select.idx.copy_(i)
            select.weights.copy_(wt)
        if chain is not None:
            chain[1].copy_(_linear_ref(outs[0], chain[0], None, None))
    dispatch.record(ran, op=op_name, backend_requested=backend, backend=be, kernel=dispatch.kernel_path(op_name, be),
                    notes=notes,
                    options=opts, shape=dict(batch=B, N=w.shape[0], K=w.shape[1], wdtype=str(w.dtype).replace(
                        "torch.", ""), outputs=len(outs), residual=residual is not None, prologue=pro or "none",
                        select=0 if select is None else select.idx.shape[1],
                        chain=None if chain is None else tuple(chain[0].shape),
                        glu=None if glu is None else tuple(glu)), why=why)
    return outs


def proj(x: torch.Tensor, w: torch.Tensor, out: torch.Tensor | None = None, *, w_scale: torch.Tensor | None = None,
         residual: torch.Tensor | None = None, prologue: tuple | None = None, x2: torch.Tensor | None = None,
         prologue2: tuple | None = None, backend: str = "reference", ran: list | None = None, path: str | None = None,
         block_n: int | None = None, block_k: int | None = None, split_k: int | None = None,
         num_warps: int | None = None, num_stages: int | None = None, f16: bool | None = None,
         cluster: int | None = None, tile_m: int | None = None, pdl: bool | None = None,
         reduce: str | None = None) -> torch.Tensor:
    """out = pro(x) W^T (+ residual), or [pro(x) | pro2(x2)] W^T with two K segments (module docstring). f16
    (triton, fp8 weights on the dot path): f16 MMAs instead of bf16 (k3lab_kernels.triton.proj_gemv.proj). pdl
    (triton, cute): launched with programmatic dependent launch, the weights' first loads before the wait for the
    kernel before (None: the enclosing pdl_chain's setting, as the decode step runs it)."""
    if out is None and isinstance(x, torch.Tensor) and isinstance(w, torch.Tensor) and x.dim() == 2 and w.dim() == 2:
        out = torch.empty(x.shape[0], w.shape[0], dtype=torch.bfloat16, device=x.device)
    knobs = dict(path=path, block_n=block_n, block_k=block_k, split_k=split_k, num_warps=num_warps,
                 num_stages=num_stages, f16=f16, cluster=cluster, tile_m=tile_m, pdl=pdl, reduce=reduce)
    return _run_proj("proj", x, w, [out], w_scale, residual, backend, ran, knobs, prologue, x2=x2,
                     prologue2=prologue2)[0]


def proj_group(x: torch.Tensor, w: torch.Tensor, outs, *, w_scale: torch.Tensor | None = None,
               select: Select | None = None, backend: str = "reference", ran: list | None = None,
               path: str | None = None,
               block_n: int | None = None, block_k: int | None = None, split_k: int | None = None,
               num_warps: int | None = None, num_stages: int | None = None,
               f16: bool | None = None, chain: tuple | None = None, glu: tuple | None = None,
               cluster: int | None = None, tile_m: int | None = None, pdl: bool | None = None,
               reduce: str | None = None) -> list[torch.Tensor]:
    """outs[i] = x W_i^T for the row ranges of the concatenated W, one launch (module docstring). chain (cute; the
    reference backends by torch after the group): (w2 [NF, R], f [B, NF]) also forms f = outs[0] w2^T in the same
    launch from the stored (rounded) outs[0] (k3lab_kernels.cute.proj_gemv: the KDA decay's two factors). glu (cute
    and the reference backends): (b1, b2): the last output [B, I] is situ(g, u) over W's last 2 I rows [g | u]
    (each rounded to bf16 first, as a stored projection output; fp64 for the oracle; I even on cute). pdl: as for
    `proj`."""
    if not isinstance(outs, (list, tuple)):
        _fail("outs", f"must be a list of output tensors, got {type(outs).__name__}")
    knobs = dict(path=path, block_n=block_n, block_k=block_k, split_k=split_k, num_warps=num_warps,
                 num_stages=num_stages, f16=f16, cluster=cluster, tile_m=tile_m, pdl=pdl, reduce=reduce)
    return _run_proj("proj_group", x, w, list(outs), w_scale, None, backend, ran, knobs, select=select, chain=chain,
                     glu=glu)


def prefetch_plan(w: torch.Tensor, batch: int, budget: int, prologue: bool = False) -> dict:
    """What prefetch_l2 pulls in for proj(x [batch, K], w): the projection's split-K range (its default launch
    configuration) and the span of columns at the start of each range that fits `budget` bytes."""
    from k3lab_kernels.triton import l2_prefetch as pf
    from k3lab_kernels.triton.proj_gemv import config, tma_ok

    N, K = w.shape
    fp8 = w.dtype == torch.float8_e4m3fn
    cfg = config(batch, N, K, w.device, fp8=fp8, tma=tma_ok(w, w), prologue=prologue)
    ksplit = K if cfg["path"] == "rows" else cfg["KSPLIT"]
    span = pf.span_for(N, K, ksplit, w.element_size(), budget)
    S = -(-K // ksplit)
    el = pf.LINE // w.element_size()
    lines = N * S * (-(-min(span, ksplit) // el)) if span else 0
    return dict(path=cfg["path"], ksplit=ksplit, splits=S, span=span, lines=lines, bytes=lines * pf.LINE)


def prefetch_lines(N: int, K: int, ksplit: int, span: int, esize: int) -> torch.Tensor:
    """The lines a prefetch covers, in the kernel's order (row, split, line): each line's first element index
    into W [N, K], -1 for a line past the end of a short last range (torch; the record's reference)."""
    from k3lab_kernels.triton.l2_prefetch import LINE

    el = LINE // esize
    S, lps = -(-K // ksplit), -(-min(span, ksplit) // el)
    col = torch.arange(S)[:, None] * ksplit + torch.arange(lps)[None, :] * el  # [S, lps]
    off = torch.arange(N)[:, None, None] * K + col[None]
    return torch.where(col[None] < K, off, torch.full_like(off, -1)).reshape(-1)


def prefetch_l2(w: torch.Tensor, batch: int, *, budget: int, prologue: bool = False,
                record: torch.Tensor | None = None, backend: str = "triton", ran: list | None = None) -> dict:
    """The `prefetch` switch's kernel (module docstring): returns prefetch_plan's dict. backend "reference"
    prefetches nothing (a hint has no reference); with `record` it writes prefetch_lines (torch)."""
    _tensor("w", w, 2, W_DTYPES)
    if not w.is_contiguous():
        _fail("w", "must be contiguous (the projection's weight)")
    if isinstance(batch, bool) or not isinstance(batch, int) or not 1 <= batch <= MAX_BATCH:
        _fail("batch", f"must be the projection's batch, an int in 1..{MAX_BATCH}, got {batch!r}")
    if isinstance(budget, bool) or not isinstance(budget, int) or budget < 0:
        _fail("budget", f"must be a byte count >= 0, got {budget!r}")
    be, opts, why = _select("l2_prefetch", backend, batch, {})
    plan = prefetch_plan(w, batch, budget, bool(prologue))
    if record is not None:
        _tensor("record", record, 1, (torch.int64,), w.device)
        if record.numel() < plan["lines"]:
            _fail("record", f"must hold at least {plan['lines']} entries (the lines), got {record.numel()}")
    if be in ("triton", "cute") and plan["lines"]:  # the same plan: a hint a line, or one bulk hint a range (cute)
        dispatch.kernel("l2_prefetch", be)(w, plan["ksplit"], plan["span"], record=record)
    elif record is not None and plan["lines"]:
        record[:plan["lines"]].copy_(prefetch_lines(*w.shape, plan["ksplit"], plan["span"], w.element_size()))
    dispatch.record(ran, op="l2_prefetch", backend_requested=backend, backend=be,
                    kernel=dispatch.kernel_path("l2_prefetch", be), options=opts,
                    shape=dict(batch=batch, N=w.shape[0], K=w.shape[1], budget=budget, **plan), why=why)
    return plan


# ---- router --------------------------------------------------------------------------------------------

def topk_reference(logits: torch.Tensor, e_bias: torch.Tensor, top_k: int, scaling: float = 1.0):
    """torch in fp32 (fp64 for fp64 logits) with the tie rule (lower id first): (idx int64, weights)."""
    dt = torch.float64 if logits.dtype == torch.float64 else torch.float32
    s = torch.sigmoid(logits.to(dt))
    idx = torch.sort(-(s + e_bias.to(dt)), dim=-1, stable=True).indices[:, :top_k]
    sel = torch.gather(s, -1, idx)
    return idx, sel / sel.sum(-1, keepdim=True) * scaling


def router_topk(logits: torch.Tensor, e_bias: torch.Tensor, *, top_k: int = 16, scaling: float = 1.0,
                idx: torch.Tensor | None = None, weights: torch.Tensor | None = None, backend: str = "reference",
                ran: list | None = None, num_warps: int | None = None,
                pdl: bool | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(idx [B, k] int64, weights [B, k] fp32) from the router's logits [B, E] (module docstring)."""
    _tensor("logits", logits, 2)
    if not logits.is_floating_point():
        _fail("logits", f"must be floating [B, E], got {logits.dtype}")
    B, E = logits.shape
    dev = logits.device
    if B < 1:
        _fail("logits", f"must have at least one row, got shape {tuple(logits.shape)}")
    if isinstance(top_k, bool) or not isinstance(top_k, int) or not 1 <= top_k <= min(E, 32):
        _fail("top_k", f"must be an int in 1..{min(E, 32)} (at most the {E} experts and 32), got {top_k!r}")
    if isinstance(scaling, bool) or not isinstance(scaling, (int, float)):
        _fail("scaling", f"must be a number, got {scaling!r}")
    _tensor("e_bias", e_bias, 1, None, dev)
    if e_bias.shape[0] != E:
        _fail("e_bias", f"must be [{E}] (one per expert), got {tuple(e_bias.shape)}")
    be, opts, why = _select("router_topk", backend, B, dict(num_warps=num_warps, pdl=pdl))
    if be in ("triton", "cute"):
        if logits.dtype != torch.float32 or logits.stride(1) != 1:
            _fail("logits", f"must be fp32 with unit stride along E for the {be} backend, got {logits.dtype}")
        if e_bias.dtype != torch.float32 or not e_bias.is_contiguous():
            _fail("e_bias", f"must be a contiguous fp32 tensor for the {be} backend, got {e_bias.dtype}")
    if be == "cute" and E > 1024:
        _fail("logits", f"must have at most 1024 experts for the cute backend, got {E}")
    for name, t, dts in (("idx", idx, (torch.int64,)), ("weights", weights, (torch.float32, torch.float64))):
        if t is not None:
            _tensor(name, t, 2, dts, dev)
            if tuple(t.shape) != (B, top_k) or not t.is_contiguous():
                _fail(name, f"must be a contiguous [{B}, {top_k}] tensor, got {tuple(t.shape)}")
    if idx is None:
        idx = torch.empty(B, top_k, dtype=torch.int64, device=dev)
    if weights is None:
        weights = torch.empty(B, top_k, dtype=torch.float32, device=dev)
    if be in ("triton", "cute"):
        dispatch.kernel("router_topk", be)(logits, e_bias, idx, weights, top_k=top_k, scaling=scaling, **opts)
    else:
        fn = topk_reference if be == "reference" else dispatch.compiled("trunk.topk", topk_reference)
        i, w = fn(logits, e_bias, top_k, float(scaling))
        idx.copy_(i)
        weights.copy_(w)
    dispatch.record(ran, op="router_topk", backend_requested=backend, backend=be,
                    kernel=dispatch.kernel_path("router_topk", be), options=opts,
                    shape=dict(batch=B, experts=E, top_k=top_k), why=why)
    return idx, weights


def route(h: torch.Tensor, router: RouterWeights, *, backend: str = "reference", ran: list | None = None,
          w_scale: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """The router projection into fp32 logits, then router_topk, each through the dispatcher (backend "cute": the
    projection on triton, whose batch range the CuTe projection (<= 16 rows) does not cover;
    torch_compile: the reference GEMM). Backend "triton" up to its SELECT_MAX_BATCH rows: one launch, the selection
    fused into the projection (proj_group's `select`, the MoE input group's form in the decode step)."""
    if not isinstance(router, RouterWeights):
        _fail("router", f"must be k3lab.ref.router.RouterWeights, got {type(router).__name__}")
    _tensor("h", h, 2)
    dt = torch.float64 if h.dtype == torch.float64 else torch.float32  # the oracle stays fp64 throughout
    logits = torch.empty(h.shape[0], router.n_experts, dtype=dt, device=h.device)
    from k3lab_kernels.triton.proj_gemv import SELECT_MAX_BATCH, default_path

    B = h.shape[0]
    if backend == "triton" and dt == torch.float32 and B <= SELECT_MAX_BATCH and router.top_k <= 32:
        idx = torch.empty(B, router.top_k, dtype=torch.int64, device=h.device)
        wk = torch.empty(B, router.top_k, dtype=torch.float32, device=h.device)
        sel = Select(router.e_bias.to(dt).contiguous(), idx, wk, router.scaling)
        # the register path ("rows", few outputs at batch 1) runs no fused selection: its tiled form then
        path = "dot" if default_path(B, router.n_experts, w_scale is not None,
                                          K=router.w.shape[1]) == "rows" else None
        proj_group(h, router.w, [logits], w_scale=w_scale, select=sel, backend="triton", ran=ran, path=path)
        return idx, wk
    proj(h, router.w, logits, w_scale=w_scale, backend={"torch_compile": "reference", "cute": "triton"}.get(
        backend, backend), ran=ran)  # (a projection's torch.compile is cuBLAS: the reference GEMM)
    return router_topk(logits, router.e_bias.to(dt).contiguous(), top_k=router.top_k, scaling=router.scaling,
                       backend=backend, ran=ran)
