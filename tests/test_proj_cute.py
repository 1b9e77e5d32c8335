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


@pytest.mark.parametrize("name,batch,residual", [("kda_q", 1, False), ("kda_o", 4, True), ("moe_down", 1, False),
                                                 ("kda_fb", 3, False)])
def test_proj_fp8_tp8(name, batch, residual):
    """fp8 weights (e4m3, one fp32 scale a row) against W_e4m3 * scale in fp64, then the same call inside a pdl chain
    (the weight's words before the wait) equal to the plain launch's output."""
    from k3lab.components import trunk
    from k3lab_kernels.triton.pdl import pdl_chain

    c = PROJ.case(preset="tp8", proj=name, batch=batch, wdtype="fp8", residual=residual, prologue="none")
    checker.require(checker.check(PROJ, c, backend="cute", seed=batch))
    d = PROJ.make_inputs(c, 9, "cuda")
    ys = []
    for pdl in (False, True):
        y = torch.full_like(d["y0"], float("nan"))
        with pdl_chain(pdl):
            trunk.proj(d["x"], d["w"], y, w_scale=d["w_scale"], residual=d.get("residual"), backend="cute")
        ys.append(y)
    torch.cuda.synchronize()
    assert torch.equal(ys[0], ys[1])


@pytest.mark.parametrize("wdtype", ["bf16", "fp8"])
@pytest.mark.parametrize("name,batch,residual", [("kda_q", 2, False), ("kda_o", 8, True), ("moe_down", 16, False),
                                                 ("mla_dkv", 9, False), ("kda_b", 4, False), ("kda_fb", 3, False)])
def test_proj_mma_tp8(wdtype, name, batch, residual):
    """Path "mma" (kernels/cute/proj_mma.py: tensor cores, K split over a cluster) against fp64 at K3's TP8 shapes, its
    automatic tile and cluster; then inside a pdl chain (the first round of weights before the wait), with x loaded a
    from global memory or staged (X_SMEM flipped, with and without pdl) bit-equal to the plain launch, and
    other tiles and cluster sizes equal to within fp32 summation order."""
    from k3lab_kernels.triton.pdl import pdl_chain

    c = PROJ.case(preset="tp8", proj=name, batch=batch, wdtype=wdtype, residual=residual, prologue="none")
    checker.require(checker.check(PROJ, c, backend="cute", options=dict(path="mma"), seed=batch))
    d = PROJ.make_inputs(c, 9, "cuda")
    ws = d["w_scale"] if wdtype == "fp8" else None
    from k3lab_kernels.cute import proj_mma as pm

    ys = []
    for pdl, cl, tm in ((False, None, None), (True, None, None), (False, 1, 16), (False, 2, 64), (False, 8, 32)):
        y = torch.full_like(d["y0"], float("nan"))
        if cl is not None and pm.smem_bytes(batch, d["x"].shape[1], wdtype == "fp8", tm, cl) > pm.SMEM_LIMIT:
            # x staged for these tokens does not fit a CTA (moe_down at 16 tokens in a cluster of one): refused by name
            with pytest.raises(ValueError, match="'cluster'"):
                trunk.proj(d["x"], d["w"], y, w_scale=ws, residual=d.get("residual"), backend="cute", path="mma",
                           cluster=cl, tile_m=tm)
            continue
        with pdl_chain(pdl):
            trunk.proj(d["x"], d["w"], y, w_scale=ws, residual=d.get("residual"), backend="cute", path="mma",
                       cluster=cl, tile_m=tm)
        ys.append(y.float())

    staged = pm.X_SMEM
    for pdl in (False, True):  # where x comes from: the same products in the same order
        pm.X_SMEM = not staged
        try:
            y = torch.full_like(d["y0"], float("nan"))
            with pdl_chain(pdl):
                trunk.proj(d["x"], d["w"], y, w_scale=ws, residual=d.get("residual"), backend="cute", path="mma")
            ys.insert(2, y.float())
        finally:
            pm.X_SMEM = staged
    torch.cuda.synchronize()
    assert torch.equal(ys[0], ys[1]) and torch.equal(ys[0], ys[2]) and torch.equal(ys[0], ys[3])
    for y in ys[4:]:
        assert (y - ys[0]).abs().max() <= 1e-2 * ys[0].abs().max()


