"""The component registry: every op k3lab measures, as data the checker, the timer, the bench, the `auto`
policy, the tests and the layer notebook all read. Adding a component = one `k3lab/ops/<component>.py`
that calls `register(Op(...))` (docs/ADDING_A_COMPONENT.md).

An `Op` says, for one op of one component:
    name, component, policy_key   "kda_decode", "kda", "decode" (its rules in data/<component>_defaults.json)
    axes                          the default shape grid ({"heads": (6, 12), "batch": (1, ..., 64), ...})
    option_axes, option_defaults  per-backend options, the values each backend allows ({"tile_v": ...}) and
                                  the values swept when the grid names none (num_warps: the tuned default)
    make_inputs(case, seed, dev)  a dict of named tensors (inputs, state, output buffers) for a Case
    reference(inputs)             the fp64 answer: {output name: tensor}; NaN marks an entry the op must
                                  leave untouched (the checker poisons it and requires the poison back)
    written / updated             outputs poisoned before the call / updated in place (state, caches)
    tolerances(case)              {output name: relative-norm tolerance; 0.0 = bit-exact}, each justified
    call(inputs, case, backend, opts, ran)  run the component API (the dispatcher picks the kernel)
    nbytes(case), flops(case)     the one formula for what the op must move and compute
    set_bytes(inputs, case)       optional: the bytes one input set makes the op move, where the inputs' values
                                  decide them (the MoE's distinct experts); the bench's floor takes their mean
                                  over the timed sets, and nbytes(case) (the expectation) is kept beside it
    floor_bw                      "read" (mostly reads: weights, caches) or "copy" (reads and writes the
                                  same bytes: KDA state): the bandwidth its floor uses
    backends                      {backend: "module:function"}: the kernels, as paths grep can follow
    peers(case)                   public implementations timed beside ours (fla, FlashInfer, torch copy)
    test_file                     where its tests live
    variants                      {row name: (backend, options)} timed at the auto choice (cute_pdl), or at
                                  the backend's own choices where auto runs another backend
    in_sweep                      whether `k3lab bench COMPONENT` runs it by default
"""
from __future__ import annotations

import importlib
import itertools
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

FLOOR_BWS = ("read", "copy")
# axes that are sizes of at least one wherever an op has them (a batch, head count or width of 0 is no case of any
# op; a context or block count of 0 is, so those stay with each op's own `valid`)
POSITIVE_AXES = ("batch", "T", "heads", "dim", "inter", "latent", "n_experts", "experts", "top_k", "tp", "D")


class RegistryError(ValueError):
    """An unknown component or op, or a grid/option the op does not have."""


@dataclass(frozen=True)
class Case:
    """One shape point of an op: `shape` holds the op's axes (hashable values)."""

    op: str
    shape: tuple[tuple[str, Any], ...]

    @classmethod
    def of(cls, op: str, **shape: Any) -> Case:
        return cls(op, tuple(sorted(shape.items())))

    def __getitem__(self, k: str) -> Any:
        for n, v in self.shape:
            if n == k:
                return v
        raise KeyError(f"case of {self.op} has no axis {k!r}; axes: {[n for n, _ in self.shape]}")

    def get(self, k: str, default: Any = None) -> Any:
        try:
            return self[k]
        except KeyError:
            return default

    def asdict(self) -> dict[str, Any]:
        return dict(self.shape)

    def key(self) -> str:
        return self.op + "[" + ",".join(f"{n}={v}" for n, v in self.shape) + "]"


@dataclass
class Peer:
    """A public implementation timed beside ours: `make(inputs)` returns a zero-argument callable on one
    input set; `check(case, inputs)` (optional) returns a checker Result against the same fp64 reference on a
    copy of that input set."""

    name: str
    make: Callable[[dict], Callable[[], Any]]
    check: Callable[[Case, dict], Any] | None = None
    note: str = ""


