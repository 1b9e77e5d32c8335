"""AttnRes component API: the residual mix over the block list B and the partial p, optionally fused
with the RMSNorm that follows (k3lab.ref.attnres has the maths).

    mix(blocks, partial, w_norm, w_proj, *, eps=1e-6, backend="reference") -> mix [B, D] float32
    mix_norm(blocks, partial, w_norm, w_proj, norm_w, out=None, *, eps=1e-6, backend="reference", ran=None)
        -> rms(mix; norm_w) [B, D] in partial's dtype (written into `out` when given)
    update_mix_norm(blocks, prefix, new, w_norm, w_proj, norm_w, out=None, partial_out=None, *,
                    update="add", eps=1e-6, backend="reference", ran=None) -> out
        the layer's step in one call: p = prefix ("none"), bf16(prefix + new) ("add") or new ("fresh", the
        first layer of a block), written to partial_out (bf16, may be prefix itself: in place); then
        out = rms(attnres(blocks, p; w_norm, w_proj); norm_w). Registry op "attnres_norm" (k3lab.ops.trunk).

Backends: "reference" (the torch reference) and "torch_compile" (torch.compile of it, one compiled graph
per number of sources) for all three; "triton" (k3lab_kernels.triton.attnres_norm: one launch, bf16
sources of [B, D], B 1..64 and beyond, 0..9 blocks; options num_warps, block_d, path), "cute"
(k3lab_kernels.cute.attnres_norm: one launch, a thread-block cluster per row; options cluster, vec, alpha; the same
bf16 / unit-stride sources) and "auto" (data/trunk_defaults.json) for mix_norm and update_mix_norm, through
the one dispatcher (k3lab.components.dispatch.select/kernel/record). Any other backend is refused with
BackendUnavailable. Argument errors are ValueError/TypeError naming it.
"""
from __future__ import annotations

from collections.abc import Sequence

import torch

from k3lab.ref import attnres as ref
from k3lab.components import dispatch
from k3lab.components.dispatch import resolve_backend

COMPONENT = "attnres"
OP = "attnres_norm"  # the registry entry (k3lab.ops.trunk)
UPDATES = ("none", "add", "fresh")
MAX_BLOCKS = 9


def _check(blocks, partial, w_norm, w_proj, norm_w=None, eps: float = 1e-6) -> None:
    if isinstance(eps, bool) or not isinstance(eps, (int, float)) or not 0 < eps < float("inf"):
        raise ValueError(f"{COMPONENT}: 'eps' must be a positive finite number, got {eps!r}")
    if not isinstance(partial, torch.Tensor) or partial.dim() < 1 or not partial.is_floating_point():
        raise ValueError(f"{COMPONENT}: 'partial' must be a floating tensor [..., D], got "
                         f"{getattr(partial, 'shape', type(partial).__name__)}")
    if not isinstance(blocks, (list, tuple)):
        raise TypeError(f"{COMPONENT}: 'blocks' must be a list of tensors shaped like partial, got "
                         f"{type(blocks).__name__}")
    for i, b in enumerate(blocks):
        if not isinstance(b, torch.Tensor) or b.shape != partial.shape:
            raise ValueError(f"{COMPONENT}: 'blocks[{i}]' must have partial's shape {tuple(partial.shape)}, got "
                             f"{tuple(getattr(b, 'shape', ()))}")
        if b.device != partial.device:
            raise ValueError(f"{COMPONENT}: 'blocks[{i}]' is on {b.device}, partial on {partial.device}")
    D = partial.shape[-1]
    for name, v in (("w_norm", w_norm), ("w_proj", w_proj), ("norm_w", norm_w)):
        if v is None and name == "norm_w":
            continue
        if not isinstance(v, torch.Tensor) or v.shape != (D,):
            raise ValueError(f"{COMPONENT}: {name!r} must have shape [{D}], got {tuple(getattr(v, 'shape', ()))}")


def mix(blocks: Sequence[torch.Tensor], partial: torch.Tensor, w_norm: torch.Tensor, w_proj: torch.Tensor, *,
        eps: float = 1e-6, backend: str = "reference") -> torch.Tensor:
    """sum_i softmax(score)_i s_i over B + [p], in float32 (float64 if the inputs are)."""
    _check(blocks, partial, w_norm, w_proj, eps=eps)
    eps = float(eps)
    fn = resolve_backend(COMPONENT, backend, ref.attnres, "mix")
    return fn(list(blocks), partial, w_norm, w_proj, eps)


