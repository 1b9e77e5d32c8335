"""The CuTe DSL MLA combine (kernels/cute/mla_combine.py) on the CPU emulator (tests/cute_emulate.py): its logic
checked without a GPU or nvidia-cutlass-dsl, through the shared checker (k3lab.harness.checker: fresh inputs, out
poisoned with NaN, the fp64 reference, inputs unchanged; the registry's tolerance for the bf16 output).

Cases: one partial (an already merged o_lat), several with empty ones (lse = -inf), batch 1 and batch x T rows that
leave a row block part-empty, every block_r, pdl with the emulator's order check (only the gate read before
griddepcontrol.wait). Heads are few (2) to keep the emulated grid small; the kernel takes any head count.
"""
import pytest
import torch

import cute_emulate as emulate
from k3lab import registry
from k3lab.harness import checker

pytestmark = pytest.mark.cute_emu
COMB = registry.get("mla_combine")


def run_combine(o_part, lse_part, w_uv, gate, out, *, block_r=None, pdl=False, early=None, seed=0):
    """mla_combine on the emulator (the wrapper's arguments as CPU tensors). pdl=True also checks the launch's
    order: only `early` (default: the gate) read, nothing written, before griddepcontrol.wait."""
    emulate._PDL["early"] = frozenset(t.data_ptr() for t in (early if early is not None else [gate]))
    emulate._run(lambda m, **a: m.mod["mla_combine"].mla_combine(**a, block_r=block_r, pdl=pdl),
                 dict(o_part=o_part, lse_part=lse_part, w_uv=w_uv, gate=gate, out=out), seed)
    return out


def impl(**kw):
    def f(d):
        run_combine(d["o_parts"], d["lse_parts"], d["w_uv"], d["gate"], d["out"], **kw)
    f.__name__ = f"emulated cute mla_combine({kw})"
    return f


def check(seed=0, block_r=None, pdl=False, **shape):
    c = COMB.case(**dict(dict(heads=2, batch=1, T=1, partitions=1, dcp=1), **shape))
    return checker.require(checker.check(COMB, c, impl=impl(block_r=block_r, pdl=pdl), seed=seed, device="cpu"))


@pytest.mark.parametrize("shape", [
    dict(),                                   # batch 1, one partial (K = 1: a copy, no lse)
    dict(partitions=5),                       # batch 1, five partials
    dict(batch=3, T=2, partitions=3),         # six rows: one full block of four and one of two; empty partials
    dict(batch=2, partitions=2, dcp=2, heads=3),  # pieces x shards
], ids=lambda d: ",".join(f"{k}={v}" for k, v in d.items()) or "b1k1")
def test_combine(shape):
    check(seed=len(shape), **shape)


@pytest.mark.parametrize("block_r", [1, 2, 8])
def test_block_r(block_r):
    check(seed=block_r, block_r=block_r, batch=3, T=1, partitions=2)
    assert emulate.LAST["launches"][-1]["grid"] == (2, 4, -(-3 // block_r))


def test_pdl():
    check(seed=7, pdl=True, batch=2, partitions=3)
    assert emulate.LAST["launches"][-1]["use_pdl"] is True


def test_pdl_order_is_enforced():
    """With nothing declared readable before the wait, the early gate load must be caught."""
    d = COMB.make_inputs(COMB.case(heads=2, batch=1, T=1, partitions=2, dcp=1), 0, "cpu")
    with pytest.raises(emulate.EmulationError, match="before griddepcontrol.wait"):
        run_combine(d["o_parts"], d["lse_parts"], d["w_uv"], d["gate"], d["out"], pdl=True, early=[d["w_uv"]])


def test_every_partial_empty():
    """A row whose partials are all empty (lse = -inf) merges to zeros, as the reference's guarded sum."""
    d = COMB.make_inputs(COMB.case(heads=2, batch=1, T=1, partitions=3, dcp=1), 0, "cpu")
    d["lse_parts"].fill_(float("-inf"))
    run_combine(d["o_parts"], d["lse_parts"], d["w_uv"], d["gate"], d["out"])
    assert torch.equal(d["out"], torch.zeros_like(d["out"]))


@pytest.mark.parametrize("bad,match", [
    (dict(w_uv=torch.zeros(2, 512, 64, dtype=torch.bfloat16)), "'w_uv' must have shape"),
    (dict(gate=torch.zeros(1, 1, 256)), "'gate' must have dtype"),
    (dict(block_r=3), "'block_r' must be None or one of"),
    (dict(pdl=1), "'pdl' must be None or a bool"),
])
def test_arguments_named(bad, match):
    d = COMB.make_inputs(COMB.case(heads=2, batch=1, T=1, partitions=2, dcp=1), 0, "cpu")
    args = dict(o_part=d["o_parts"], lse_part=d["lse_parts"], w_uv=d["w_uv"], gate=d["gate"], out=d["out"])
    kw = {k: bad.pop(k) for k in ("block_r", "pdl") if k in bad}
    args.update(bad)
    with pytest.raises(ValueError, match=match):
        emulate._run(lambda m, **a: m.mod["mla_combine"].mla_combine(**a, **kw), args, 0)


def test_component_refuses_cute_without_cutlass():
    """The component API (k3lab.components.mla.combine, backend "cute") refuses by name where it cannot run."""
    from k3lab.components import mla as comp
    from k3lab.switches import BackendUnavailable

    d = COMB.make_inputs(COMB.case(heads=2, batch=1, T=1, partitions=2, dcp=1), 0, "cpu")
    with pytest.raises(BackendUnavailable, match="'cute'"):
        comp.combine(d["o_parts"], d["lse_parts"], d["w_uv"], d["gate"], backend="cute")


def test_merge_weights_bound_the_rows():
    """A CTA keeps RB x K merge weights in shared memory: the default halves RB to fit, an explicit block_r that
    does not fit is refused by name."""
    from k3lab_kernels.cute import mla_combine as kc

    assert kc.default_block_r(1) == 1 and kc.default_block_r(64) == 4 and kc.default_block_r(64, 2048) == 2
    assert kc.default_block_r(64, 4096) == 1
    d = COMB.make_inputs(COMB.case(heads=2, batch=8, T=1, partitions=600, dcp=1), 0, "cpu")
    with pytest.raises(ValueError, match="'block_r' 8 rows x 600 partials exceed"):
        run_combine(d["o_parts"], d["lse_parts"], d["w_uv"], d["gate"], d["out"], block_r=8)
