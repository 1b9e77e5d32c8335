"""Latent MoE component API (k3lab.ref.moe / k3lab.ref.router have the maths).

    forward(h, weights, out=None, *, backend="reference") -> out [B, D]      routed + shared
    route(h, router, *, backend="reference") -> (idx [B, k], weights [B, k])
    experts(z, idx, weights_k, moe, *, backend="reference", out=None, check_values=True, ran=None, **knobs)
        -> y [B, L] (float32)   the routed sum only

Experts may be stored dense (bf16), fp8 or MXFP4 (`ExpertWeight`); the reference dequantizes per expert.
Backends of forward/route: "reference", "torch_compile" (compiles the per-expert FFN, dynamic in the token
count, and the router; the loop over selected experts stays eager); others are refused with
BackendUnavailable. `experts` goes through the one dispatcher (op "moe_experts", k3lab.ops.moe):
  reference, torch_compile   k3lab.ref.moe.routed_experts (compute dtype fp32, fp64 for fp64 inputs)
  triton                     k3lab_kernels.triton.moe_experts: one launch (plus y's zeroing on the grouped
                             path), grouped by expert on the device (no host sync: capturable in a CUDA graph);
                             z bf16, idx int32/int64, weights_k fp32, dense experts bf16, fp8 with fp32
                             per-output-channel scales, or MXFP4
  cute                       MXFP4 experts, knob `path`: "token" (k3lab_kernels.cute.moe_experts, one token: two
                             launches, w1/w3 + SiTU then w2, no atomics) or "grouped" (k3lab_kernels.cute.moe_grouped,
                             several tokens: pairs grouped by expert on the device, tensor-core fragments straight from
                             the kernel layout, w2 into y with fp32 atomics); None: token at batch 1, grouped above
                             (recorded as run); bf16 / fp8 experts likewise (k3lab_kernels.cute.moe_dense: "token",
                             the same two launches with fp32 products; "grouped", tensor cores on the stored weights);
                             refused by name otherwise (the op's `supports`, given the call's shape)
  auto                       data/moe_defaults.json (measured: cute for MXFP4 up to 64 tokens where CuTe DSL runs,
                             its rules limited to that format; else triton), else the reference
The triton knobs: `path` ("gemv": the few-token two-role kernel for bf16 / fp8, batch <= 16; "simt": its
CUDA-core sibling for MXFP4, batch <= 64; "grouped": the tensor-core kernel; "tc": the grouped kernel for MXFP4 on the
simt path's decode and f16 tensor cores; None: the kernel's rule by format
and batch, `default_path`, recorded as run), block_n, block_k, block_l, block_t, num_warps, num_stages, persist,
maxnreg (None: the kernel's tiles for the path; persist: programs per SM on the simt path, 0 one item a program;
maxnreg: the simt path's register cap a thread, the kernel's 128 above batch 1, recorded as run), leaders (the
simt path: a prologue lists the groups' leaders and the tickets run over them only; None: from batch 16, recorded
as run; the tc path: the same list, the programs past it exit at once; None: on, recorded as run), wait (the
simt path: a role-B item waits for "all" role-A items or only its own "expert"'s; None: the kernel's choice,
recorded as run). `check_values=False` skips the host-side check that idx holds valid ids (a device sync): pass
it on timed or graph-captured paths. Argument errors are MoEArgumentError (a ValueError) naming the argument.

MXFP4 on the simt path reads the codes in the kernel's layout (k3lab.mxfp4.to_kernel_layout, the same bytes
rearranged): `kernel_layout(w)` makes that copy of an ExpertWeight on its first use and keeps it while the
weight lives (the caller holds the natural layout, which the reference reads, and this copy: +1x the packed
codes). Make the first call, or `prepare(moe)`, outside a CUDA graph capture.
"""
from __future__ import annotations

import functools
import weakref

import torch

