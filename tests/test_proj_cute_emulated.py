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


def run_proj(x, w, outs, residual=None, pdl=False, seed=0, select=None, chain=None, rmsp=None, glu=None,
             w_scale=None):
    """proj on the emulator; select None or (e_bias, idx, weights, scaling): the fused router selection; chain None
    or (w2, f): the chained projection f = outs[0] w2^T; rmsp None or (ssp, k0, eps): the rms-scaled segment; glu
    None or (b1, b2): the last output as situ(g, u) over its [g | u] rows; w_scale: fp8 weights' row scales."""
    t = dict(x=x, w=w, **{f"o{i}": o for i, o in enumerate(outs)})
    if w_scale is not None:
        t["ws"] = w_scale
    if chain is not None:
        t.update(w2=chain[0], f=chain[1])
    if rmsp is not None:
        t.update(ssp=rmsp[0])
    early = {w.data_ptr()}  # under pdl only W (and the router's bias) may be read before the wait
    if residual is not None:
        t["r"] = residual
    if select is not None:
        t.update(eb=select[0], idx=select[1], wk=select[2])
        early.add(select[0].data_ptr())
    emulate._PDL["early"] = frozenset(early)

    def call(m, **a):
        sel = None if select is None else (a["eb"], a["idx"], a["wk"], select[3])
        ch = None if chain is None else (a["w2"], a["f"])
        rm = None if rmsp is None else (a["ssp"], rmsp[1], rmsp[2])
        m.mod["proj_gemv"].proj(a["x"], a["w"], [a[f"o{i}"] for i in range(len(outs))], residual=a.get("r"), pdl=pdl,
                                select=sel, chain=ch, rmsp=rm, glu=glu, w_scale=a.get("ws"))
    emulate._run(call, t, seed)


def impl(n_out, pdl=False, select=False):
    def f(d):
        sel = (d["e_bias"], d["idx"], d["weights"], 1.0) if select else None
        ws = d["w_scale"] if d["w"].dtype == torch.float8_e4m3fn else None
        run_proj(d["x"], d["w"], [d[f"y{i}"] for i in range(n_out)], d.get("residual"), pdl, select=sel, w_scale=ws)
    f.__name__ = f"emulated cute proj({n_out} outputs, pdl={pdl}, select={select})"
    return f


@pytest.mark.parametrize("name,batch,residual", [("kda_b", 3, True), ("mla_dkv", 1, False), ("moe_router", 2, False)])
def test_proj_tiny(name, batch, residual):
    c = PROJ.case(preset="tiny", proj=name, batch=batch, wdtype="bf16", residual=residual, prologue="none")
    checker.require(checker.check(PROJ, c, impl=impl(1), seed=batch, device="cpu"))


@pytest.mark.parametrize("name,batch,residual,pdl", [("kda_b", 3, True, True), ("moe_router", 1, False, False)])
def test_proj_tiny_fp8(name, batch, residual, pdl):
    """e4m3 weights with one fp32 scale a row (the tiny preset's K = 64: one partial 512-column step, four lanes
    loading), against W_e4m3 * scale in fp64 through the checker; under pdl the weight's words before the wait."""
    c = PROJ.case(preset="tiny", proj=name, batch=batch, wdtype="fp8", residual=residual, prologue="none")
    checker.require(checker.check(PROJ, c, impl=impl(1, pdl=pdl), seed=batch, device="cpu"))


def test_group_tiny_fp8():
    """The MLA input group with fp8 weights: three outputs of one e4m3 weight, each row its own scale."""
    c = GROUP.case(preset="tiny", group="mla_in", batch=2, wdtype="fp8", select=False)
    checker.require(checker.check(GROUP, c, impl=impl(len(trunk_ops._parts(c)), pdl=True), seed=2, device="cpu"))


