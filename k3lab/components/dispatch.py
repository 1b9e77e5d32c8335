"""Backend dispatch shared by the torch-only components (attnres, mla, moe): the callable a backend
runs for a reference function, or a clear refusal; and writing a result into a caller's buffer."""
from __future__ import annotations

from collections.abc import Callable

import torch

from k3lab.switches import BACKENDS, BackendUnavailable, SwitchError, require_backend

IMPLEMENTED = ("reference", "torch_compile")
_compiled: dict[str, Callable] = {}


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
    key = f"{component}.{key}"
    if key not in _compiled:
        _compiled[key] = torch.compile(fn, dynamic=dynamic)
    return _compiled[key]


def write_out(component: str, y: torch.Tensor, out: torch.Tensor | None) -> torch.Tensor:
    """Return `y`, or copy it into `out` (same shape) and return `out`."""
    if out is None:
        return y
    if out.shape != y.shape:
        raise ValueError(f"{component}: 'out' must have shape {tuple(y.shape)}, got {tuple(out.shape)}")
    out.copy_(y)
    return out
