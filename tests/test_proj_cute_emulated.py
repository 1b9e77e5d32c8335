"""The CuTe DSL projection (kernels/cute/proj_gemv.py) on the CPU emulator (tests/cute_emulate.py): its logic checked
without a GPU or nvidia-cutlass-dsl, through the shared checker (k3lab.harness.checker: fresh inputs, outputs
poisoned with NaN, the fp64 reference, inputs unchanged; the registry's tolerances), at the `tiny` preset (K = 64:
one partial step of the 256-column loop, masked by lane) and at K = 512 / 520 (full steps, and full steps plus a
partial one). Then what the cute backend refuses, by name.
"""
import pytest
import torch

import cute_emulate as emulate
from k3lab import registry
from k3lab.components import trunk
from k3lab.harness import checker
from k3lab.ops import trunk as trunk_ops

pytestmark = pytest.mark.cute_emu
PROJ, GROUP = registry.get("proj"), registry.get("proj_group")


def run_proj(x, w, outs, residual=None, pdl=False, seed=0):
    t = dict(x=x, w=w, **{f"o{i}": o for i, o in enumerate(outs)})
    emulate._PDL["early"] = frozenset({w.data_ptr()})  # under pdl only W may be read before the wait
    if residual is not None:
        t["r"] = residual
    emulate._run(lambda m, **a: m.mod["proj_gemv"].proj(a["x"], a["w"], [a[f"o{i}"] for i in range(len(outs))],
                                                        residual=a.get("r"), pdl=pdl), t, seed)


def impl(n_out, pdl=False):
    def f(d):
        run_proj(d["x"], d["w"], [d[f"y{i}"] for i in range(n_out)], d.get("residual"), pdl)
    f.__name__ = f"emulated cute proj({n_out} outputs, pdl={pdl})"
    return f


@pytest.mark.parametrize("name,batch,residual", [("kda_b", 3, True), ("mla_dkv", 1, False), ("moe_router", 2, False)])
def test_proj_tiny(name, batch, residual):
    c = PROJ.case(preset="tiny", proj=name, batch=batch, wdtype="bf16", residual=residual, prologue="none")
    checker.require(checker.check(PROJ, c, impl=impl(1), seed=batch, device="cpu"))


def test_group_tiny():
    """The MLA input group (q and kv down-projections and the gate: three outputs, one fp32 or bf16 each)."""
    c = GROUP.case(preset="tiny", group="mla_in", batch=2, wdtype="bf16", select=False)
    n = len(trunk_ops._parts(c))
    checker.require(checker.check(GROUP, c, impl=impl(n, pdl=True), seed=1, device="cpu"))
    assert emulate.LAST["launches"][-1]["use_pdl"] is True


@pytest.mark.parametrize("K", [512, 520])
def test_full_and_partial_steps(K):
    """Two full 256-column steps (512), and two plus a partial one (520: lanes 0 past the full steps load)."""
    g = torch.Generator().manual_seed(K)
    x = torch.randn(2, K, generator=g).to(torch.bfloat16)
    w = (torch.randn(6, K, generator=g) / K ** 0.5).to(torch.bfloat16)
    out = torch.full((2, 6), float("nan"), dtype=torch.float32)
    run_proj(x, w, [out])
    want = x.double() @ w.double().T
    assert (out.double() - want).abs().max() < 1e-4 * want.abs().max()


def test_pdl_weight_before_the_wait():
    """Under pdl the first PRE steps of W load before griddepcontrol.wait (W is no kernel's output) and nothing else
    does: K = 1280 (five steps: the four preloaded and one in the loop) with a residual, checked against fp64; the
    emulator refuses the same launch when W is not declared readable early (the check is live)."""
    g = torch.Generator().manual_seed(3)
    K = 1280
    x = torch.randn(1, K, generator=g).to(torch.bfloat16)
    w = (torch.randn(8, K, generator=g) / K ** 0.5).to(torch.bfloat16)
    r = torch.randn(1, 8, generator=g).to(torch.bfloat16)
    out = torch.full((1, 8), float("nan"), dtype=torch.bfloat16)
    run_proj(x, w, [out], residual=r, pdl=True)
    want = x.double() @ w.double().T + r.double()
    assert (out.double() - want).abs().max() < 2e-2 * want.abs().max()
    t = dict(x=x, w=w, o0=out, r=r)
    emulate._PDL["early"] = frozenset()
    with pytest.raises(emulate.EmulationError, match="before griddepcontrol.wait"):
        emulate._run(lambda m, **a: m.mod["proj_gemv"].proj(a["x"], a["w"], [a["o0"]], residual=a["r"], pdl=True),
                     t, 0)


def test_refused_by_name():
    c = PROJ.case(preset="tiny", proj="kda_b", batch=1, wdtype="bf16", residual=False, prologue="none")
    d = PROJ.make_inputs(c, 0, "cpu")
    with pytest.raises(ValueError, match="'w' must have dtype"):
        run_proj(d["x"], d["w"].float(), [d["y0"]])
    with pytest.raises(ValueError, match="'x' must be"):
        run_proj(torch.zeros(17, 64, dtype=torch.bfloat16), d["w"], [torch.zeros(17, 4, dtype=torch.bfloat16)])
    with pytest.raises(ValueError, match="'outs' widths must add up"):
        run_proj(d["x"], d["w"], [d["y0"][:, :2]])
    with pytest.raises(ValueError, match="'pdl' must be None or a bool"):
        run_proj(d["x"], d["w"], [d["y0"]], pdl=1)
    from k3lab.switches import BackendUnavailable

    with pytest.raises(BackendUnavailable, match="'cute'"):  # the component where CuTe DSL cannot run
        trunk.proj(torch.zeros(1, 64, dtype=torch.bfloat16), torch.zeros(4, 64, dtype=torch.bfloat16), backend="cute")


def test_supports_names_what_cute_does_not_take():
    """The registry's `supports` (which `auto` and the benchmark consult): fp8 weights, prologues, the fused
    selection and more than 16 rows are not the cute projection's."""
    from k3lab.ops.trunk import proj_supports

    assert proj_supports("cute", dict(batch=16, wdtype="bf16")) is None
    assert "bf16 weights" in proj_supports("cute", dict(batch=1, wdtype="fp8"))
    assert "1..16" in proj_supports("cute", dict(batch=17))
    assert "prologue" in proj_supports("cute", dict(batch=1, prologue="rms"))
    assert "prologue" in proj_supports("cute", dict(batch=1, select=True))


def test_bench_skips_what_a_backend_does_not_take(monkeypatch):
    """The benchmark asks `supports` per case: an fp8 case lists cute as skipped, with the reason, instead of timing a
    refusal; a bf16 case keeps it."""
    from k3lab.bench import runner

    monkeypatch.setattr(runner, "backend_status", lambda be: (True, ""))
    fp8 = PROJ.case(preset="tiny", proj="kda_q", batch=1, wdtype="fp8", residual=False, prologue="none")
    impls, skipped = runner.implementations(PROJ, fp8, ["cute"], peers=False, only={}, gpu=False)
    assert not impls and "bf16 weights" in skipped["cute"]
    bf16 = PROJ.case(preset="tiny", proj="kda_q", batch=1, wdtype="bf16", residual=False, prologue="none")
    impls, skipped = runner.implementations(PROJ, bf16, ["cute"], peers=False, only={}, gpu=False)
    assert [i.name for i in impls] == ["cute"] and not skipped
