"""The CuTe DSL router top-k (kernels/cute/router_topk.py) on the GPU, through the component API
(k3lab.components.trunk.router_topk, backend "cute"): the shared checker against the fp64 oracle on every score case
of the registry at batch 1, 2, 5, 16 and 64 (idx exact under the tie rule, weights 1e-5; outputs poisoned), pdl,
and idx and weights bit-identical to the triton backend on the same logits (same fp32 operations, same tie rule:
the kernel's module doc), also on strided logits, odd shapes, inputs that take the kernel's two-chunk ranking and
its k-rounds fallback, and under CUDA-graph replay.

    python3 -m pytest -q -m gpu tests/test_router_cute.py
"""
import pytest
import torch

import cute_gate

cute_gate.require_cute_gpu()

from k3lab import registry  # noqa: E402
from k3lab.components import trunk  # noqa: E402
from k3lab.harness import checker  # noqa: E402
from k3lab.ops.trunk import make_router  # noqa: E402

pytestmark = pytest.mark.gpu
ROUTER = registry.get("router_topk")
BATCHES = (1, 2, 5, 16, 64)
SCORES = ("random", "near", "ties")


def case(batch, scores="random", experts=896, top_k=16):
    return ROUTER.case(batch=batch, experts=experts, top_k=top_k, scores=scores)


def run(backend, logits, e_bias, top_k=16, scaling=1.0, **kw):
    B = logits.shape[0]
    idx = torch.full((B, top_k), -1, dtype=torch.int64, device=logits.device)
    w = torch.full((B, top_k), float("nan"), device=logits.device)
    ran = []
    trunk.router_topk(logits, e_bias, top_k=top_k, scaling=scaling, idx=idx, weights=w, backend=backend, ran=ran,
                      **kw)
    torch.cuda.synchronize()
    assert ran[-1].backend == backend
    return idx, w


def assert_bits(logits, e_bias, top_k=16, scaling=1.0, **kw):
    ti, tw = run("triton", logits, e_bias, top_k, scaling)
    ci, cw = run("cute", logits, e_bias, top_k, scaling, **kw)
    assert torch.equal(ci, ti), (ci != ti).nonzero()[:8]
    diff = cw.view(torch.int32) != tw.view(torch.int32)
    assert not diff.any(), f"{int(diff.sum())} weights differ in bits, max |d| {(cw - tw).abs().max().item():.3e}"


@pytest.mark.parametrize("scores", SCORES)
@pytest.mark.parametrize("batch", BATCHES)
def test_checker(batch, scores):
    checker.require(checker.check(ROUTER, case(batch, scores), backend="cute", seed=batch))


@pytest.mark.parametrize("batch", (1, 64))
def test_checker_pdl(batch):
    checker.require(checker.check(ROUTER, case(batch), backend="cute", options=dict(pdl=True), seed=7))


@pytest.mark.parametrize("scores", SCORES)
@pytest.mark.parametrize("batch", BATCHES)
def test_bits_as_triton(batch, scores):
    d = make_router(case(batch, scores), 100 + batch, "cuda")
    assert_bits(d["logits"], d["e_bias"], scaling=2.5)


def test_bits_as_triton_pdl_and_strided():
    """pdl, and logits as a column slice of wider rows (as a fused projection's output is)."""
    g = torch.Generator(device="cuda").manual_seed(3)
    wide = torch.randn(16, 1000, generator=g, device="cuda") * 2
    bias = torch.randn(896, generator=g, device="cuda") * 0.1
    assert_bits(wide[:, 40:936], bias, pdl=True)


@pytest.mark.parametrize("experts,top_k", [(200, 5), (896, 1), (896, 7), (896, 32), (64, 16), (1024, 16)])
def test_odd_shapes(experts, top_k):
    checker.require(checker.check(ROUTER, case(5, "random", experts, top_k), backend="cute", seed=top_k))
    d = make_router(case(5, "ties", experts, top_k), 9, "cuda")
    assert_bits(d["logits"], d["e_bias"], top_k)


@pytest.mark.parametrize("groups", [1, 5])
def test_crowded_groups(groups):
    """The top experts in the first `groups` of the kernel's 32 groups: ~35 candidates (two chunks) at 1, ~110
    (the k-rounds fallback) at 5 (tests/test_router_cute_emulated.py counts them)."""
    g = torch.Generator(device="cuda").manual_seed(groups)
    z = torch.randn(64, 896, generator=g, device="cuda")
    lanes = (torch.arange(896, device="cuda") % 224) % 32
    z[:, lanes < groups] += 6.0
    bias = torch.randn(896, generator=g, device="cuda") * 0.1
    d = make_router(case(64), 0, "cuda")
    d.update(logits=z, e_bias=bias)
    checker.require(checker.check(ROUTER, case(64), backend="cute", inputs=d))
    assert_bits(z, bias)


def test_cuda_graph_replay():
    d = make_router(case(16), 11, "cuda")
    want_i, want_w = run("cute", d["logits"], d["e_bias"])
    idx = torch.full_like(want_i, -1)
    w = torch.full_like(want_w, float("nan"))
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        trunk.router_topk(d["logits"], d["e_bias"], top_k=16, idx=idx, weights=w, backend="cute")
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(idx, want_i) and torch.equal(w, want_w)


def test_options_by_name():
    d = make_router(case(1), 0, "cuda")
    with pytest.raises(trunk.TrunkArgumentError, match="'num_warps'"):
        trunk.router_topk(d["logits"], d["e_bias"], top_k=16, backend="cute", num_warps=4)
    with pytest.raises(trunk.TrunkArgumentError, match="'pdl'"):
        trunk.router_topk(d["logits"], d["e_bias"], top_k=16, backend="cute", pdl=1)
