"""The CuTe DSL MoE experts on the GPU, through the component API (k3lab.components.moe.experts, backend "cute": one
token, kernels/cute/moe_experts.py (MXFP4) and kernels/cute/moe_dense.py (bf16, fp8), and several,
kernels/cute/moe_grouped.py): the shared checker against fp64 at K3's pool (896 experts, latent 3584; TP8 and TP16
slices; outputs poisoned, inputs unchanged; the registry's MXFP4 tolerance), a top-k with a repeated id, pdl inside a
pdl chain, a CUDA graph replayed on new routing, and what the backend refuses by name.

    python3 -m pytest -q -m gpu tests/test_moe_cute.py
"""
import pytest
import torch

import cute_gate

cute_gate.require_cute_gpu()

from k3lab import registry  # noqa: E402
from k3lab.components import moe as c_moe  # noqa: E402
from k3lab.harness import checker  # noqa: E402
from k3lab.ops import moe as ops_moe  # noqa: E402

pytestmark = [pytest.mark.gpu, pytest.mark.cute]
OP = registry.get("moe_experts")
K3 = dict(dtype="mxfp4", batch=1, latent=3584, inter=3072, n_experts=896, top_k=16)


@pytest.mark.parametrize("tp,routing", [(8, "uniform"), (16, "uniform"), (8, "k3_reuse30")])
def test_k3_pool(tp, routing):
    for seed in (0, 1):
        checker.require(checker.check(OP, OP.case(tp=tp, routing=routing, **K3), backend="cute", seed=seed))


@pytest.mark.parametrize("dtype,tp", [("bf16", 8), ("fp8", 8), ("bf16", 16), ("fp8", 16)])
def test_dense_k3_pool(dtype, tp):
    """bf16 and fp8 experts of one token (kernels/cute/moe_dense.py) at K3's pool, through the component: the checker
    against fp64 (k3_reuse30 routing at seed 1), a repeated id, and the call inside a pdl chain."""
    from k3lab_kernels.triton.pdl import pdl_chain

    for seed, routing in ((0, "uniform"), (1, "k3_reuse30")):
        checker.require(checker.check(OP, OP.case(**dict(K3, dtype=dtype, tp=tp, routing=routing)), backend="cute",
                                      seed=seed))
    case = OP.case(**dict(K3, dtype=dtype, tp=tp))
    d = OP.make_inputs(case, 3, "cuda")
    d["idx"][0, 1] = d["idx"][0, 0]
    want = ops_moe.ref_experts(d, case)["y"]
    ran = []
    y = torch.full_like(d["y"], float("nan"))
    with pdl_chain(True):
        c_moe.experts(d["z"], d["idx"], d["weights_k"], d["moe"], backend="cute", out=y, check_values=False, ran=ran)
    torch.cuda.synchronize()
    assert float((y.double() - want).norm() / want.norm()) < ops_moe.TOL
    assert ran[-1].kernel == "k3lab_kernels.cute.moe_dense:moe_experts_dense"


@pytest.mark.parametrize("dtype,batch,routing", [("bf16", 8, "uniform"), ("fp8", 8, "same16"), ("bf16", 64, "uniform"),
                                                  ("fp8", 16, "k3_reuse30")])
def test_dense_grouped_k3_pool(dtype, batch, routing):
    """The grouped bf16 / fp8 twins (kernels/cute/moe_dense.py, tensor cores on the stored weights) at K3's TP8 pool:
    the checker against fp64, and the record names the kernel."""
    case = OP.case(**dict(K3, dtype=dtype, tp=8, batch=batch, routing=routing))
    res = checker.check(OP, case, backend="cute", seed=batch)
    checker.require(res)
    assert res.ran[-1].kernel == "k3lab_kernels.cute.moe_dense:moe_grouped_dense"


@pytest.mark.parametrize("batch", [1, 16])
def test_repeated_id_and_pdl(batch):
    """An id twice in a token's top-k adds that expert twice (each with its weight), as the reference does; the
    same call inside a pdl chain (the up kernel launched with PDL). Batch 1: the token kernels; 16: the grouped ones."""
    from k3lab_kernels.triton.pdl import pdl_chain

    case = OP.case(tp=8, routing="uniform", **dict(K3, batch=batch))
    d = OP.make_inputs(case, 3, "cuda")
    d["idx"][batch - 1, 1] = d["idx"][batch - 1, 0]
    want = ops_moe.ref_experts(d, case)["y"]
    for pdl in (False, True):
        y = torch.full_like(d["y"], float("nan"))
        with pdl_chain(pdl):
            c_moe.experts(d["z"], d["idx"], d["weights_k"], d["moe"], backend="cute", out=y, check_values=False)
        torch.cuda.synchronize()
        assert float((y.double() - want).norm() / want.norm()) < ops_moe.TOL