from k3lab import mxfp4
from k3lab.components import dispatch
from k3lab.components.dispatch import resolve_backend, write_out
from k3lab.ref import moe as ref
from k3lab.ref import router as ref_router
from k3lab.ref.moe import MoEWeights
from k3lab.ref.router import RouterWeights

COMPONENT = "moe"
OP = "moe_experts"
TRITON_FORMATS = {"dense": "bf16", "fp8": "fp8", "mxfp4": "mxfp4"}


class MoEArgumentError(ValueError):
    """An argument of the MoE component API has the wrong type, shape, dtype, device or value."""


def _fail(name: str, msg: str):
    raise MoEArgumentError(f"{COMPONENT}: {name!r} {msg}")


def _check_h(h, D: int, name: str = "h") -> None:
    if not isinstance(h, torch.Tensor) or h.dim() != 2 or h.shape[1] != D or not h.is_floating_point():
        raise ValueError(f"{COMPONENT}: {name!r} must be a floating tensor [B, {D}], got "
                         f"{tuple(getattr(h, 'shape', ()))}")


def forward(h: torch.Tensor, weights: MoEWeights, out: torch.Tensor | None = None, *,
            backend: str = "reference") -> torch.Tensor:
    if not isinstance(weights, MoEWeights):
        raise TypeError(f"{COMPONENT}: 'weights' must be k3lab.ref.moe.MoEWeights, got {type(weights).__name__}")
    _check_h(h, weights.w_down.shape[1])
    # the expert loop stays eager (data-dependent); the per-expert FFN and the router are what compile
    ffn = resolve_backend(COMPONENT, backend, ref.glu_ffn, "glu_ffn", dynamic=True)
    router = resolve_backend("router", backend, ref_router.route, "route")
    y = ref.moe_forward(h, weights, ffn=ffn, router=router)
    return write_out(COMPONENT, y, out)


def route(h: torch.Tensor, router: RouterWeights, *, backend: str = "reference"):
    if not isinstance(router, RouterWeights):
        raise TypeError(f"{COMPONENT}: 'router' must be k3lab.ref.router.RouterWeights, got {type(router).__name__}")
    _check_h(h, router.w.shape[1])
    idx, w, _ = resolve_backend("router", backend, ref_router.route, "route")(h, router)
    return idx, w


def weight_format(w) -> str:
    """The experts' weight format as the measured rules (data/moe_defaults.json, `fmt`) and the registry's cases
    name it: "bf16", "fp8" or "mxfp4" (an ExpertWeight's dense storage is "dense": passed on as that, the bf16
    rules never matched a bf16 pool and `auto` ran Triton where the rule says the CuTe one-token kernel)."""
    return "bf16" if w.fmt == "dense" else w.fmt