def test_group_mma_tp8():
    c = GROUP.case(preset="tp8", group="mla_in", batch=8, wdtype="fp8", select=False)
    checker.require(checker.check(GROUP, c, backend="cute", options=dict(path="mma"), seed=8))


def test_group_fp8_tp8():
    c = GROUP.case(preset="tp8", group="mla_in", batch=2, wdtype="fp8", select=False)
    checker.require(checker.check(GROUP, c, backend="cute", seed=2))


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
    with pytest.raises(ValueError, match="'w_scale'"):  # a scale without fp8 weights
        trunk.proj(x, w, backend="cute", w_scale=torch.ones(4, device=dev))
    with pytest.raises(ValueError, match="'block_n'"):
        trunk.proj(x, w, backend="cute", block_n=16)
    with pytest.raises(ValueError, match="'x' must be"):
        trunk.proj(torch.zeros(17, 256, dtype=torch.bfloat16, device=dev), w, backend="cute")


@pytest.mark.parametrize("batch,pdl", [(1, True), (1, False), (3, True), (16, False)])
def test_group_chain_tp8(batch, pdl):
    """The KDA input group at TP8 in the step's order [fa | q|k|v | g | beta] with the decay's second factor chained
    (f = W_fb fa: 384 chain CTAs after the group's 1571, waiting for fa's 32): every output against fp64 (the group
    from x, f from the stored bf16 fa), NaN-poisoned first, five calls in a row (the counts return to zero), under
    pdl inside a pdl chain and plainly."""
    from k3lab_kernels.triton.pdl import pdl_chain

    g = torch.Generator("cuda").manual_seed(batch)
    D, R, HD, H = 7168, 128, 1536, 12
    x = torch.randn(batch, D, device="cuda", generator=g).to(torch.bfloat16)
    w = (torch.randn(R + 4 * HD + H, D, device="cuda", generator=g) / D ** 0.5).to(torch.bfloat16)
    w2 = (torch.randn(HD, R, device="cuda", generator=g) / R ** 0.5).to(torch.bfloat16)
    for _ in range(5):
        outs = [torch.full((batch, n), float("nan"), device="cuda", dtype=torch.bfloat16) for n in (R, 3 * HD, HD, H)]
        f = torch.full((batch, HD), float("nan"), device="cuda", dtype=torch.bfloat16)
        with pdl_chain(pdl):
            trunk.proj_group(x, w, outs, backend="cute", chain=(w2, f))
        torch.cuda.synchronize()
        want = x.double() @ w.double().T
        got = torch.cat(outs, 1).double()
        assert ((got - want).norm() / want.norm()).item() < 4e-3
        wf = outs[0].double() @ w2.double().T
        assert not f.isnan().any() and ((f.double() - wf).norm() / wf.norm()).item() < 4e-3


@pytest.mark.parametrize("batch,pdl", [(1, True), (1, False), (4, True)])
def test_group_glu_select_tp8(batch, pdl):
    """The MoE input group at TP8 with the glue folded (k3lab.step.moe_glue_fold): [router logits fp32 (896) | z
    (3584) | situ(g, u) (768: W's last 1536 rows [w1 | w3])] with the router's selection fused, three calls in a
    row, NaN-poisoned first: logits and z against fp64, the GLU output against situ of the fp64 g and u (their bf16
    rounding within the tolerance), idx / weights equal to the stand-alone CuTe router on the same logits."""
    from k3lab.ref.situ import situ
    from k3lab_kernels.triton.pdl import pdl_chain

    g = torch.Generator("cuda").manual_seed(batch)
    D, E, Lat, sI, k = 7168, 896, 3584, 768, 16
    x = torch.randn(batch, D, device="cuda", generator=g).to(torch.bfloat16)
    w = (torch.randn(E + Lat + 2 * sI, D, device="cuda", generator=g) / D ** 0.5 * 2).to(torch.bfloat16)
    bias = torch.randn(E, device="cuda", generator=g) * 0.01
    want = x.double() @ w.double().T
    for _ in range(3):
        outs = [torch.full((batch, E), float("nan"), device="cuda"),
                torch.full((batch, Lat), float("nan"), device="cuda", dtype=torch.bfloat16),
                torch.full((batch, sI), float("nan"), device="cuda", dtype=torch.bfloat16)]
        idx = torch.full((batch, k), -1, device="cuda", dtype=torch.int64)
        wk = torch.full((batch, k), float("nan"), device="cuda")
        with pdl_chain(pdl):
            trunk.proj_group(x, w, outs, select=trunk.Select(bias, idx, wk), glu=(4.0, 25.0), backend="cute")
        torch.cuda.synchronize()
        for o, ref in ((outs[0], want[:, :E]), (outs[1], want[:, E:E + Lat])):
            assert ((o.double() - ref).norm() / ref.norm()).item() < 4e-3
        a = situ(want[:, E + Lat:E + Lat + sI], want[:, E + Lat + sI:])
        assert not outs[2].isnan().any() and ((outs[2].double() - a).norm() / a.norm()).item() < 1e-2
        i2, w2 = torch.empty_like(idx), torch.empty_like(wk)
        trunk.router_topk(outs[0].clone(), bias, top_k=k, idx=i2, weights=w2, backend="cute")
        assert torch.equal(idx, i2) and torch.equal(wk, w2)


