"""The one checker: an op's implementation against its fp64 reference, on fresh random inputs.

    res = check(op, case, backend="triton", options={"tile_v": 16}, seed=3)     # the component API
    res = check(op, case, impl=lambda inp: my_kernel(...), seed=3)              # any callable (emulator, peer)
    assert res.ok, res

What it does, every time:
  1. builds fresh inputs (`op.make_inputs(case, seed, device)`) and the fp64 answer from a copy of them
     (`op.reference`);
  2. poisons every output the op writes (`op.written`) with NaN (integers with -1) before the call;
  3. runs the implementation once;
  4. compares every written and updated output (out, saved state, caches, histories) with the reference:
     relative-norm error under the op's stated tolerance (`op.tolerances(case)`; 0.0 = bit-exact); an
     entry the reference marks NaN must still hold the poison (left untouched), any other non-finite
     value fails;
  5. requires every read-only input tensor to be unchanged.

`check_twin` is the layer-level form the layer notebook uses: a component of a bf16 layer against the same
component of its fp64 twin.
"""
from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from k3lab.harness.numerics import error_stats
from k3lab.registry import Case, Op


@dataclass
class Result:
    op: str
    case: str
    impl: str
    errors: dict[str, dict[str, Any]] = field(default_factory=dict)  # output -> {rel_norm, max_abs, tol, ok, ...}
    untouched_ok: bool = True
    inputs_unchanged: bool = True
    failures: list[str] = field(default_factory=list)
    ran: list[dict] = field(default_factory=list)  # what the dispatcher ran (component calls)

    @property
    def ok(self) -> bool:
        return not self.failures

    def worst(self, name: str) -> float | None:
        e = self.errors.get(name)
        return None if e is None else e.get("rel_norm")

    def to_dict(self) -> dict[str, Any]:
        return dict(op=self.op, case=self.case, impl=self.impl, ok=self.ok, errors=self.errors,
                    untouched_ok=self.untouched_ok, inputs_unchanged=self.inputs_unchanged,
                    failures=self.failures, ran=self.ran)

    def __str__(self) -> str:
        errs = " ".join(f"{k}={v['rel_norm']:.2e}" if isinstance(v.get("rel_norm"), float) else f"{k}={v['rel_norm']}"
                        for k, v in self.errors.items())
        return f"{self.case} {self.impl}: {'ok' if self.ok else 'FAIL ' + '; '.join(self.failures)} ({errs})"


def _tensors(d: dict) -> dict[str, torch.Tensor]:
    return {k: v for k, v in d.items() if isinstance(v, torch.Tensor)}


def poison(t: torch.Tensor) -> None:
    if t.is_floating_point():
        t.fill_(float("nan"))
    else:
        t.fill_(-1)


def clone_inputs(inp: dict) -> dict:
    """A deep copy of an input dict (tensors cloned; objects with `.clone()` cloned; others shared)."""
    out = {}
    for k, v in inp.items():
        if isinstance(v, torch.Tensor):
            out[k] = v.clone()
        elif hasattr(v, "clone"):
            out[k] = v.clone()
        else:
            out[k] = v
    return out


def compare(name: str, got: torch.Tensor, want: torch.Tensor, tol: float) -> dict[str, Any]:
    """One output against its fp64 reference. NaN in `want` = must still be poisoned in `got`."""
    g = got.detach().to("cpu", torch.float64)
    w = want.detach().to("cpu", torch.float64)
    if g.shape != w.shape:
        return dict(rel_norm=None, max_abs=None, tol=tol, ok=False,
                    why=f"{name}: shape {tuple(g.shape)}, reference {tuple(w.shape)}")
    keep = torch.isnan(w)
    untouched = bool(torch.isnan(g[keep]).all()) if keep.any() else True
    g_, w_ = g[~keep], w[~keep]
    if g_.numel() == 0:
        return dict(rel_norm=0.0, max_abs=0.0, tol=tol, ok=untouched, untouched=untouched, numel=0,
                    why="" if untouched else f"{name}: entries that must stay untouched were written")
    if tol == 0.0:
        exact = bool(torch.equal(g_, w_))
        e = error_stats(g_, w_)
        ok = exact and untouched
        why = "" if ok else (f"{name}: not bit-exact (rel {e.rel_norm:.2e}, {e.nonfinite} non-finite)" if not exact
                             else f"{name}: entries that must stay untouched were written")
        return dict(rel_norm=e.rel_norm, max_abs=e.max_abs, tol=0.0, exact=exact, ok=ok, untouched=untouched,
                    numel=e.numel, why=why)
    e = error_stats(g_, w_, tol)
    ok = e.ok and untouched
    why = ""
    if not e.ok:
        why = (f"{name}: {e.nonfinite} non-finite of {e.numel}" if e.nonfinite else
               f"{name}: rel_norm {e.rel_norm:.2e} > tol {tol:.1e}")
    elif not untouched:
        why = f"{name}: entries that must stay untouched were written"
    rel = e.rel_norm if math.isfinite(e.rel_norm) else None
    return dict(rel_norm=rel, max_abs=e.max_abs if math.isfinite(e.max_abs) else None, tol=tol, ok=ok,
                untouched=untouched, numel=e.numel, why=why)