def _mix_norm(blocks, partial, w_norm, w_proj, norm_w, eps):
    return ref.attnres_norm(blocks, partial, w_norm, w_proj, norm_w, eps)[1]


def mix_norm(blocks: Sequence[torch.Tensor], partial: torch.Tensor, w_norm: torch.Tensor, w_proj: torch.Tensor,
             norm_w: torch.Tensor, out: torch.Tensor | None = None, *, eps: float = 1e-6,
             backend: str = "reference", ran: list | None = None) -> torch.Tensor:
    """rms(mix; norm_w) in partial's dtype: the mix never leaves the compute dtype before the norm."""
    _check(blocks, partial, w_norm, w_proj, norm_w, eps)
    eps = float(eps)
    if out is not None and (out.shape != partial.shape or out.dtype != partial.dtype):
        raise ValueError(f"{COMPONENT}: 'out' must be {tuple(partial.shape)} {partial.dtype}, got "
                         f"{tuple(out.shape)} {out.dtype}")
    if backend in ("triton", "cute", "auto"):
        return update_mix_norm(blocks, partial, None, w_norm, w_proj, norm_w, out, None, update="none", eps=eps,
                               backend=backend, ran=ran)
    fn = resolve_backend(COMPONENT, backend, _mix_norm, "mix_norm")
    y = fn(list(blocks), partial, w_norm, w_proj, norm_w, eps)
    dispatch.record(ran, op=OP, backend_requested=backend, backend=backend, kernel="k3lab.ref.attnres:attnres_norm",
                    options={}, shape=dict(batch=partial.shape[0] if partial.dim() > 1 else 1, n_blocks=len(blocks),
                                           update="none"), why="requested")
    if out is None:
        return y
    out.copy_(y)
    return out


def _update_ref(blocks, prefix, new, w_norm, w_proj, norm_w, eps, update: str):
    """(p, out) in the reference maths: p rounded once to prefix's dtype, as the layer stores it."""
    if update == "none":
        p = prefix
    elif update == "fresh":
        p = new
    else:
        p = (prefix.to(torch.float32 if prefix.dtype != torch.float64 else torch.float64) + new).to(prefix.dtype)
    return p, ref.attnres_norm(blocks, p, w_norm, w_proj, norm_w, eps)[1]


