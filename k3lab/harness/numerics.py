"""Errors against an fp64 reference: relative norm error and max abs error. NaN never passes.

    rel_norm = ||out - ref||_2 / max(||ref||_2, tiny)
    max_abs  = max |out - ref|

Outputs may be tensors or (nested) tuples / lists / dicts of tensors; they are flattened in order and
compared pairwise (the error is the worst over the parts, the NaN count the sum).
"""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Any

import torch


@dataclass
class ErrorStats:
    rel_norm: float
    max_abs: float
    numel: int
    nonfinite: int  # NaN or inf in the output where the reference is finite
    tol: float | None = None
    note: str | None = None  # what the check aligned before comparing (k3lab.model.Layer.align_twin)

    @property
    def ok(self) -> bool:
        if self.nonfinite or math.isnan(self.rel_norm) or math.isnan(self.max_abs):
            return False
        return True if self.tol is None else self.rel_norm <= self.tol

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        if d["note"] is None:
            del d["note"]
        d["ok"] = self.ok
        for k in ("rel_norm", "max_abs"):  # JSON has no NaN / inf
            if not math.isfinite(d[k]):
                d[k] = None if math.isnan(d[k]) else "inf"
        return d


def _flatten(x: Any) -> list[torch.Tensor]:
    if isinstance(x, torch.Tensor):
        return [x]
    if isinstance(x, dict):
        return [t for k in x for t in _flatten(x[k])]
    if isinstance(x, (list, tuple)):
        return [t for v in x for t in _flatten(v)]
    if x is None:
        return []
    raise TypeError(f"cannot compare a {type(x).__name__}; pass tensors or containers of tensors")


def error_stats(out: Any, ref: Any, tol: float | None = None) -> ErrorStats:
    """Compare `out` (any dtype) with `ref` (ideally fp64) in fp64."""
    outs, refs = _flatten(out), _flatten(ref)
    if len(outs) != len(refs):
        raise ValueError(f"output has {len(outs)} tensors, reference {len(refs)}")
    diff_sq = ref_sq = 0.0
    max_abs = 0.0
    nonfinite = numel = 0
    for o, r in zip(outs, refs):
        if o.shape != r.shape:
            raise ValueError(f"shape mismatch: output {tuple(o.shape)} vs reference {tuple(r.shape)}")
        o64 = o.detach().to(device="cpu", dtype=torch.float64)
        r64 = r.detach().to(device="cpu", dtype=torch.float64)
        finite_ref = torch.isfinite(r64)
        bad = (~torch.isfinite(o64)) & finite_ref
        nonfinite += int(bad.sum())
        numel += o64.numel()
        d = (o64 - r64)[finite_ref]
        if d.numel():
            diff_sq += float((d * d).sum())
            max_abs = max(max_abs, float(d.abs().max()))
        ref_sq += float((r64[finite_ref] ** 2).sum())
    if numel == 0:
        raise ValueError("nothing to compare: no tensors (a component that returns None has no output to check)")
    if nonfinite:
        return ErrorStats(float("nan"), float("nan"), numel, nonfinite, tol)
    rel = math.sqrt(diff_sq) / max(math.sqrt(ref_sq), 1e-300) if diff_sq else 0.0
    return ErrorStats(rel, max_abs, numel, 0, tol)


def rel_norm_error(out: Any, ref: Any) -> float:
    return error_stats(out, ref).rel_norm


def check(out: Any, ref: Any, tol: float) -> ErrorStats:
    """error_stats that raises AssertionError when NaN/inf appear or rel_norm > tol."""
    e = error_stats(out, ref, tol)
    if not e.ok:
        raise AssertionError(f"numerics failed: rel_norm={e.rel_norm:.3e} (tol {tol:.1e}), max_abs={e.max_abs:.3e}, "
                             f"non-finite={e.nonfinite} of {e.numel}")
    return e