@pytest.mark.parametrize("K", [1024, 1040])
def test_fp8_full_and_partial_steps(K):
    """Two full 512-column fp8 steps (1024), and two plus a partial one (1040: lane 0 past the full steps loads);
    every e4m3 code value and both signs in the weight (codes drawn uniformly, NaNs 0x7F / 0xFF left out), a scale a
    row; exact products summed in fp32 against fp64."""
    g = torch.Generator().manual_seed(K)
    x = torch.randn(2, K, generator=g).to(torch.bfloat16)
    codes = torch.randint(0, 256, (6, K), generator=g, dtype=torch.int32)
    codes[(codes & 0x7F) == 0x7F] = 0x3F
    w = codes.to(torch.uint8).view(torch.float8_e4m3fn)
    sc = torch.rand(6, generator=g) + 0.5
    out = torch.full((2, 6), float("nan"), dtype=torch.float32)
    run_proj(x, w, [out], w_scale=sc)
    want = (x.double() @ w.double().T) * sc.double()
    assert (out.double() - want).abs().max() < 1e-5 * want.abs().max()


def test_group_tiny():
    """The MLA input group (q and kv down-projections and the gate: three outputs, one fp32 or bf16 each)."""
    c = GROUP.case(preset="tiny", group="mla_in", batch=2, wdtype="bf16", select=False)
    n = len(trunk_ops._parts(c))
    checker.require(checker.check(GROUP, c, impl=impl(n, pdl=True), seed=1, device="cpu"))
    assert emulate.LAST["launches"][-1]["use_pdl"] is True


@pytest.mark.parametrize("K", [512, 520, 4616])
def test_full_and_partial_steps(K):
    """Two full 256-column steps (512), and two plus a partial one (520: lanes 0 past the full steps load); an input
    longer than SHORT_K (4616: 18 full steps, the first PRE loaded ahead, the rest through the UNROLL-deep loop and
    its remainder, then the partial one)."""
    g = torch.Generator().manual_seed(K)
    x = torch.randn(2, K, generator=g).to(torch.bfloat16)
    w = (torch.randn(6, K, generator=g) / K ** 0.5).to(torch.bfloat16)
    out = torch.full((2, 6), float("nan"), dtype=torch.float32)
    run_proj(x, w, [out])
    want = x.double() @ w.double().T
    assert (out.double() - want).abs().max() < 1e-4 * want.abs().max()


def test_pdl_weight_before_the_wait():
    """Under pdl the first PRE steps of W load before griddepcontrol.wait (W is no kernel's output) and nothing else
    does: K = 1280 (five steps: PRE_SHORT preloaded, the rest in the loop) with a residual, checked against fp64; the
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
    with pytest.raises(ValueError, match="'w_scale' is taken with fp8 weights only"):
        run_proj(d["x"], d["w"], [d["y0"]], w_scale=torch.ones(d["w"].shape[0]))
    w8 = d["w"].to(torch.float8_e4m3fn)
    with pytest.raises(ValueError, match="'w_scale' must be a torch.Tensor"):
        run_proj(d["x"], w8, [d["y0"]])
    with pytest.raises(ValueError, match="'w_scale' must be a contiguous"):
        run_proj(d["x"], w8, [d["y0"]], w_scale=torch.ones(w8.shape[0] + 1))
    with pytest.raises(ValueError, match="'glu' is not taken with fp8 weights"):
        run_proj(d["x"], w8, [d["y0"]], w_scale=torch.ones(w8.shape[0]), glu=(4.0, 25.0))
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
    """The registry's `supports` (which `auto` and the benchmark consult): prologues, the fused selection above batch
    4 or with fp8 weights, and more than 16 rows are not the cute projection's."""
    from k3lab.ops.trunk import proj_supports

    assert proj_supports("cute", dict(batch=16, wdtype="bf16")) is None
    assert proj_supports("cute", dict(batch=1, wdtype="fp8")) is None
    assert "bf16 weights only" in proj_supports("cute", dict(batch=1, wdtype="fp8", select=True))
    assert "1..16" in proj_supports("cute", dict(batch=17))
    assert "prologue" in proj_supports("cute", dict(batch=1, prologue="rms"))
    assert proj_supports("cute", dict(batch=4, select=True)) is None
    assert "selection at batch <= 4" in proj_supports("cute", dict(batch=5, select=True))