def experts(z: torch.Tensor, idx: torch.Tensor, weights_k: torch.Tensor, moe: MoEWeights, *,
            backend: str = "reference", out: torch.Tensor | None = None, check_values: bool = True,
            path: str | None = None, block_n: int | None = None, block_k: int | None = None,
            block_l: int | None = None, block_t: int | None = None, num_warps: int | None = None,
            num_stages: int | None = None, persist: int | None = None, maxnreg: int | None = None,
            leaders: bool | None = None, wait: str | None = None, ran: list | None = None,
            glue: tuple | None = None) -> torch.Tensor:
    """y [B, L] = sum_k weights_k[b,k] * expert_{idx[b,k]}(z[b]) (module docstring); `out` filled when given.
    glue (the cute backend's one-token path, and the reference backends by torch after y): (gamma [L] bf16, yg
    [1, L] bf16, ssp [1, P] fp32): also yg = bf16(y * gamma) and ssp[0, c] = the sum of y^2 over rows c L/P ..
    (c + 1) L/P - 1 (P = k3lab_kernels.cute.moe_experts.glue_partials(L)): the MoE output's routed norm folded into
    the launches around it (k3lab.step.moe_glue_fold)."""
    if not isinstance(moe, MoEWeights):
        raise TypeError(f"{COMPONENT}: 'moe' must be k3lab.ref.moe.MoEWeights, got {type(moe).__name__}")
    _check_h(z, moe.w_down.shape[0], "z")
    if not isinstance(idx, torch.Tensor) or not isinstance(weights_k, torch.Tensor):
        raise TypeError(f"{COMPONENT}: 'idx' and 'weights_k' must be tensors, got {type(idx).__name__} and "
                        f"{type(weights_k).__name__}")
    if idx.dtype not in (torch.int32, torch.int64):
        _fail("idx", f"must hold int32/int64 expert ids, got {idx.dtype}")
    if not weights_k.is_floating_point():
        _fail("weights_k", f"must be floating, got {weights_k.dtype}")
    if idx.shape != weights_k.shape or idx.shape[0] != z.shape[0] or idx.dim() != 2:
        raise ValueError(f"{COMPONENT}: 'idx' and 'weights_k' must both be [{z.shape[0]}, k], got "
                         f"{tuple(idx.shape)} and {tuple(weights_k.shape)}")
    if check_values and (int(idx.min()) < 0 or int(idx.max()) >= moe.router.n_experts):
        raise ValueError(f"{COMPONENT}: 'idx' must hold expert ids in 0..{moe.router.n_experts - 1}")
    B, L = z.shape
    if out is not None and (not isinstance(out, torch.Tensor) or tuple(out.shape) != (B, L)
                            or out.device != z.device or not out.is_floating_point()):
        _fail("out", f"must be a floating tensor [{B}, {L}] on {z.device}, got "
                     f"{tuple(getattr(out, 'shape', ()))} {getattr(out, 'dtype', type(out).__name__)}")
    be, auto_opts, why = dispatch.select(OP, backend, B=B, shape=dict(B=B, fmt=weight_format(moe.w1),
                                                                      K=idx.shape[1], I=moe.w1.shape[1], L=L))
    if glue is not None and (be not in ("cute", "reference", "torch_compile") or B != 1
                             or (be == "cute" and path not in (None, "token"))):
        _fail("glue", f"(yg and the partial sums of y^2 beside y) is taken by the cute backend's one-token path and "
                      f"the reference backends at batch 1, got backend {be!r}, batch {B}, path {path!r}")
    knobs = dict(path=path, block_n=block_n, block_k=block_k, block_l=block_l, block_t=block_t, num_warps=num_warps,
                 num_stages=num_stages, persist=persist, maxnreg=maxnreg, leaders=leaders, wait=wait)
    if check_values and be in ("triton", "cute") and moe.w1.fmt == "mxfp4":
        check_scales(moe)
    rec = dict(op=OP, backend_requested=backend, backend=be, why=why,
               shape=dict(B=B, L=L, K=idx.shape[1], E=moe.router.n_experts, I=moe.w1.shape[1],
                          fmt=weight_format(moe.w1)))
    if be == "triton":
        from k3lab_kernels.triton.moe_experts import MAX_BATCH as KB

        if B > KB:  # e.g. a verify of 64 sequences x 8 positions: the kernel's batch at a time, into out's rows
            if out is None:
                out = torch.empty(B, L, dtype=torch.float32, device=z.device)
            elif out.dtype != torch.float32 or not out.is_contiguous():
                _fail("out", f"must be a contiguous float32 tensor for the triton backend, got {out.dtype}")
            sub: list = []
            for s in range(0, B, KB):
                experts(z[s:s + KB], idx[s:s + KB], weights_k[s:s + KB], moe, backend="triton", out=out[s:s + KB],
                        check_values=False, ran=sub, **knobs)
            dispatch.record(ran, kernel=sub[0].kernel, options=sub[0].options,
                            notes=f"{len(sub)} launches of <= {KB} tokens (the kernel's batch; each reads the experts "
                                  f"its tokens chose again): {'; '.join(r.notes for r in sub)}", **rec)
            return out
        knobs = {k: (v if v is not None else auto_opts.get(k)) for k, v in knobs.items()}
        rule = "requested"
        if knobs["path"] is None:  # the kernel's rule by format and batch, recorded as run
            from k3lab_kernels.triton.moe_experts import default_path

            knobs["path"], rule = default_path(B, TRITON_FORMATS[moe.w1.fmt]), "the kernel's rule by format and batch"
        args = _triton_args(z, idx, weights_k, moe, out, knobs)
        if knobs["path"] in ("simt", "tc"):  # the register cap, the leaders' list, the wait the kernel applies
            from k3lab_kernels.triton.moe_experts import default_blocks

            d = default_blocks(B, idx.shape[1], moe.w1.shape[1], L, "mxfp4", knobs["path"])
            knobs = dict(knobs, **{k: d[k] for k in ("maxnreg", "leaders", "wait") if k in d and knobs[k] is None})
        y = dispatch.kernel(OP, be)(*args["pos"], **args["kw"], **knobs)
        dispatch.record(ran, kernel=dispatch.kernel_path(OP, be), options=knobs, notes=f"path {knobs['path']} ({rule})",
                        **rec)
        return y
    if any(v is not None for k, v in knobs.items() if not (be == "cute" and k == "path")):
        _fail("path" if path is not None else "block_n",
              f"and the other kernel knobs are for the triton backend; backend {be!r} takes "
              f"{'only path' if be == 'cute' else 'none'}")
    if be == "cute":  # MXFP4: one token (kernels/cute/moe_experts.py) or grouped (kernels/cute/moe_grouped.py); bf16 /
        # fp8: one token (kernels/cute/moe_dense.py)
        fmts = {moe.w1.fmt, moe.w3.fmt, moe.w2.fmt}
        if len(fmts) != 1:
            _fail("moe", f"must hold w1, w3 and w2 in one format for the cute backend, got {sorted(fmts)}")
        dense = moe.w1.fmt != "mxfp4"
        cpath = path if path is not None else ("token" if B == 1 else "grouped")
        if cpath not in ("token", "grouped"):
            _fail("path", f"must be None, 'token' or 'grouped' for the cute backend, got {path!r}")
        if cpath == "token" and B != 1:
            _fail("z", f"must be one token for the cute backend's path 'token' (batch 1), got batch {B}")
        if out is None:
            out = torch.empty(B, L, dtype=torch.float32, device=z.device)
        elif out.dtype != torch.float32 or not out.is_contiguous():
            _fail("out", f"must be a contiguous float32 tensor for the cute backend, got {out.dtype}")
        if dense and glue is not None:
            _fail("glue", "is taken by the cute backend's MXFP4 one-token path only")
        if dense:
            from k3lab_kernels.cute import moe_dense as md

            fp8 = moe.w1.fmt == "fp8"
            fn = md.moe_experts_dense if cpath == "token" else md.moe_grouped_dense
            y = fn(z, idx, weights_k, moe.w1.data, moe.w3.data, moe.w2.data,
                   *((moe.w1.scale, moe.w3.scale, moe.w2.scale) if fp8 else (None, None, None)), out,
                   b1=float(moe.b1), b2=float(moe.b2))
            rule = "requested" if path is not None else "by batch: token at 1, grouped above"
            note = ("two launches: up (w1/w3 + SiTU), down (w2; no atomics)" if cpath == "token" else
                    "two launches: up (pairs grouped by expert, w1/w3 on tensor cores + SiTU), down (w2 on tensor "
                    "cores, fp32 atomics into y)")
            dispatch.record(ran, kernel=f"k3lab_kernels.cute.moe_dense:{fn.__name__}", options=dict(path=cpath),
                            notes=f"path {cpath} ({TRITON_FORMATS[moe.w1.fmt]}): {note} ({rule})", **rec)
            return y
        if cpath == "token":
            ws = tuple(kernel_layout(w) for w in (moe.w1, moe.w3, moe.w2))
            fn, kpath = dispatch.kernel(OP, be), dispatch.kernel_path(OP, be)
            note = "path token: two launches: up (w1/w3 + SiTU), down (w2; no atomics)"
        else:  # the grouped up kernel reads W1 / W3 quad-transposed (one 16-byte load a lane, four blocks)
            from k3lab_kernels.cute import moe_grouped as mg

            quad2 = _w2_quad(moe)
            fn = functools.partial(mg.moe_grouped, w2_quad=quad2)
            ws = (kernel_layout(moe.w1, quad=True), kernel_layout(moe.w3, quad=True), kernel_layout(moe.w2, quad=quad2))
            kpath = "k3lab_kernels.cute.moe_grouped:moe_grouped"
            note = ("path grouped: two launches: up (pairs grouped by expert, w1/w3 on tensor cores + SiTU), down (w2 "
                    "on tensor cores, fp32 atomics into y)")
        rule = "requested" if path is not None else "by batch: token at 1, grouped above"
        y = fn(z, idx, weights_k, *ws, moe.w1.scale, moe.w3.scale, moe.w2.scale, out, b1=float(moe.b1),
               b2=float(moe.b2), **({} if glue is None else {"glue": tuple(glue)}))
        dispatch.record(ran, kernel=kpath, options=dict(path=cpath), notes=f"{note} ({rule})", **rec)
        return y
    ffn = ref.glu_ffn
    kernel = dispatch.kernel_path(OP, be)
    if be == "torch_compile":
        ffn, kernel = dispatch.compiled(f"{COMPONENT}.glu_ffn", ref.glu_ffn, dynamic=True), f"torch.compile({kernel})"
    y = ref.routed_experts(z, idx, weights_k, moe, ffn)
    dispatch.record(ran, kernel=kernel, options={}, **rec)
    y = y if out is None else out.copy_(y)
    if glue is not None:
        gam, yg, ssp = glue
        yf = y.float()
        yg.copy_((yf * gam.float()).to(yg.dtype))
        ssp.copy_((yf * yf).view(1, ssp.shape[1], -1).sum(2))
    return y