def check(op: Op, case: Case, *, backend: str | None = None, options: dict | None = None,
          impl: Callable[[dict], Any] | None = None, impl_name: str | None = None, seed: int = 0,
          device: str | None = None, inputs: dict | None = None) -> Result:
    """Check one implementation of `op` at `case` (see the module docstring). Either `backend` (+ options:
    the component API through the dispatcher) or `impl` (a callable taking the input dict). `inputs`
    (optional) is an input set to use instead of fresh ones; it is copied, never modified."""
    if (backend is None) == (impl is None):
        raise ValueError("check: pass exactly one of backend= or impl=")
    if case.op != op.name:
        raise ValueError(f"check: case is for op {case.op!r}, not {op.name!r}")
    if not op.valid(case):
        raise ValueError(f"check: 'case' {case} is no case of op {op.name!r} (its rule: {op.valid.__name__})")
    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    inp = clone_inputs(inputs) if inputs is not None else op.make_inputs(case, seed, device)
    want = op.reference(clone_inputs(inp), case)
    tols = op.tolerances(case)
    for name in op.written:
        poison(inp[name])
    read_only = {k: v.clone() for k, v in _tensors(inp).items() if k not in op.written and k not in op.updated}
    name = impl_name or (backend + ("" if not options else "[" + ",".join(f"{k}={v}" for k, v in options.items()) + "]")
                         if backend else getattr(impl, "__name__", "impl"))
    res = Result(op.name, case.key(), name)
    if impl is not None:
        impl(inp)
    else:
        op.call(inp, case, backend, dict(options or {}), res.ran)
    if inp[op.written[0] if op.written else op.updated[0]].is_cuda:
        torch.cuda.synchronize()
    for out_name in tuple(op.written) + tuple(op.updated):
        if out_name not in want:
            continue
        e = compare(out_name, inp[out_name], want[out_name], tols[out_name])
        res.errors[out_name] = e
        res.untouched_ok &= e.get("untouched", True)
        if not e["ok"]:
            res.failures.append(e["why"])
    for k, before in read_only.items():
        if not _same_bits(before, inp[k]):
            res.inputs_unchanged = False
            res.failures.append(f"input {k!r} was modified")
    return res


def _same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bit-for-bit equality (NaN payloads included), for any dtype: fp8 and friends are compared as bytes."""
    if a.shape != b.shape or a.dtype != b.dtype:
        return False
    if a.element_size() == 0 or a.numel() == 0:
        return True
    return torch.equal(a.reshape(-1).contiguous().view(torch.uint8), b.reshape(-1).contiguous().view(torch.uint8))


def check_twin(layer: Any, ref_layer: Any, fn: Callable[[], Any], ref_fn: Callable[[], Any], tol: float | None,
               name: str | None = None):
    """One call of a layer component (k3lab.model.Layer) against the same component of its fp64 twin (same
    seed; the layer notebook's check). The outputs it returns are compared; a component that returns nothing
    is compared on the layer buffers (`layer.buf`) its call changed; with neither, it fails loudly. Returns
    numerics.ErrorStats (relative norm over every output, NaN never passes).
    name: the component's name, passed to `layer.check_form(name, out)` (the form compared: the router's picks as
    a gate matrix) and to `layer.align_twin(ref_layer, name)` after both calls, where the layer has them: a
    discrete choice the bf16 layer made differently from the twin (the router's experts) is taken over by the
    twin, so this row and the ones after it measure arithmetic, not a coin toss; the stats' `note` says what was
    aligned. A choice that is not right for the layer's own input (align_twin's rule) is left as it is and fails."""
    def tensors(d: Any) -> dict[str, torch.Tensor]:
        return {k: v for k, v in (d or {}).items() if isinstance(v, torch.Tensor)}

    before = {k: v.clone() for k, v in tensors(getattr(layer, "buf", None)).items()}
    out, ref = fn(), ref_fn()
    if name and hasattr(layer, "check_form"):  # the compared form of an output (the router's gate matrix)
        out, ref = layer.check_form(name, out), ref_layer.check_form(name, ref)
    if out is None:
        after = tensors(getattr(layer, "buf", None))
        rbuf = tensors(getattr(ref_layer, "buf", None))
        keys = [k for k, v in after.items() if k in rbuf and rbuf[k].shape == v.shape
                and (k not in before or before[k].shape != v.shape or not torch.equal(before[k], v))]
        if not keys:
            raise ValueError("component returned None and changed no layer buffer: nothing to check")
        out, ref = {k: after[k] for k in keys}, {k: rbuf[k] for k in keys}
    aligned = layer.align_twin(ref_layer, name) if name and hasattr(layer, "align_twin") else None
    if aligned is None:
        return error_stats(out, ref, tol)
    st = error_stats(out, aligned[0], tol)
    st.note = aligned[1]
    return st


def require(res: Result) -> Result:
    """AssertionError naming every failure (for tests)."""
    if not res.ok:
        raise AssertionError(str(res))
    return res