@dataclass
class Op:
    name: str
    component: str
    policy_key: str
    doc: str
    axes: dict[str, tuple]
    make_inputs: Callable[[Case, int, str], dict]
    reference: Callable[[dict, Case], dict]
    written: tuple[str, ...]
    updated: tuple[str, ...]
    tolerances: Callable[[Case], dict[str, float]]
    call: Callable[..., Any]
    nbytes: Callable[[Case], int]
    flops: Callable[[Case], int]
    floor_bw: str
    backends: dict[str, str]
    test_file: str
    option_axes: dict[str, dict[str, tuple]] = field(default_factory=dict)  # option -> {backend: allowed values}
    option_defaults: dict[str, tuple] = field(default_factory=dict)  # option -> values swept when the grid is silent
    peers: Callable[[Case], list[Peer]] = lambda case: []
    # a grid point that is no case of this op (T=1 verify); the POSITIVE_AXES rule is added to it
    valid: Callable[[Case], bool] = lambda case: True
    # (case, option combination) -> whether the combination fits the case (KDA's tile_v divides D): the bench and the
    # checker take only combinations that fit, so a small test head never fails on a tile wider than itself
    option_valid: Callable[[Case, dict], bool] = lambda case, opts: True
    # kinds an axis takes beyond those of its default values ({"partitions": ("int",)} where the default is "auto")
    axis_kinds: dict[str, tuple[str, ...]] = field(default_factory=dict)
    tolerance_why: str = ""
    variants: dict[str, tuple[str, dict]] = field(default_factory=dict)  # row name -> (backend, extra options)
    in_sweep: bool = True  # `k3lab bench COMPONENT` runs it unless --ops names others
    # (backend, shape facts of a call) -> None, or why that backend's kernel cannot take the shape: `auto` then
    # takes the next rule, a named backend is refused with the reason (k3lab.components.dispatch.select)
    supports: Callable[[str, dict], str | None] = lambda backend, shape: None
    # a case's facts the auto rules filter on ({"fmt": weight format, "n": output rows, "k": reduction length};
    # k3lab.policy.matches): what the bench's variant rows look the rule up with, as the component's call does from
    # its tensors
    rule_facts: Callable[[Case], dict] = lambda case: {}
    # (inputs, case) -> the bytes that input set makes the op move, where its values decide them (module doc)
    set_bytes: Callable[[dict, Case], int] | None = None

    def __post_init__(self) -> None:
        if self.floor_bw not in FLOOR_BWS:
            raise RegistryError(f"op {self.name}: floor_bw must be one of {FLOOR_BWS}, got {self.floor_bw!r}")
        for be, path in self.backends.items():
            if ":" not in path:
                raise RegistryError(f"op {self.name}: backend {be!r} path must be 'module:function', got {path!r}")
        own, sizes = self.valid, tuple(k for k in POSITIVE_AXES if k in self.axes)
        self.valid = lambda case: all(isinstance(case[k], int) and case[k] >= 1 for k in sizes) and own(case)

    def case(self, **shape: Any) -> Case:
        """A Case from keyword axes; missing axes take the first value of the op's default grid."""
        unknown = sorted(set(shape) - set(self.axes))
        if unknown:
            raise RegistryError(f"op {self.name}: unknown axes {unknown}; axes: {sorted(self.axes)}")
        full = {k: shape.get(k, v[0]) for k, v in self.axes.items()}
        return Case.of(self.name, **full)

    def cases(self, grid: dict[str, Iterable] | None = None) -> list[Case]:
        """The product of the grid (axes not given take the op's defaults), invalid points left out."""
        grid = dict(grid or {})
        axes = {k: tuple(grid.pop(k, v)) for k, v in self.axes.items()}
        out = []
        for vals in itertools.product(*axes.values()):
            c = Case.of(self.name, **dict(zip(axes, vals)))
            if self.valid(c):
                out.append(c)
        return out

    def options(self, backend: str, only: dict[str, Iterable] | None = None,
                case: Case | None = None) -> list[dict[str, Any]]:
        """Every option combination `backend` takes: an option named in `only` takes those of its values the
        backend allows; one not named takes `option_defaults` (or every allowed value). With `case`: only the
        combinations that fit it (`option_valid`)."""
        only = only or {}
        names, values = [], []
        for opt, per_be in self.option_axes.items():
            vals = per_be.get(backend)
            if vals is None:
                continue
            if opt in only:
                vals = tuple(v for v in only[opt] if v in set(vals))
            elif opt in self.option_defaults:
                vals = self.option_defaults[opt]
            names.append(opt)
            values.append(vals)
        combos = [dict(zip(names, vs)) for vs in itertools.product(*values)]
        return combos if case is None else [o for o in combos if self.option_valid(case, o)]

    def kernel(self, backend: str) -> Callable:
        """The kernel function the backends table names (imported on first use)."""
        if backend not in self.backends:
            raise RegistryError(f"op {self.name}: no {backend!r} kernel; backends: {sorted(self.backends)}")
        mod, fn = self.backends[backend].split(":")
        return getattr(importlib.import_module(mod), fn)