@pytest.mark.parametrize("pdl", [False, True])
def test_glue_outputs_tp8(pdl):
    """The down kernel's `glue` (k3lab.step.moe_glue_fold) at K3's TP8 pool: yg equal to bf16(y routed_norm) of the y
    it wrote, the partials (glue_partials) equal to y^2 summed over each CTA's rows (within fp32 rounding), y within the
    MXFP4 tolerance of fp64, NaN-poisoned first, under pdl and not."""
    from k3lab_kernels.cute.moe_experts import glue_partials
    from k3lab_kernels.triton.pdl import pdl_chain

    case = OP.case(tp=8, routing="uniform", **K3)
    d = OP.make_inputs(case, 5, "cuda")
    want = ops_moe.ref_experts(d, case)["y"]
    L = d["z"].shape[1]
    gam = (1 + 0.1 * torch.randn(L, device="cuda", generator=torch.Generator("cuda").manual_seed(1))).bfloat16()
    y = torch.full_like(d["y"], float("nan"))
    yg = torch.full((1, L + 768), float("nan"), device="cuda", dtype=torch.bfloat16)[:, :L]
    P = glue_partials(L)
    ssp = torch.full((1, P), float("nan"), device="cuda")
    with pdl_chain(pdl):
        c_moe.experts(d["z"], d["idx"], d["weights_k"], d["moe"], backend="cute", out=y, check_values=False,
                      glue=(gam, yg, ssp))
    torch.cuda.synchronize()
    assert float((y.double() - want).norm() / want.norm()) < ops_moe.TOL
    assert torch.equal(yg, (y * gam.float()).to(torch.bfloat16))
    ref = (y.double() ** 2).view(P, -1).sum(1)
    assert float(((ssp.double().view(-1) - ref).abs() / ref.clamp_min(1e-30)).max()) < 1e-6


@pytest.mark.parametrize("batch", [1, 16])
def test_graph_capture_new_routing(batch):
    case = OP.case(tp=8, routing="uniform", **dict(K3, batch=batch))
    a, b = OP.make_inputs(case, 1, "cuda"), OP.make_inputs(case, 2, "cuda")
    run = lambda: c_moe.experts(a["z"], a["idx"], a["weights_k"], a["moe"], backend="cute", out=a["y"],  # noqa
                                check_values=False)
    run()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        run()
    for k in ("z", "idx", "weights_k"):
        a[k].copy_(b[k])
    g.replay()
    torch.cuda.synchronize()
    want = ops_moe.ref_experts(b, case)["y"]
    assert float((a["y"].double() - want).norm() / want.norm()) < ops_moe.TOL


@pytest.mark.parametrize("batch,tp,routing", [(2, 8, "uniform"), (8, 8, "same16"), (9, 8, "same16"),
                                               (64, 8, "uniform"), (64, 16, "uniform"), (64, 8, "k3_reuse30"),
                                               (64, 8, "same16"), (1, 8, "uniform")])
def test_grouped_k3_pool(batch, tp, routing):
    """The grouped kernels (path "grouped"; the default above batch 1): K3's pool, groups of one to 64 members (same16
    at 9 tokens: two member tiles of 8; at 8, 9 and 64 the groups share their work among their members' CTAs, at 64
    over eight member tiles), TP8 and TP16, and one token through the grouped path too."""
    case = OP.case(tp=tp, routing=routing, **dict(K3, batch=batch))
    checker.require(checker.check(OP, case, backend="cute", options=dict(path="grouped"), seed=batch))


def test_refused_by_name():
    d = OP.make_inputs(OP.case(tp=8, routing="uniform", **dict(K3, batch=2)), 0, "cuda")
    with pytest.raises(ValueError, match="'z' must be one token for the cute backend's path 'token'"):
        c_moe.experts(d["z"], d["idx"], d["weights_k"], d["moe"], backend="cute", path="token")
    d1 = OP.make_inputs(OP.case(tp=8, routing="uniform", **K3), 0, "cuda")
    with pytest.raises(ValueError, match="'block_n'"):
        c_moe.experts(d1["z"], d1["idx"], d1["weights_k"], d1["moe"], backend="cute", block_n=16)