_kernel_layouts: dict[tuple, tuple] = {}


def _w2_quad(moe: MoEWeights) -> bool:
    """Whether the grouped CuTe kernels read W2 quad-transposed: where I % 128 == 0 (its packed rows I / 2 bytes),
    whole groups of four blocks a row (16-byte loads in the down kernel)."""
    return moe.w2.data.shape[-1] % 64 == 0


# the E8M0 scales every fused MXFP4 kernel decodes exactly (the strictest: the Triton grouped path's fp16 bit pattern
# times 2^(s - 113), kernels/triton/moe_experts.py; the SIMT and CuTe decodes take 0..246)
EXACT_SCALES = (2, 240)
_scales_ok: dict[int, tuple] = {}


def check_scales(moe: MoEWeights) -> None:
    """Refuse MXFP4 experts whose E8M0 scales leave EXACT_SCALES (weights below 2^-125 or above 6 x 2^113): the fused
    kernels would decode them inexactly, so the triton and cute backends take no such weights (the reference does).
    One device reduction a weight, remembered while its scales live unmodified; `experts` runs it when check_values
    is on, `prepare` always (before a CUDA graph capture)."""
    lo, hi = EXACT_SCALES
    for name in ("w1", "w3", "w2"):
        sc = getattr(moe, name).scale
        key = id(sc)
        hit = _scales_ok.get(key)
        if hit is not None and hit[0]() is sc and hit[1] == sc._version:
            continue
        s_min, s_max = (int(v) for v in torch.aminmax(sc))
        if s_min < lo or s_max > hi:
            _fail("moe", f"{name}'s MXFP4 scales must be E8M0 exponents in {lo}..{hi} for the fused kernels' exact "
                         f"decode, got {s_min}..{s_max} (the reference backend takes any)")
        _scales_ok[key] = (weakref.ref(sc, lambda _r, key=key: _scales_ok.pop(key, None)), sc._version)