@pytest.mark.parametrize("backend", ["cute"])
@pytest.mark.parametrize("batch,pdl", [(1, True), (1, False), (3, True)])
def test_moe_out_rmsp_tp8(backend, batch, pdl):
    """The MoE output at TP8 with the glue folded: p + [Wup | w2_shared] x, x = [bf16(y routed_norm) (3584) | a
    (768)], the first segment's sum times rsqrt(sum of 896 partial sums of y^2 / 3584 + eps) (the "rmsp" prologue), on
    the CuTe GEMV, NaN-poisoned, twice, against the fp64 oracle of the unrounded norm
    (tolerance: bf16 inputs and output, 4e-3)."""
    from k3lab_kernels.triton.pdl import pdl_chain

    g = torch.Generator("cuda").manual_seed(batch + 7)
    D, Lat, sI = 7168, 3584, 768
    y = torch.randn(batch, Lat, device="cuda", generator=g) * 0.3
    nw = (1 + 0.1 * torch.randn(Lat, device="cuda", generator=g)).to(torch.bfloat16)
    a = torch.randn(batch, sI, device="cuda", generator=g).to(torch.bfloat16)
    x = torch.cat([(y * nw.float()).to(torch.bfloat16), a], 1)
    ssp = (y * y).view(batch, 896, 4).sum(2).contiguous()
    w = (torch.randn(D, Lat + sI, device="cuda", generator=g) / (Lat + sI) ** 0.5).to(torch.bfloat16)
    p = torch.randn(batch, D, device="cuda", generator=g).to(torch.bfloat16)
    yd = y.double()
    xn = yd * torch.rsqrt(yd.pow(2).mean(1, keepdim=True) + 1e-6) * nw.double()
    want = torch.cat([xn, a.double()], 1) @ w.double().T + p.double()
    for _ in range(2):
        out = torch.full((batch, D), float("nan"), device="cuda", dtype=torch.bfloat16)
        with pdl_chain(pdl):
            trunk.proj(x, w, out, residual=p, prologue=("rmsp", ssp, Lat, 1e-6), backend=backend)
        torch.cuda.synchronize()
        assert ((out.double() - want).norm() / want.norm()).item() < 4e-3


@pytest.mark.parametrize("wdtype,batch,budget", [("bf16", 1, 1 << 24), ("fp8", 3, 1 << 24), ("bf16", 64, 1 << 30)])
def test_l2_prefetch_cute(wdtype, batch, budget):
    """The `prefetch` switch's CuTe kernel (kernels/cute/l2_prefetch.py): its record of TP8 kda_in's plan against the
    reference's lines through the checker, then a real prefetch (one bulk hint a range) on a side stream, its plan
    the Triton twin's."""
    op = registry.get("l2_prefetch")
    c = op.case(preset="tp8", group="kda_in", batch=batch, wdtype=wdtype, budget=budget)
    checker.require(checker.check(op, c, backend="cute", seed=batch))
    d = op.make_inputs(c, 1, "cuda")
    side = torch.cuda.Stream()
    with torch.cuda.stream(side):
        plan = trunk.prefetch_l2(d["w"], batch, budget=budget, backend="cute")
    torch.cuda.synchronize()
    assert plan == trunk.prefetch_plan(d["w"], batch, budget) and plan["lines"] > 0