def test_bench_skips_what_a_backend_does_not_take(monkeypatch):
    """The benchmark asks `supports` per case: a case with a prologue lists cute as skipped, with the reason, instead
    of timing a refusal; a bf16 case keeps it."""
    from k3lab.bench import runner

    monkeypatch.setattr(runner, "backend_status", lambda be: (True, ""))
    pro = PROJ.case(preset="tiny", proj="kda_q", batch=1, wdtype="bf16", residual=False, prologue="rms")
    impls, skipped = runner.implementations(PROJ, pro, ["cute"], peers=False, only={}, gpu=False)
    assert not impls and "prologue" in skipped["cute"]
    bf16 = PROJ.case(preset="tiny", proj="kda_q", batch=1, wdtype="bf16", residual=False, prologue="none")
    impls, skipped = runner.implementations(PROJ, bf16, ["cute"], peers=False, only={}, gpu=False)
    assert [i.name for i in impls] == ["cute"] and not skipped


# ---- the fused router selection (`select`) ----------------------------------------------------------------

@pytest.mark.parametrize("batch,pdl", [(1, True), (3, False)])
def test_group_select_tiny(batch, pdl):
    """The MoE input group with the router's selection fused (tiny: 16 experts, top 16): the checker against the
    fp64 oracle (logits, the other outputs, idx under the tie rule, weights)."""
    c = GROUP.case(preset="tiny", group="moe_in", batch=batch, wdtype="bf16", select=True)
    n = len(trunk_ops._parts(c))
    checker.require(checker.check(GROUP, c, impl=impl(n, pdl=pdl, select=True), seed=batch, device="cpu"))


def test_select_same_as_the_router_kernel():
    """E = 202 experts (51 router CTAs, the last one shared with the next output's rows), top 16, batch 2, pdl,
    beside 30 more rows: idx and weights equal to the stand-alone CuTe router on the logits the projection wrote,
    twice in a row (the arrival counter is zero again after a call), at two seeds of the CTA order."""
    from test_router_cute_emulated import run_router

    E, k, B, K = 202, 16, 2, 64
    for seed in (0, 1):
        g = torch.Generator().manual_seed(seed)
        x = torch.randn(B, K, generator=g).to(torch.bfloat16)
        w = (torch.randn(E + 30, K, generator=g) / K ** 0.25).to(torch.bfloat16)
        eb = torch.randn(E, generator=g) * 0.05
        lg = torch.full((B, E), float("nan"))
        y1 = torch.full((B, 30), float("nan"), dtype=torch.bfloat16)
        idx = torch.full((B, k), -7, dtype=torch.int64)
        wk = torch.full((B, k), float("nan"))
        run_proj(x, w, [lg, y1], pdl=True, seed=seed, select=(eb, idx, wk, 2.5))
        want = x.double() @ w.double().T
        assert (lg.double() - want[:, :E]).abs().max() < 1e-4 * want.abs().max()
        i2, w2 = torch.empty_like(idx), torch.empty_like(wk)
        run_router(lg.clone(), eb, i2, w2, top_k=k, scaling=2.5)
        assert torch.equal(idx, i2) and torch.equal(wk, w2)


def test_select_refused_by_name():
    c = GROUP.case(preset="tiny", group="moe_in", batch=1, wdtype="bf16", select=True)
    d = GROUP.make_inputs(c, 0, "cpu")
    outs = [d[f"y{i}"] for i in range(4)]
    sel = (d["e_bias"], d["idx"], d["weights"], 1.0)
    x5 = torch.zeros(5, 64, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="'select' is fused at batch <= 4"):
        run_proj(x5, d["w"], [torch.zeros(5, o.shape[1], dtype=o.dtype) for o in outs], select=sel)
    with pytest.raises(ValueError, match="'outs\\[0\\]' must be the router's fp32 logits"):
        run_proj(d["x"], d["w"], [outs[0].bfloat16()] + outs[1:], select=sel)
    with pytest.raises(ValueError, match="'select.idx'"):
        run_proj(d["x"], d["w"], outs, select=(d["e_bias"], d["idx"].int(), d["weights"], 1.0))
    with pytest.raises(ValueError, match="'residual' is not taken with select"):
        run_proj(d["x"], d["w"][:16], [outs[0]], residual=torch.zeros(1, 16, dtype=torch.bfloat16), select=sel)



# ---- the chained projection (`chain`: f = outs[0] w2^T, the KDA decay's second factor) --------------------------