def kernel_layout(w, quad: bool = False) -> torch.Tensor:
    """The SIMT path's copy of an MXFP4 ExpertWeight's codes (k3lab.mxfp4.to_kernel_layout: [E, out, in/8] int32,
    the same bytes rearranged; quad=True: with k3lab.mxfp4.quad_transpose applied, the grouped CuTe up kernel's),
    made on first use and kept while `w.data` lives and is not modified in place (its version counter). Make the
    first call outside a CUDA graph capture (it converts the whole stack once)."""
    d = w.data
    key = (id(d), bool(quad))
    hit = _kernel_layouts.get(key)
    if hit is not None and hit[0]() is d and hit[1] == d._version:
        return hit[2]
    k = mxfp4.to_kernel_layout(d, quad=quad)
    _kernel_layouts[key] = (weakref.ref(d, lambda _r, key=key: _kernel_layouts.pop(key, None)), d._version, k)
    return k


def prepare(moe: MoEWeights, tokens: int | None = None, backend: str = "auto") -> None:
    """Make the kernels' per-format copies of MXFP4 experts ahead of time, e.g. before capturing a CUDA graph (a
    no-op for bf16 / fp8 experts). tokens None: the plain kernel layout of w1, w3, w2 (the triton backend's and the
    one-token CuTe kernels'). tokens given: only what `experts` at that many tokens on `backend` (resolved as the
    call resolves it) reads: the plain layout (triton; cute at one token), or W1 / W3 quad-transposed and W2 plain
    or quad-transposed (cute's grouped kernels, `moe_grouped`), so a step of many tokens keeps no unused copy (at TP8
    each full copy of a layer stack's codes is ~22 GB over 12 MoE layers)."""
    if not isinstance(moe, MoEWeights):
        raise TypeError(f"{COMPONENT}: 'moe' must be k3lab.ref.moe.MoEWeights, got {type(moe).__name__}")
    if moe.w1.fmt != "mxfp4":
        return
    check_scales(moe)
    if tokens is None:
        for w in (moe.w1, moe.w3, moe.w2):
            kernel_layout(w)
        return
    if isinstance(tokens, bool) or not isinstance(tokens, int) or tokens < 1:
        _fail("tokens", f"must be None or a positive int, got {tokens!r}")
    be, _, _ = dispatch.select(OP, backend, B=tokens, shape=dict(B=tokens, fmt=weight_format(moe.w1),
                                                                  K=moe.router.top_k, I=moe.w1.shape[1],
                                                                  L=moe.w1.shape[2]))
    if be == "cute" and tokens > 1:
        for w, quad in ((moe.w1, True), (moe.w3, True), (moe.w2, _w2_quad(moe))):
            kernel_layout(w, quad=quad)
    elif be in ("cute", "triton"):
        for w in (moe.w1, moe.w3, moe.w2):
            kernel_layout(w)