def update_mix_norm(blocks: Sequence[torch.Tensor], prefix: torch.Tensor, new: torch.Tensor | None,
                    w_norm: torch.Tensor, w_proj: torch.Tensor, norm_w: torch.Tensor, out: torch.Tensor | None = None,
                    partial_out: torch.Tensor | None = None, *, update: str = "add", eps: float = 1e-6,
                    backend: str = "reference", ran: list | None = None, num_warps: int | None = None,
                    block_d: int | None = None, path: str | None = None, cluster: int | None = None,
                    vec: int | None = None, alpha: str | None = None) -> torch.Tensor:
    """The partial update + mix + RMSNorm of one layer side (module docstring). Returns out."""
    if update not in UPDATES:
        raise ValueError(f"{COMPONENT}: 'update' must be one of {UPDATES}, got {update!r}")
    _check(blocks, prefix, w_norm, w_proj, norm_w, eps)
    eps = float(eps)
    if len(blocks) > MAX_BLOCKS:
        raise ValueError(f"{COMPONENT}: 'blocks' must hold 0..{MAX_BLOCKS} tensors (K3 at decode), got {len(blocks)}")
    if update == "none":
        if new is not None or partial_out is not None:
            raise ValueError(f"{COMPONENT}: 'new' and 'partial_out' must be None for update='none'")
    else:
        if not isinstance(new, torch.Tensor) or new.shape != prefix.shape or new.dtype != prefix.dtype:
            raise ValueError(f"{COMPONENT}: 'new' must be a tensor {tuple(prefix.shape)} {prefix.dtype} for "
                             f"update={update!r}, got {getattr(new, 'shape', type(new).__name__)}")
        if new.device != prefix.device:
            raise ValueError(f"{COMPONENT}: 'new' is on {new.device}, prefix on {prefix.device}")
    for name, t in (("out", out), ("partial_out", partial_out)):
        if t is not None and (not isinstance(t, torch.Tensor) or t.shape != prefix.shape or t.dtype != prefix.dtype
                              or t.device != prefix.device):
            raise ValueError(f"{COMPONENT}: {name!r} must be {tuple(prefix.shape)} {prefix.dtype} on {prefix.device}, "
                             f"got {tuple(getattr(t, 'shape', ()))} {getattr(t, 'dtype', type(t).__name__)}")
    if isinstance(num_warps, bool) or num_warps not in (None, 1, 2, 4, 8, 16):
        raise ValueError(f"{COMPONENT}: 'num_warps' must be 1, 2, 4, 8, 16 or None, got {num_warps!r}")
    if isinstance(block_d, bool) or block_d not in (None, 128, 256, 512, 1024):
        raise ValueError(f"{COMPONENT}: 'block_d' must be 128, 256, 512, 1024 or None, got {block_d!r}")
    for k, v in (("cluster", cluster), ("vec", vec)):  # the cute kernel's options (registry values)
        if isinstance(v, bool) or v not in (None, 1, 2, 4, 8):
            raise ValueError(f"{COMPONENT}: {k!r} must be 1, 2, 4, 8 or None, got {v!r}")
    if alpha not in (None, "threads", "twopass"):
        raise ValueError(f"{COMPONENT}: 'alpha' must be 'threads', 'twopass' or None, got {alpha!r}")
    B = prefix.shape[0] if prefix.dim() == 2 else 1
    be, opts, why = dispatch.select(OP, backend, B=B)
    if path not in (None, "split", "row"):
        raise ValueError(f"{COMPONENT}: 'path' must be 'split', 'row' or None, got {path!r}")
    for k, v in (("num_warps", num_warps), ("block_d", block_d), ("path", path)):
        if v is not None:
            if be != "triton":
                raise ValueError(f"{COMPONENT}: {k!r} is a triton option; backend {be!r} takes none")
            opts = {**opts, k: v}
    for k, v in (("cluster", cluster), ("vec", vec), ("alpha", alpha)):
        if v is not None:
            if be != "cute":
                raise ValueError(f"{COMPONENT}: {k!r} is a cute option; backend {be!r} takes none")
            opts = {**opts, k: v}
    if be == "cute" and backend == "auto" and any(k in opts for k in ("cluster", "vec", "alpha")):
        # the auto rule's options were measured at K3's dim (7168); a dim they do not fit (a small test model)
        # takes the kernel's own choice, and the record says so
        from k3lab_kernels.cute.attnres_norm import AttnResCuteError, plan
        try:
            plan(B, prefix.shape[-1], len(blocks), opts.get("cluster"), opts.get("vec"), alpha=opts.get("alpha"))
        except AttnResCuteError as e:
            dropped = {k: opts.pop(k) for k in ("cluster", "vec", "alpha") if k in opts}
            why += f"; the rule's options {dropped} do not fit this call ({e}): the kernel's own choice"
    if out is None:
        out = torch.empty_like(prefix)
    if be in ("triton", "cute"):
        srcs = list(blocks) + [prefix] + ([new] if new is not None else [])
        for i, t in enumerate(srcs):
            if t.dim() != 2 or t.dtype != torch.bfloat16 or t.stride(1) != 1:
                name = f"blocks[{i}]" if i < len(blocks) else ("prefix" if i == len(blocks) else "new")
                raise ValueError(f"{COMPONENT}: {name!r} must be a bf16 [B, D] tensor with unit stride along D for "
                                 f"the {be} backend, got {t.dtype} shape {tuple(t.shape)} strides {t.stride()}")
        if out.stride(1) != 1 or (partial_out is not None and partial_out.stride(1) != 1):
            raise ValueError(f"{COMPONENT}: 'out' and 'partial_out' must have unit stride along D for {be}")
        dispatch.kernel(OP, be)(list(blocks), prefix, new, w_norm, w_proj, norm_w, out, partial_out, update=update,
                                eps=eps, **opts)
    else:
        fn = _update_ref if be == "reference" else dispatch.compiled(f"{COMPONENT}.update_{update}", _update_ref)
        p, y = fn(list(blocks), prefix, new, w_norm, w_proj, norm_w, eps, update)
        if partial_out is not None:
            partial_out.copy_(p)
        out.copy_(y)
    dispatch.record(ran, op=OP, backend_requested=backend, backend=be, kernel=dispatch.kernel_path(OP, be),
                    options=opts, shape=dict(batch=B, n_blocks=len(blocks), update=update, dim=prefix.shape[-1]),
                    why=why)
    return out