@pytest.mark.parametrize("B,R,NF,pdl,seed", [(1, 16, 40, True, 0), (3, 8, 12, False, 1), (2, 24, 9, True, 2)])
def test_chain(B, R, NF, pdl, seed):
    """A group [fa | q | b] whose first output fa [B, R] feeds f = fa w2^T [B, NF] in the same launch (chain CTAs
    after the main grid spin on the count of fa's CTAs: the emulator reruns a spinning CTA after the others): every
    output against fp64 of the bf16 values the kernel wrote (f from the stored fa), twice (the counts are zero again),
    at several CTA orders."""
    for rep in range(2):
        g = torch.Generator().manual_seed(seed * 10 + rep)
        K = 96
        x = torch.randn(B, K, generator=g).to(torch.bfloat16)
        w = (torch.randn(R + 20 + 3, K, generator=g) / K ** 0.5).to(torch.bfloat16)
        w2 = (torch.randn(NF, R, generator=g) / R ** 0.5).to(torch.bfloat16)
        fa = torch.full((B, R), float("nan"), dtype=torch.bfloat16)
        q = torch.full((B, 20), float("nan"), dtype=torch.bfloat16)
        bb = torch.full((B, 3), float("nan"), dtype=torch.bfloat16)
        f = torch.full((B, NF), float("nan"), dtype=torch.bfloat16)
        run_proj(x, w, [fa, q, bb], pdl=pdl, seed=seed + rep, chain=(w2, f))
        want = x.double() @ w.double().T
        got = torch.cat([fa, q, bb], 1).double()
        assert (got - want).abs().max() < 1e-2 * want.abs().max()
        wf = fa.double() @ w2.double().T
        assert not f.isnan().any() and (f.double() - wf).abs().max() < 1e-2 * wf.abs().max()


def test_chain_refused_by_name():
    def z(*shape):
        return torch.zeros(*shape, dtype=torch.bfloat16)

    x, w = z(1, 64), z(24, 64)
    with pytest.raises(ValueError, match="'outs\\[0\\]' must be bf16"):
        run_proj(x, w, [z(1, 12), z(1, 12)], chain=(z(4, 12), z(1, 4)))
    with pytest.raises(ValueError, match="'chain.w2' must be"):
        run_proj(x, w, [z(1, 16), z(1, 8)], chain=(z(4, 8), z(1, 4)))
    with pytest.raises(ValueError, match="'chain.f' must be"):
        run_proj(x, w, [z(1, 16), z(1, 8)], chain=(z(4, 16), z(1, 5)))


# ---- the MoE output's glue inside the projections: the rms segment and the GLU output -------------------------

def _situ64(g, u, b1=4.0, b2=25.0):
    return b1 * torch.tanh(g / b1) * torch.sigmoid(g) * b2 * torch.tanh(u / b2)


@pytest.mark.parametrize("batch,pdl,k2", [(1, True, 264), (3, False, 512)])
def test_rms_scaled_segment(batch, pdl, k2):
    """out = [x0 rsqrt(sum_p ssp / K0 + eps) | x1] W^T + residual, K0 = 768 (three steps, within the four preloaded)
    and k2 = 264 (a partial last step) or 512, ssp 37 partials a row (two rounds of lanes, the second partial):
    against fp64 of the unrounded scaling (tolerance: fp32 sums and one bf16 output rounding, 1e-2)."""
    g = torch.Generator().manual_seed(batch)
    K0 = 768
    x = torch.randn(batch, K0 + k2, generator=g).to(torch.bfloat16)
    ssp = torch.rand(batch, 37, generator=g) * 40
    w = (torch.randn(8, K0 + k2, generator=g) / (K0 + k2) ** 0.5).to(torch.bfloat16)
    r = torch.randn(batch, 8, generator=g).to(torch.bfloat16)
    out = torch.full((batch, 8), float("nan"), dtype=torch.bfloat16)
    run_proj(x, w, [out], residual=r, pdl=pdl, rmsp=(ssp, K0, 1e-6))
    inv = torch.rsqrt(ssp.double().sum(1, keepdim=True) / K0 + 1e-6)
    xd = x.double()
    want = torch.cat([xd[:, :K0] * inv, xd[:, K0:]], 1) @ w.double().T + r.double()
    assert (out.double() - want).abs().max() < 1e-2 * want.abs().max()