def _triton_args(z, idx, wk, moe: MoEWeights, out, knobs: dict) -> dict:
    """Validate the triton backend's inputs (each named) and build the kernel's arguments."""
    from k3lab_kernels.triton.moe_experts import (BLOCK_N_ALLOWED, BLOCK_T_ALLOWED, GEMV_MAX_BATCH, MAX_BATCH, PATHS,
                                                  SIMT_MAX_BATCH, SIMT_TOKENS, SIMT_WAITS)

    B, L = z.shape
    dev = z.device
    if z.dtype != torch.bfloat16 or not z.is_contiguous():
        _fail("z", f"must be a contiguous bf16 tensor for the triton backend, got {z.dtype}")
    if idx.dtype not in (torch.int32, torch.int64) or not idx.is_contiguous() or idx.device != dev:
        _fail("idx", f"must be a contiguous int32/int64 tensor on {dev} for the triton backend, got {idx.dtype} on "
                     f"{idx.device}")
    if wk.dtype != torch.float32 or not wk.is_contiguous() or wk.device != dev:
        _fail("weights_k", f"must be a contiguous float32 tensor on {dev} for the triton backend, got {wk.dtype}")
    if not 1 <= B <= MAX_BATCH:
        _fail("z", f"batch must be in 1..{MAX_BATCH} for the triton backend, got {B}")
    fmts = {moe.w1.fmt, moe.w3.fmt, moe.w2.fmt}
    if len(fmts) != 1:
        _fail("moe", f"w1, w3, w2 must share one format for the triton backend, got {sorted(fmts)}")
    fmt = moe.w1.fmt
    E, I, L1 = moe.w1.shape
    if moe.w3.shape != (E, I, L1) or moe.w2.shape != (E, L1, I) or L1 != L:
        _fail("moe", f"experts must be w1, w3 [E, I, {L}] and w2 [E, {L}, I], got {moe.w1.shape}, "
                     f"{moe.w3.shape}, {moe.w2.shape}")
    for name in ("w1", "w3", "w2"):
        w = getattr(moe, name)
        if w.data.device != dev or not w.data.is_contiguous():
            _fail("moe", f"{name} must be contiguous on {dev}")
        if fmt == "dense" and w.data.dtype != torch.bfloat16:
            _fail("moe", f"dense {name} must be bf16 for the triton backend, got {w.data.dtype}")
        if fmt == "fp8" and (w.scale is None or w.scale.dtype != torch.float32 or w.scale.shape != w.data.shape[:2]
                             or not w.scale.is_contiguous()):
            _fail("moe", f"fp8 {name} needs contiguous float32 per-output-channel scales {tuple(w.data.shape[:2])}")
        if fmt == "mxfp4" and not w.scale.is_contiguous():
            _fail("moe", f"mxfp4 {name} scales must be contiguous")
    if fmt == "mxfp4" and (I % 32 or L % 32):
        _fail("moe", f"mxfp4 experts need I and L multiples of 32, got I={I}, L={L}")
    path = knobs["path"]
    if (path not in PATHS or (path == "gemv" and (B > GEMV_MAX_BATCH or fmt == "mxfp4"))
            or (path == "simt" and (fmt != "mxfp4" or B > SIMT_MAX_BATCH))
            or (path == "tc" and (fmt != "mxfp4" or I % 64))):
        _fail("path", f"must be None or one of {PATHS} ('gemv' for bf16 / fp8 experts and batch <= {GEMV_MAX_BATCH}, "
                      f"'simt' for MXFP4 experts and batch <= {SIMT_MAX_BATCH}, 'tc' for MXFP4 experts with I a "
                      f"multiple of 64), got {path!r} at batch {B} ({fmt}, I={I})")
    if path == "tc" and knobs["block_n"] not in (None, 64):
        _fail("block_n", f"is fixed on the tc path (64 rows: two w2 blocks), got {knobs['block_n']!r}")
    bn = knobs["block_n"]
    if bn is not None and (isinstance(bn, bool) or bn not in BLOCK_N_ALLOWED or I % bn
                           or (fmt == "mxfp4" and path == "grouped" and bn < 32)):
        _fail("block_n", f"must be None or one of {BLOCK_N_ALLOWED} dividing I={I} (>= 32 for mxfp4 on the grouped "
                         f"path), got {bn!r}")
    for name, lo in (("block_k", 32 if fmt != "mxfp4" else 64), ("block_l", 16)):
        v = knobs[name]
        if v is not None and (isinstance(v, bool) or not isinstance(v, int) or v < lo or v & (v - 1) or L % v):
            _fail(name, f"must be None or a power of two >= {lo} dividing L={L}, got {v!r}")
    allowed_t = SIMT_TOKENS if path == "simt" else BLOCK_T_ALLOWED
    if knobs["block_t"] is not None and knobs["block_t"] not in allowed_t:
        _fail("block_t", f"must be None or one of {allowed_t} on the {path} path, got {knobs['block_t']!r}")
    warps = (4, 8) if path == "simt" else (1, 2, 4, 8, 16)
    if knobs["num_warps"] is not None and knobs["num_warps"] not in warps:
        _fail("num_warps", f"must be None or one of {warps} on the {path} path (simt: 2 warps gave wrong sums on the "
                           f"H200, twelfth session; 1 is untested there), got {knobs['num_warps']!r}")
    p_ = knobs["persist"]
    if p_ is not None and (isinstance(p_, bool) or not isinstance(p_, int) or not 0 <= p_ <= 64
                           or (p_ and path != "simt")):
        _fail("persist", f"must be None or 0..64 programs per multiprocessor (the simt path only; 0: one item a "
                         f"program), got {p_!r} on the {path} path")
    r_ = knobs["maxnreg"]
    if r_ is not None and (isinstance(r_, bool) or not isinstance(r_, int) or not 64 <= r_ <= 255 or r_ % 8
                           or path != "simt"):
        _fail("maxnreg", f"must be None or a multiple of 8 in 64..255 registers a thread (the simt path only), got "
                         f"{r_!r} on the {path} path")
    if knobs["leaders"] is not None and (not isinstance(knobs["leaders"], bool) or path not in ("simt", "tc")):
        _fail("leaders", f"must be None, True or False (the simt and tc paths), got {knobs['leaders']!r} on the "
                         f"{path} path")
    if knobs["wait"] is not None and (knobs["wait"] not in SIMT_WAITS or path != "simt"):
        _fail("wait", f"must be None or one of {SIMT_WAITS} (what a role-B item of the simt path waits for), got "
                      f"{knobs['wait']!r} on the {path} path")
    if knobs["num_stages"] is not None and (knobs["num_stages"] not in (1, 2, 3, 4, 5) or path == "simt"):
        _fail("num_stages", f"must be None or one of 1..5 (None on the simt path: its weight steps are register "
                            f"double-buffered), got {knobs['num_stages']!r} on the {path} path")
    if out is None:
        out = torch.empty(B, L, dtype=torch.float32, device=dev)
    elif out.dtype != torch.float32 or not out.is_contiguous():
        _fail("out", f"must be a contiguous float32 tensor for the triton backend, got {out.dtype}")
    if path == "tc":
        ws = tuple(kernel_layout(w) for w in (moe.w1, moe.w3, moe.w2))
        return dict(pos=(z, idx, wk, *ws, out), kw=dict(fmt="mxfp4", s1=moe.w1.scale, s3=moe.w3.scale,
                                                        s2=moe.w2.scale, b1=float(moe.b1), b2=float(moe.b2)))
    if path == "simt":
        if (bn is not None and bn > I) or (knobs["block_l"] is not None and knobs["block_l"] > L):
            _fail("block_n", f"and block_l must not exceed I={I} and L={L} on the simt path")
        if knobs["block_k"] is not None and knobs["block_k"] > L:
            _fail("block_k", f"must not exceed L={L} on the simt path, got {knobs['block_k']}")
        ws = tuple(kernel_layout(w) for w in (moe.w1, moe.w3, moe.w2))
        return dict(pos=(z, idx, wk, *ws, out), kw=dict(fmt="mxfp4", s1=moe.w1.scale, s3=moe.w3.scale,
                                                        s2=moe.w2.scale, b1=float(moe.b1), b2=float(moe.b2)))
    return dict(pos=(z, idx, wk, moe.w1.data, moe.w3.data, moe.w2.data, out),
                kw=dict(fmt=TRITON_FORMATS[fmt], s1=moe.w1.scale, s3=moe.w3.scale, s2=moe.w2.scale,
                        b1=float(moe.b1), b2=float(moe.b2)))
