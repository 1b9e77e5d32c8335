"""One typed, serializable object for every switch of docs/MODEL.md, Switches.

Notebook parameters map onto `Switches` one to one (`Switches.from_params`). An invalid value is
refused with a message naming the switch and its allowed values. A switch whose component has not
landed yet (`NOT_WIRED`) is declared with its allowed values but refused at any value other than its
default, with a message saying so: nothing would read it.

One owner per setting: `Switches` holds implementation choices (backends, tiles, partitions, padding,
launch modes). The shape of what one GPU sees (batch, context, dcp, draft_depth, kv_dtype,
expert_dtype) is `k3lab.config.GpuView`'s. `require_backend` refuses a
backend that cannot run on this machine (no GPU, no CuTe DSL, no ROCm) instead of falling back.
"""
from __future__ import annotations

import dataclasses
import importlib.util
import json
from dataclasses import dataclass, field
from typing import Any

COMPONENTS = ("kda", "mla", "attnres", "moe", "router", "dense", "proj")
BACKENDS = ("reference", "torch_compile", "triton", "cute", "aiter")
"""`auto` (per-component only) picks the measured winner for the shape; the record says which ran."""

ALLOWED: dict[str, tuple[Any, ...]] = {
    "pad_heads": (0, 16, 32, 64, 128),
    "kda_tile_v": ("auto", 4, 8, 16, 32, 64, 128),
    "kda_state_dtype": ("fp32", "bf16"),
    "kda_prefill_inverse": ("fp32", "bf16"),
    "kda_prefill_grouped": (False, True),
    "kda_pdl": (False, True),
    "kda_checkpoint": ("auto", 1, 2, 4, 8),
    "mla_partitions": (*range(1, 65), "auto"),  # any count of split-KV pieces 1..64 (issue 12)
    "moe_tile_n": ("auto", 16, 32, 64),  # 128: the bf16 grouped path's 4 stages do not fit (docs/NOTES_moe.md)
    "prefetch": (False, True),
    "fuse_prologues": (False, True),
    "shared_expert_stream": (False, True),
    "split_router": (False, True),
    "owned_output": (False, True),
    "fused_allreduce": (False, True),
    "pdl": (False, True),
    "proj_cute": (False, True),
}
# declared, not read by any code yet: the issue that wires each
NOT_WIRED = {
    "fused_allreduce": "the fused all-reduce + AttnRes + RMSNorm (multi-GPU)",
    "kda_prefill_inverse": "a prefill step in the model (the kda.prefill API takes inverse= directly)",
    "kda_prefill_grouped": "a prefill step in the model (the kda.prefill API takes grouped= directly)",
}
VIEW_SETTINGS = ("dcp", "draft_depth", "kv_dtype", "expert_dtype")  # owned by k3lab.config.GpuView


def describe(allowed: tuple[Any, ...]) -> str:
    """A switch's allowed values as an error message shows them: a run of consecutive ints as 'lo..hi'."""
    ints = [a for a in allowed if isinstance(a, int) and not isinstance(a, bool)]
    if len(ints) > 8 and ints == list(range(ints[0], ints[-1] + 1)):
        rest = [a for a in allowed if a not in ints or isinstance(a, bool)]
        return f"an int in {ints[0]}..{ints[-1]}" + "".join(f" or {a!r}" for a in rest)
    return str(allowed)


class SwitchError(ValueError):
    """An unknown switch, a value outside a switch's allowed set, or a backend that cannot run here."""


class BackendUnavailable(SwitchError):
    pass


