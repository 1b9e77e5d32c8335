"""The one dispatcher: which implementation a component call runs, and the record of what ran.

    be, opts, why = select("kda_decode", backend, B=B, T=1)   # resolves "auto" through k3lab.policy
    fn = kernel("kda_decode", be)                              # the registry's backends table, imported
    record(ran, op="kda_decode", backend_requested=backend, backend=be, kernel=..., options=opts, ...)

The record goes to the caller: a component function takes `ran=None` or a list, and appends a `Ran` to
the list it was given. Nothing is kept in a module global.

For the components whose kernels have not landed (attnres, mla, moe), `resolve_backend` gives the torch
reference or its torch.compile, and refuses every other backend by name.
"""
from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any

import torch

from k3lab import policy, registry
from k3lab.switches import BACKENDS, BackendUnavailable, SwitchError, backend_status, require_backend

IMPLEMENTED = ("reference", "torch_compile")
_compiled: dict[str, Callable] = {}


@dataclass
class Ran:
    """What one component call ran."""

    op: str
    backend_requested: str
    backend: str
    kernel: str
    options: dict[str, Any] = field(default_factory=dict)
    shape: dict[str, Any] = field(default_factory=dict)
    why: str = ""  # why this backend (the auto rule, or "requested")
    notes: str = ""

    def to_dict(self) -> dict:
        return asdict(self)


def record(ran: list | None, **kw: Any) -> Ran:
    """A Ran appended to the caller's list (when one was given) and returned."""
    r = Ran(**kw)
    if ran is not None:
        if not isinstance(ran, list):
            raise TypeError(f"ran must be a list to append the record of what ran to, or None; got {type(ran)}")
        ran.append(r)
    return r


@functools.cache
def _importable(op_name: str, backend: str) -> str | None:
    """None when the op's kernel for `backend` imports, else why not (cached per process)."""
    try:
        registry.get(op_name).kernel(backend)
        return None
    except Exception as e:  # noqa: BLE001 - ImportError, or a DSL failing at import
        return f"{type(e).__name__}: {e}"


def can_run(op_name: str, backend: str) -> bool:
    """The op has a `backend` kernel, the backend can run on this machine, and the kernel imports. The
    Triton interpreter (no GPU) counts only when asked for by name, never for `auto`."""
    op = registry.get(op_name)
    if backend not in op.backends:
        return False
    ok, _ = backend_status(backend)
    if not ok or (backend in ("triton", "cute", "aiter") and not torch.cuda.is_available()):
        return False
    return _importable(op_name, backend) is None


def select(op_name: str, backend: str, *, B: int, T: int = 1,
           shape: dict[str, Any] | None = None) -> tuple[str, dict[str, Any], str]:
    """(backend, options, why) for a call of `op_name` at batch B, T positions. "auto" follows the measured
    table (k3lab.policy), skipping a rule whose backend cannot take `shape` (the op's `supports`, e.g. the CuTe
    KDA kernels at head_dim 128 only: a small test model then runs the fallback rule's backend); a named backend
    is validated: unknown -> SwitchError, cannot run here, has no kernel for the op or cannot take `shape` ->
    BackendUnavailable naming both."""
    op = registry.get(op_name)
    if backend == "auto":
        skipped: list[str] = []

        def runs(b: str) -> bool:
            if not can_run(op_name, b):
                return False
            no = op.supports(b, shape) if shape is not None else None
            if no is not None:
                skipped.append(f"{b}: {no}")
            return no is None

        be, opts, why = policy.choose(op.component, op.policy_key, B, T, runs, shape)
        if skipped:
            why += f" (passed over for this shape: {'; '.join(skipped)})"
        return be, opts, why
    if backend not in BACKENDS:
        raise SwitchError(f"{op_name}: backend {backend!r} is not allowed; allowed: {BACKENDS + ('auto',)}")
    if backend not in op.backends:
        raise BackendUnavailable(f"backend {backend!r} has no {op_name} kernel in k3lab; implemented: "
                                 f"{tuple(op.backends)}")
    require_backend(backend)
    why = _importable(op_name, backend)
    if why is not None:
        raise BackendUnavailable(f"backend {backend!r}: cannot import {op.backends[backend]}: {why}")
    no = op.supports(backend, shape) if shape is not None else None
    if no is not None:
        raise BackendUnavailable(f"{op_name}: backend {backend!r} cannot take this call: {no}")
    return backend, {}, "requested"


def kernel(op_name: str, backend: str) -> Callable:
    """The function the registry names for `op_name` on `backend` (BackendUnavailable if it cannot import)."""
    try:
        return registry.get(op_name).kernel(backend)
    except registry.RegistryError:
        raise
    except Exception as e:  # noqa: BLE001
        raise BackendUnavailable(f"backend {backend!r}: cannot import the {op_name} kernel: {e!r}") from e


def kernel_path(op_name: str, backend: str) -> str:
    return registry.get(op_name).backends[backend]


def compiled(key: str, fn: Callable, *, dynamic: bool = False) -> Callable:
    """torch.compile of `fn`, one per key and process."""
    if key not in _compiled:
        _compiled[key] = torch.compile(fn, dynamic=dynamic)
    return _compiled[key]


# ---- the torch-only components (attnres, mla, moe) until their kernels land ----------------------------

def resolve_backend(component: str, backend: str, fn: Callable, key: str,
                    implemented: tuple[str, ...] = IMPLEMENTED, *, dynamic: bool = False) -> Callable:
    """The callable that runs `fn` for `component` under `backend`, or a clear refusal: an unknown
    name raises SwitchError, a backend that cannot run here or is not implemented for the component
    raises BackendUnavailable naming both. """
    if backend not in BACKENDS:
        raise SwitchError(f"{component}: backend {backend!r} is unknown; allowed: {BACKENDS} "
                          f"(implemented for {component}: {implemented}; resolve 'auto' before calling)")
    if backend not in implemented:
        require_backend(backend)  # refuses first when the backend cannot run on this machine at all
        raise BackendUnavailable(f"backend {backend!r} is not implemented for component {component!r}; "
                                 f"implemented: {implemented}")
    if backend == "reference":
        return fn
    return compiled(f"{component}.{key}", fn, dynamic=dynamic)


def write_out(component: str, y: torch.Tensor, out: torch.Tensor | None) -> torch.Tensor:
    """Return `y`, or copy it into `out` (same shape) and return `out`."""
    if out is None:
        return y
    if out.shape != y.shape or not out.is_floating_point():
        raise ValueError(f"{component}: 'out' must be a floating tensor of shape {tuple(y.shape)}, got "
                         f"{tuple(out.shape)} {out.dtype}")
    out.copy_(y)
    return out