@pytest.mark.parametrize("batch", [1, 2])
def test_glu_output(batch):
    """A group [logits fp32 (4 rows) | z (4 rows) | situ(g, u) (6 pairs: W's last 12 rows [g | u], three CTAs of
    g_i, g_i+1, u_i, u_i+1)]: g and u rounded to bf16 as the stand-alone glue reads them, situ in fp32."""
    g = torch.Generator().manual_seed(10 + batch)
    K = 520
    x = torch.randn(batch, K, generator=g).to(torch.bfloat16)
    w = (torch.randn(20, K, generator=g) / K ** 0.5 * 3).to(torch.bfloat16)
    outs = [torch.full((batch, 4), float("nan")), torch.full((batch, 4), float("nan"), dtype=torch.bfloat16),
            torch.full((batch, 6), float("nan"), dtype=torch.bfloat16)]
    run_proj(x, w, outs, pdl=True, glu=(4.0, 25.0))
    full = x.double() @ w.double().T
    assert (outs[0].double() - full[:, :4]).abs().max() < 1e-4 * full.abs().max()
    assert (outs[1].double() - full[:, 4:8]).abs().max() < 1e-2 * full.abs().max()
    gu = full[:, 8:].to(torch.bfloat16).double()
    want = _situ64(gu[:, :6], gu[:, 6:])
    assert (outs[2].double() - want).abs().max() < 1e-2 * want.abs().max()


def test_glue_refused_by_name():
    x = torch.zeros(1, 512, dtype=torch.bfloat16)
    w = torch.zeros(8, 512, dtype=torch.bfloat16)
    o = torch.zeros(1, 8, dtype=torch.bfloat16)
    ssp = torch.zeros(1, 5)
    with pytest.raises(ValueError, match="'rmsp.k0' must be a multiple of 256"):
        run_proj(x, w, [o], rmsp=(ssp, 200, 1e-6))
    with pytest.raises(ValueError, match="'rmsp.eps' must be a positive"):
        run_proj(x, w, [o], rmsp=(ssp, 256, 0.0))
    with pytest.raises(ValueError, match="'rmsp.ssp' must be a contiguous fp32"):
        run_proj(x, w, [o], rmsp=(torch.zeros(2, 5), 256, 1e-6))
    with pytest.raises(ValueError, match="GLU output's rows must start"):
        run_proj(x, w, [torch.zeros(1, 2), torch.zeros(1, 3, dtype=torch.bfloat16)], glu=(4.0, 25.0))
    with pytest.raises(ValueError, match="'glu' must be None or"):
        run_proj(x, w, [torch.zeros(1, 4, dtype=torch.bfloat16)], glu=(4.0,))


def test_bench_times_the_pdl_variants_where_auto_runs_another_backend(monkeypatch):
    """The registry's variants triton_pdl / cute_pdl: triton at the auto rule's options (auto runs triton at batch
    2 with bf16 weights), cute at the kernel's own choices beside its plain row (the step's `proj_cute` switch runs
    it), both only on a GPU; at batch 1 (the tiny preset's short inputs: auto runs cute) the other way round."""
    from k3lab.bench import runner

    monkeypatch.setattr(runner, "backend_status", lambda be: (True, ""))
    one = PROJ.case(preset="tiny", proj="kda_q", batch=1, wdtype="bf16", residual=False, prologue="none")
    impls, _ = runner.implementations(PROJ, one, ["triton", "cute"], peers=False, only={}, variants=PROJ.variants,
                                      gpu=True)
    by = {i.name: i for i in impls}
    assert "auto rule" in by["cute_pdl"].note and "own choices" in by["triton_pdl"].note
    c = PROJ.case(preset="tiny", proj="kda_q", batch=2, wdtype="bf16", residual=False, prologue="none")
    impls, _ = runner.implementations(PROJ, c, ["triton", "cute"], peers=False, only={}, variants=PROJ.variants,
                                      gpu=True)
    by = {i.name: i for i in impls}
    assert set(by) == {"triton", "cute", "triton_pdl", "cute_pdl"}
    assert by["cute_pdl"].options == {"pdl": True} and "own choices" in by["cute_pdl"].note
    assert by["triton_pdl"].options["pdl"] is True and "auto rule" in by["triton_pdl"].note
    assert by["cute_pdl"].min_sets == 2
    impls, _ = runner.implementations(PROJ, c, ["triton", "cute"], peers=False, only={}, variants=PROJ.variants,
                                      gpu=False)
    assert {i.name for i in impls} == {"triton", "cute"}