@dataclass
class Switches:
    """Every toggle of a k3lab run. Defaults are the plain, unoptimized path."""

    backend: dict[str, str] = field(default_factory=lambda: {c: "reference" for c in COMPONENTS})
    pad_heads: int = 0  # 0 = no padding; else pad MLA query heads up to this count
    kda_tile_v: int | str = "auto"  # value columns per program in the KDA kernels ("auto": the measured rule)
    kda_state_dtype: str = "fp32"
    kda_prefill_inverse: str = "fp32"
    kda_prefill_grouped: bool = False
    kda_pdl: bool = False  # programmatic dependent launch of the CuTe KDA kernels (cute backend only)
    # the verify path (draft depth > 0): the KDA verify keeps every c-th position's state (k3lab.components.kda
    # verify / commit); "auto": the measured rule (kda.default_checkpoint: c = 4 at T = 8 from batch 8, else 1)
    kda_checkpoint: int | str = "auto"
    mla_partitions: int | str = "auto"  # "auto": the kernel's measured choice for the batch and context
    # the routed experts on the triton backend: intermediate rows a program (block_n of every path of
    # k3lab_kernels.triton.moe_experts); "auto": each path's measured tile (default_blocks). The CuTe experts' tiles are
    # compile-time constants: another value with the MoE on cute is refused (k3lab.model); the references have none
    moe_tile_n: int | str = "auto"
    # the step: an L2 prefetch of the next group's weight beside each AttnRes, and of Wo beside the MLA combine
    prefetch: bool = False
    # the step (projections on triton), up to 16 tokens: the RMSNorms and SiTU-GLU as the projections' input prologues
    # (the MoE output one launch); False (default: the fused forms measured slower at batch 1..16,
    # profiles/h200/trunk_prologue.json.gz, git history at cec0131): each its own launch before the projection
    fuse_prologues: bool = False
    # the step (projections on triton): the shared experts' w1/w3 on a side stream beside the routed experts
    shared_expert_stream: bool = False
    # the step (projections on triton), TP emulated on one GPU (k3lab.step._fused_parts): each rank computes its
    # share of the router and latent down-projection, exchanged (split_router); each rank adds only its output
    # coordinates of the routed up-projection (owned_output)
    split_router: bool = False
    owned_output: bool = False
    fused_allreduce: bool = False
    # the step: every k3lab Triton kernel launched with programmatic dependent launch (each waits for its
    # predecessor's results, reading only weights and never-written tensors before; k3lab_kernels.triton.pdl)
    pdl: bool = False
    # the step (projections on triton): the one-token projections with many outputs and no input prologue or fused
    # router selection through the CuTe DSL GEMV (kernels/cute/proj_gemv.py; k3lab.step.proj_cute_takes says which);
    # with k3lab.step.PROJ_MMA_MAX_TOKENS >= 2 (0 until measured) also those of several tokens on its tensor-core path
    proj_cute: bool = False

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> None:
        if not isinstance(self.backend, dict):
            raise SwitchError(f"switch 'backend' must be a dict component->backend, got {self.backend!r}")
        full = {c: "reference" for c in COMPONENTS}
        for comp, be in self.backend.items():
            if comp not in COMPONENTS:
                raise SwitchError(f"switch 'backend' has unknown component {comp!r}; components: {COMPONENTS}")
            if be not in BACKENDS + ("auto",):
                raise SwitchError(
                    f"switch 'backend[{comp}]' = {be!r} is not allowed; allowed: {BACKENDS + ('auto',)}")
            full[comp] = be
        self.backend = full
        for name, allowed in ALLOWED.items():
            v = getattr(self, name)
            if isinstance(allowed[0], bool):
                ok = isinstance(v, bool)
            else:
                ok = any(type(v) is type(a) and v == a for a in allowed)  # 2.0 is not the int 2
            if not ok:
                raise SwitchError(f"switch {name!r} = {v!r} is not allowed; allowed values: {describe(allowed)}")
        default = Switches.__dataclass_fields__
        for name, what in NOT_WIRED.items():
            v = getattr(self, name)
            if v != default[name].default:
                raise SwitchError(f"switch {name!r} = {v!r}: declared but not wired yet ({what} will read it); "
                                  f"only its default {default[name].default!r} is accepted today")

    # ---- (de)serialization ---------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), sort_keys=True)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Switches:
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(d) - names)
        view = sorted(set(unknown) & set(VIEW_SETTINGS))
        if view:
            raise SwitchError(f"{view} belong to the GPU view (k3lab.config.preset(..., {view[0]}=...)), not to "
                              f"Switches")
        if unknown:
            raise SwitchError(f"unknown switch(es) {unknown}; known: {sorted(names)}")
        return cls(**d)

    @classmethod
    def from_params(cls, params: dict[str, Any]) -> Switches:
        """Notebook parameters onto switches: `backend_<component>` sets one backend, `backend` sets
        all; every other switch has a parameter of the same name. Non-switch params (the view's batch,
        context, dcp, draft_depth, kv_dtype, expert_dtype among them) are ignored."""
        names = {f.name for f in dataclasses.fields(cls)}
        kw: dict[str, Any] = {}
        backend: dict[str, str] = {}
        for k, v in params.items():
            if k == "backend" and isinstance(v, str):
                backend.update({c: v for c in COMPONENTS})
            elif k.startswith("backend_"):
                backend[k[len("backend_"):]] = v
            elif k in names:
                kw[k] = v
        if backend:
            kw["backend"] = backend
        return cls(**kw)

    def replace(self, **kw: Any) -> Switches:
        d = self.to_dict()
        for k, v in kw.items():
            if k.startswith("backend_"):
                d["backend"] = {**d["backend"], k[len("backend_"):]: v}
            else:
                d[k] = v
        return Switches.from_dict(d)


# ---- backend availability ---------------------------------------------------------------------

def _has_cuda() -> bool:
    import torch

    return torch.cuda.is_available() and torch.version.hip is None


def _has_rocm() -> bool:
    import torch

    return torch.cuda.is_available() and torch.version.hip is not None


def backend_status(backend: str) -> tuple[bool, str]:
    """(available, reason) for a backend on this machine."""
    import os

    if backend == "reference":
        return True, "torch reference, any device"
    if backend == "torch_compile":
        return True, "torch.compile of the reference"
    if backend == "triton":
        if importlib.util.find_spec("triton") is None:
            return False, "triton is not installed"
        if _has_cuda() or _has_rocm():
            return True, "triton on GPU"
        if os.environ.get("TRITON_INTERPRET") == "1":
            return True, "triton interpreter on CPU (TRITON_INTERPRET=1): logic only, not speed"
        return False, "no GPU; set TRITON_INTERPRET=1 to run Triton kernels in the interpreter on CPU"
    if backend == "cute":
        if importlib.util.find_spec("cutlass") is None:
            return False, "CuTe DSL (nvidia-cutlass-dsl, extra 'cute') is not installed"
        if not _has_cuda():
            return False, "CuTe DSL kernels need an NVIDIA GPU; none is visible"
        return True, "CuTe DSL on NVIDIA GPU"
    if backend == "aiter":
        if not _has_rocm():
            return False, "AITER needs a ROCm GPU; none is visible"
        if importlib.util.find_spec("aiter") is None:
            return False, "AITER (amd-aiter, extra 'rocm') is not installed"
        return True, "AITER on ROCm"
    raise SwitchError(f"unknown backend {backend!r}; allowed: {BACKENDS}")


def require_backend(backend: str) -> None:
    ok, why = backend_status(backend)
    if not ok:
        raise BackendUnavailable(f"backend {backend!r} cannot run here: {why}")