# The layer builder's parts: layer kind -> "module:Class.method" that returns the kind's components of a
# k3lab.model.Layer, in layer order (name -> (callable, bytes, flops)). A new attention or MLP kind adds a line.
LAYER_PARTS: dict[str, str] = {
    "kda": "k3lab.model:Layer.kda_part",
    "mla": "k3lab.model:Layer.mla_part",
    "moe": "k3lab.model:Layer.moe_part",
    "dense": "k3lab.model:Layer.dense_part",
}


def layer_part(kind: str) -> Callable:
    """The builder of a layer kind's components (LAYER_PARTS)."""
    if kind not in LAYER_PARTS:
        raise RegistryError(f"no layer part for kind {kind!r}; registered: {sorted(LAYER_PARTS)}")
    mod, attr = LAYER_PARTS[kind].split(":")
    obj: Any = importlib.import_module(mod)
    for a in attr.split("."):
        obj = getattr(obj, a)
    return obj


def generator(seed: int, device: Any = "cpu"):
    """The seeded torch generator an op's `make_inputs` draws from (on `device`: a GPU bench builds many rotated
    sets of tens of MB)."""
    import torch

    return torch.Generator(device=device).manual_seed(seed)


REGISTRY: dict[str, Op] = {}
_LOADED = False
OP_MODULES = ("k3lab.ops.kda", "k3lab.ops.mla",
              "k3lab.ops.trunk",
              "k3lab.ops.moe", "k3lab.ops.glue")


def register(op: Op) -> Op:
    if op.name in REGISTRY and REGISTRY[op.name] is not op:
        raise RegistryError(f"op {op.name!r} is registered twice")
    REGISTRY[op.name] = op
    return op


LOAD_ERRORS: dict[str, str] = {}  # op module -> why it did not import (named by get / ops_of)


def _load() -> None:
    """Import every op module once. One that fails to import is named in LOAD_ERRORS and in the error of any
    lookup that misses, so one broken component never hides the others."""
    global _LOADED
    if not _LOADED:
        _LOADED = True
        for m in OP_MODULES:
            try:
                importlib.import_module(m)
            except Exception as e:  # noqa: BLE001
                LOAD_ERRORS[m] = f"{type(e).__name__}: {e}"


def _why_missing() -> str:
    return f" (op modules that failed to import: {LOAD_ERRORS})" if LOAD_ERRORS else ""


def get(name: str) -> Op:
    _load()
    if name not in REGISTRY:
        raise RegistryError(f"unknown op {name!r}; registered: {sorted(REGISTRY)}{_why_missing()}")
    return REGISTRY[name]


def components() -> list[str]:
    _load()
    return sorted({op.component for op in REGISTRY.values()})


def ops_of(component: str) -> list[Op]:
    _load()
    ops = [op for op in REGISTRY.values() if op.component == component]
    if not ops:
        raise RegistryError(f"unknown component {component!r}; registered components: {components()}"
                            f"{_why_missing()}")
    return ops
