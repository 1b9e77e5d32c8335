"""The CuTe DSL projection (kernels/cute/proj_gemv.py) on the GPU, through the component API
(k3lab.components.trunk.proj / proj_group, backend "cute"): the shared checker against fp64 at K3's TP8 shapes
(outputs poisoned, inputs unchanged; the registry's tolerances), batch 1, 8 and 16, with a residual, a fused group,
and what the backend refuses by name.

    python3 -m pytest -q -m gpu tests/test_proj_cute.py
"""
import pytest
import torch

import cute_gate

cute_gate.require_cute_gpu()

from k3lab import registry  # noqa: E402
from k3lab.components import trunk  # noqa: E402
from k3lab.harness import checker  # noqa: E402

pytestmark = [pytest.mark.gpu, pytest.mark.cute]
PROJ, GROUP = registry.get("proj"), registry.get("proj_group")


@pytest.mark.parametrize("name,batch,residual", [("kda_q", 1, False), ("mla_dkv", 8, False), ("kda_o", 16, True),
                                                 ("moe_router", 1, False), ("kda_fb", 3, False)])
def test_proj_tp8(name, batch, residual):
    c = PROJ.case(preset="tp8", proj=name, batch=batch, wdtype="bf16", residual=residual, prologue="none")
    checker.require(checker.check(PROJ, c, backend="cute", seed=batch))


@pytest.mark.parametrize("group,batch", [("mla_in", 1), ("moe_in", 4)])
def test_group_tp8(group, batch):
    c = GROUP.case(preset="tp8", group=group, batch=batch, wdtype="bf16", select=False)
    checker.require(checker.check(GROUP, c, backend="cute", seed=batch))


@pytest.mark.parametrize("batch", [1, 2, 4])
def test_group_select_tp8(batch):
    """The MoE input group with the router's selection fused (the last router CTA selects), under pdl and not: the
    checker against fp64, then idx / weights bit-equal to the stand-alone CuTe router on the same logits."""
    from k3lab_kernels.triton.pdl import pdl_chain

    c = GROUP.case(preset="tp8", group="moe_in", batch=batch, wdtype="bf16", select=True)
    for on in (False, True):
        with pdl_chain(on):
            checker.require(checker.check(GROUP, c, backend="cute", seed=batch + 10 * on))
    d = GROUP.make_inputs(c, batch, "cuda")
    outs = [d[f"y{i}"] for i in range(4)]
    with pdl_chain(True):
        for _ in range(3):  # the arrival counter is zero again after each call
            trunk.proj_group(d["x"], d["w"], outs, select=trunk.Select(d["e_bias"], d["idx"], d["weights"]),
                             backend="cute")
    i2, w2 = torch.empty_like(d["idx"]), torch.empty_like(d["weights"])
    trunk.router_topk(outs[0].clone(), d["e_bias"], top_k=d["idx"].shape[1], idx=i2, weights=w2, backend="cute")
    assert torch.equal(d["idx"], i2) and torch.equal(d["weights"], w2)


def test_refused_by_name():
    dev = "cuda"
    x = torch.zeros(1, 256, dtype=torch.bfloat16, device=dev)
    w = torch.zeros(4, 256, dtype=torch.bfloat16, device=dev)
    with pytest.raises(ValueError, match="'prologue'"):
        trunk.proj(x, w, backend="cute", prologue=("rms", torch.ones(256, device=dev), 1e-6))
    with pytest.raises(ValueError, match="'w_scale'|'w' must have dtype"):
        trunk.proj(x, w.to(torch.float8_e4m3fn), backend="cute", w_scale=torch.ones(4, device=dev))
    with pytest.raises(ValueError, match="'block_n'"):
        trunk.proj(x, w, backend="cute", block_n=16)
    with pytest.raises(ValueError, match="'x' must be"):
        trunk.proj(torch.zeros(17, 256, dtype=torch.bfloat16, device=dev), w, backend="cute")
