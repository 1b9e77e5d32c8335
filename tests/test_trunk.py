"""Trunk kernels (projections and fused groups, router top-k, AttnRes + RMSNorm) through the shared checker
(k3lab.harness.checker: fp64 reference, outputs NaN-poisoned, inputs unchanged) at every dtype and switch
value the kernels claim, small shapes (the tiny preset's projections; batch 1 and odd batches; the split-K
GEMV at batch <= 16 and the tiled path above). Without a GPU they run under TRITON_INTERPRET=1
(tests/conftest.py). The GPU tests (marked gpu) run every TP8 and TP16 per-GPU projection shape.
Tolerances and their reasons: k3lab.ops.trunk."""
from __future__ import annotations

import pytest
import torch

from k3lab import registry
from k3lab.components import attnres, glue, trunk
from k3lab.components.trunk import TrunkArgumentError
from k3lab.harness import checker
from k3lab.harness.numerics import rel_norm_error
from k3lab.ops import trunk as ops
from k3lab.ref.router import RouterWeights
from k3lab.switches import BackendUnavailable, SwitchError

PROJ = registry.get("proj")
GROUP = registry.get("proj_group")
ROUTER = registry.get("router_topk")
ATT = registry.get("attnres_norm")


def _check(op, backend="triton", options=None, seed=0, **shape):
    res = checker.require(checker.check(op, op.case(**shape), backend=backend, options=options or {}, seed=seed))
    assert res.ran and res.ran[-1].backend == backend
    return res


# the device the tests that build their own inputs use: the GPU where there is one (the kernels' own path), else the
# CPU under TRITON_INTERPRET=1 (tests/conftest.py)
DEV = "cuda" if torch.cuda.is_available() else "cpu"


# ---- projections ---------------------------------------------------------------------------------------

@pytest.mark.parametrize("name", ops.NAMES)
def test_proj_every_projection_bf16_batch1(name):
    _check(PROJ, options=dict(path="dot"), preset="tiny", proj=name, batch=1, wdtype="bf16")


@pytest.mark.parametrize("name,path", [("kda_b", "rows"), ("mla_uq", "dot")])
def test_proj_default_path_by_shape(name, path):
    """path None: rows at batch 1 for <= 64 outputs (tiny kda_b: 4), tma for bf16 weights with >= 1024 outputs,
    dot otherwise (tiny mla_uq: 96; fp8; misaligned)."""
    from k3lab_kernels.triton.proj_gemv import config

    N, K = ops.proj_shapes("tiny")[name]
    cpu = torch.device("cpu")
    assert config(1, N, K, cpu)["path"] == path
    assert config(1, 1536, 7168, cpu)["path"] == config(64, 7168, 1536, cpu)["path"] == "tma"
    assert config(1, 1536, 7168, cpu, fp8=True)["path"] == config(1, 1536, 7168, cpu, tma=False)["path"] == "dot"
    assert config(2, 12, 7168, cpu)["path"] == "dot"
    assert config(1, 1536, 7168, cpu, num_stages=8)["num_stages"] == 8  # 8 x 20 KB fits; more is capped
    assert config(40, 7168, 1536, cpu, block_n=128, num_stages=8)["num_stages"] == 4
    _check(PROJ, preset="tiny", proj=name, batch=1, wdtype="bf16")


@pytest.mark.parametrize("name", ["kda_b", "kda_fb", "mla_dkv", "moe_router", "kda_o"])
@pytest.mark.parametrize("batch", [1, 5])
def test_proj_fp8_against_dequantized(name, batch):
    """e4m3 weights with one fp32 scale per output channel, against W_fp8 * scale in fp64."""
    _check(PROJ, preset="tiny", proj=name, batch=batch, wdtype="fp8")


@pytest.mark.parametrize("batch,residual", [(1, False), (5, True)])
def test_proj_fp8_on_f16_mmas(batch, residual):
    """Option f16: the e4m3 weights and x on f16 MMAs (x rounded to f16, exact for normal-range inputs)."""
    _check(PROJ, options=dict(f16=True, path="dot"), preset="tiny", proj="kda_o", batch=batch, wdtype="fp8",
           residual=residual)
    with pytest.raises(ValueError, match="'f16' must be one of"):
        _check(PROJ, options=dict(f16=1), preset="tiny", proj="kda_o", batch=batch, wdtype="fp8")
    with pytest.raises(ValueError, match="f16=True applies to fp8 weights on path 'dot'"):  # never silently ignored
        _check(PROJ, options=dict(f16=True), preset="tiny", proj="kda_o", batch=batch, wdtype="bf16")


@pytest.mark.parametrize("batch", [3, 16, 17, 40, 130])
@pytest.mark.parametrize("wdtype", ["bf16", "fp8"])
def test_proj_batches_small_and_tiled(batch, wdtype):
    """Odd batches of the split-K GEMV (<= 16: one 16-row tile) and of the tiled path (17..256)."""
    _check(PROJ, preset="tiny", proj="mla_uq", batch=batch, wdtype=wdtype)


@pytest.mark.parametrize("batch", [33, 40, 130])
@pytest.mark.parametrize("wdtype", ["bf16", "fp8"])
def test_proj_partials_summed_by_a_second_kernel(batch, wdtype):
    """From a batch tile of 64 a split-K tile's partials are summed by _proj_sum_kernel (reduce 'kernel'): odd
    batches, fp8 scales and the residual through the checker; the sum is the last program's, bit for bit (the same
    split order)."""
    from k3lab_kernels.triton import proj_gemv as pg

    for name in ("kda_q", "moe_up_shared"):  # K 64 / 96 in 32-column chunks: two / three K ranges
        _check(PROJ, options=dict(split_k=3, block_k=32), preset="tiny", proj=name, batch=batch, wdtype=wdtype)
    _check(PROJ, options=dict(split_k=2, block_k=32), preset="tiny", proj="kda_o", batch=batch, wdtype=wdtype,
           residual=True)
    _check(PROJ, options=dict(split_k=2, block_k=32, reduce="last"), preset="tiny", proj="kda_q", batch=batch,
           wdtype=wdtype)
    _check(GROUP, options=dict(split_k=2, block_k=32), preset="tiny", group="kda_in", batch=batch, wdtype=wdtype)
    # few outputs (the KDA beta's 4 here): 16-row W tiles, the summing kernel's [4, 1] tiles on one warp
    _check(PROJ, options=dict(split_k=2, block_k=32, block_n=16), preset="tiny", proj="kda_b", batch=batch,
           wdtype=wdtype)
    assert pg.sum_tiles(64, 12, 132) == (16, 1, 1) and pg.sum_tiles(64, 896, 132) == (32, 16, 4)
    assert pg.config(batch, 64, 64, torch.device("cpu"), split_k=2, block_k=32, fp8=wdtype == "fp8")["RED"] == (
        batch > 32)
    torch.manual_seed(batch)
    x, w = torch.randn(batch, 256).bfloat16(), (torch.randn(96, 256) / 16).bfloat16()
    outs = {}
    for red in ("kernel", "last"):
        o = torch.full((batch, 96), float("nan")).bfloat16()
        pg.proj(x, w, [o], path="dot", split_k=4, reduce=red)
        outs[red] = o
    assert pg.config(batch, 96, 256, torch.device("cpu"), path="dot", split_k=4)["RED"] == (batch > 32)
    assert torch.equal(outs["kernel"], outs["last"])
    with pytest.raises(ValueError, match="reduce must be one of"):
        pg.proj(x, w, [outs["last"]], path="dot", split_k=4, reduce="atomic")
    with pytest.raises(ValueError, match="not 'rows'"):
        pg.proj(x[:2], w, [outs["last"][:2]], path="rows", reduce="kernel")
    ran: list = []  # the record says what ran: the K ranges and who summed them
    trunk.proj(x, w, backend="triton", ran=ran, path="dot", split_k=4)
    assert "2 K ranges" in ran[-1].notes  # K 256 in 128-column chunks: split_k 4 capped at 2
    assert ("second kernel" in ran[-1].notes) == (batch > 32), ran[-1].notes


def test_proj_fp8_tiles_rule():
    """fp8 weights: 32-row W tiles at batch <= 16 (bf16 and fp8 alike; split-K as before); at batch 17..32 over inputs
    of at most FP8_SHORT_K, 64-row tiles in one K range where they give half the SMs a program, 16-row tiles where
    they would not (inputs of at least FP8_NARROW_MIN_K); batch 64 and longer inputs keep 32-row tiles."""
    from k3lab_kernels.triton import proj_gemv as pg

    cpu = torch.device("cpu")
    for b in (1, 8, 16):
        for k in (1536, 768, 384):
            c = pg.config(b, 7168, k, cpu, fp8=True)
            assert (c["path"], c["BN"], c["SPLIT"]) == ("dot", 32, 1), (b, k, c)
        assert pg.config(b, 7168, 3584, cpu, fp8=True)["BN"] == 32
        assert pg.config(b, 1536, 7168, cpu, fp8=True)["SPLIT"] > 1  # a long input still splits
        # fp8 over K = 7168: up to FP8_MORE programs an SM, each K range >= FP8_MIN_CHUNKS chunks (fp8_split_small)
        assert pg.config(b, 1536, 7168, cpu, fp8=True)["SPLIT"] == 8 and pg.config(b, 1536, 7168, cpu)["SPLIT"] == 5
        assert pg.config(b, 3584, 7168, cpu, fp8=True)["SPLIT"] == 4
        assert pg.config(b, 576, 7168, cpu, fp8=True)["SPLIT"] == 14  # the one-wave rule already splits more
        assert pg.config(b, 7168, 3584, cpu, fp8=True)["SPLIT"] == 1  # shorter inputs: the one-wave rule
    for b in (17, 32):
        c = pg.config(b, 7168, 1536, cpu, fp8=True)
        assert (c["BN"], c["SPLIT"]) == (64, 1), (b, c)
        assert pg.config(b, 7168, 1536, cpu, fp8=True, split_k=2)["SPLIT"] == 2  # the knob still overrides
        assert pg.config(b, 1536, 7168, cpu, fp8=True)["BN"] == 32  # a long input: 32-row tiles
        assert pg.config(b, 2304, 1536, cpu, fp8=True)["BN"] == 16  # mla_uq: 36 tiles of 64 would leave SMs idle:
        assert pg.config(b, 1152, 1536, cpu, fp8=True)["BN"] == 16  # 16-row tiles (FP8_NARROW_MIN_K)
        assert pg.config(b, 1536, 128, cpu, fp8=True)["BN"] == 16  # kda_fb's 128-long input too (fp8_b32_rule)
        assert pg.config(b, 1536, 64, cpu, fp8=True)["BN"] == 32  # shorter than FP8_NARROW_MIN_K: 32 rows
        assert pg.config(b, 7168, 1536, cpu, tma=False)["BN"] == 32  # bf16 on the dot path: 32-row tiles
    assert pg.config(64, 7168, 1536, cpu, fp8=True)["BN"] == 32
    assert pg.config(8, 7168, 1536, cpu, fp8=True, block_n=64)["BN"] == 64  # the knob still overrides
    # from batch 33 (a batch tile of 64) over inputs longer than FP8_SHORT_K with >= TMA_MIN_N outputs: path tma
    for b, n, k, path in ((33, 3584, 7168, "tma"), (64, 1536, 7168, "tma"), (128, 7168, 3584, "tma"),
                          (32, 3584, 7168, "dot"), (64, 768, 7168, "dot"), (64, 7168, 1536, "dot"),
                          (64, 896, 7168, "dot"), (65, 7168, 1536, "tma"), (128, 768, 7168, "tma"),
                          (128, 576, 7168, "dot")):
        assert pg.config(b, n, k, cpu, fp8=True)["path"] == path, (b, n, k)
    assert pg.config(64, 3584, 7168, cpu, fp8=True, tma=False)["path"] == "dot"  # misaligned: pointers


@pytest.mark.parametrize("batch", [1, 3, 20])
def test_proj_fp8_tiles_run(batch, monkeypatch):
    """The rule's tiles, run: 32-row W tiles in one K range at batch 1 / 3 (a GPU of one SM, so the tiny kda_o does
    not split K; path dot: at batch 1 its few outputs would take the rows path), 64-row tiles at batch 20."""
    from k3lab_kernels.triton import proj_gemv as pg

    monkeypatch.setattr(pg, "sm_count", lambda device: 1)
    res = _check(PROJ, options=dict(path="dot"), preset="tiny", proj="kda_o", batch=batch, wdtype="fp8")
    rows = 64 if batch > pg.SMALL_BATCH else 32
    assert f"tiles {rows} W rows" in res.ran[-1].notes and "1 K range" in res.ran[-1].notes, res.ran[-1].notes


@pytest.mark.parametrize("batch", [33, 40])
def test_proj_fp8_tma_run(batch):
    """fp8 weights on the tma path (the rule's choice from batch 33 over long inputs), forced at the tiny shapes:
    checked by the shared checker against the dequantized fp64 reference, odd batches past the 64-row tile."""
    res = _check(PROJ, options=dict(path="tma"), preset="tiny", proj="kda_q", batch=batch, wdtype="fp8")
    assert "path tma" in res.ran[-1].notes, res.ran[-1].notes


def test_proj_few_outputs_rule():
    """Few outputs (the KDA beta): 16-row W tiles; the second kernel sums from batch 2 wherever at most RED_MAX_TILES
    output tiles split K; the rows path's whole K a chunk at batch 1; odd batches on a K that splits."""
    from k3lab_kernels.triton import proj_gemv as pg

    cpu = torch.device("cpu")
    c64, c8 = (pg.config(b, 12, 7168, cpu) for b in (64, 8))
    assert (c64["path"], c64["BN"], c64["BK"], c64["SPLIT"], c64["RED"]) == ("dot", 16, 128, 56, True)
    assert c8["RED"] and c8["BN"] == 16 and not pg.config(1, 576, 7168, cpu)["RED"]
    assert pg.config(8, 576, 7168, cpu)["RED"] and not pg.config(8, 3584, 7168, cpu)["RED"]  # 18 / 56 tiles
    assert pg.config(1, 12, 7168, cpu)["BK"] == 8192 and pg.config(1, 96, 7168, cpu, path="rows")["BK"] == 2048
    assert pg.config(64, 17, 7168, cpu)["BN"] == 64  # past FEW_N: the wide tiles
    torch.manual_seed(0)
    for batch in (1, 3, 33):
        x, w = torch.randn(batch, 320).bfloat16(), (torch.randn(12, 320) / 16).bfloat16()
        o = torch.full((batch, 12), float("nan")).bfloat16()
        pg.proj(x, w, [o])
        ref = (x.double() @ w.double().T).float()
        assert torch.allclose(o.float(), ref, rtol=1e-2, atol=1e-2), (batch, (o.float() - ref).abs().max())


@pytest.mark.parametrize("batch,wdtype", [(1, "bf16"), (3, "fp8"), (8, "bf16")])
def test_proj_rows_path(batch, wdtype):
    """The register GEMV (no split-K), batch padded to a power of two, K not a multiple of the chunk."""
    _check(PROJ, options=dict(path="rows", block_n=16), preset="tiny", proj="kda_fb", batch=batch, wdtype=wdtype)
    _check(PROJ, options=dict(path="rows", block_n=2, block_k=64), preset="tiny", proj="mla_dkv", batch=batch,
           wdtype=wdtype)


@pytest.mark.parametrize("group", list(ops.GROUPS))
def test_group_rows_path(group):
    _check(GROUP, options=dict(path="rows", block_n=32), preset="tiny", group=group, batch=3, wdtype="fp8")


@pytest.mark.parametrize("name", ["kda_o", "mla_o"])
@pytest.mark.parametrize("wdtype", ["bf16", "fp8"])
def test_proj_residual_epilogue(name, wdtype):
    _check(PROJ, preset="tiny", proj=name, batch=3, wdtype=wdtype, residual=True)
    _check(PROJ, options=dict(path="rows", block_n=16), preset="tiny", proj=name, batch=3, wdtype=wdtype,
           residual=True)


@pytest.mark.parametrize("name,pro,wdtype,batch", [("shared_w2", "situ", "bf16", 1), ("shared_w2", "situ", "fp8", 5),
                                                ("moe_up", "rms", "bf16", 3), ("mla_uq", "rms", "fp8", 1),
                                                ("moe_up_shared", "rms+situ", "bf16", 2),
                                                ("moe_up_shared", "rms+situ", "fp8", 1),
                                                ("moe_up_shared", "rms+situ", "bf16", 40),
                                                ("shared_w2", "situ", "bf16", 33)])
def test_proj_input_prologue(name, pro, wdtype, batch):
    """The op before the projection in its launch: SiTU of [g | u] (shared w2, with the residual epilogue) and
    RMSNorm of fp32 (routed norm) or bf16 (q_norm) rows, against the fp64 oracle; and equal to the unfused path
    (the op alone, fp32 maths rounded once to bf16 as the stand-alone kernels round, then the projection) up to
    the bf16 rounding of the output. (The glue kernels themselves are compared on the GPU: under the interpreter
    Triton's bf16 cast truncates, and the glue reference rounds after every torch op.)"""
    res = name != "mla_uq"
    _check(PROJ, preset="tiny", proj=name, batch=batch, wdtype=wdtype, prologue=pro, residual=res)
    if batch > 32:  # the partials summed by the second kernel (reduce "kernel"), with the prologue and the residual
        _check(PROJ, options=dict(split_k=2, block_k=32), preset="tiny", proj=name, batch=batch, wdtype=wdtype,
               prologue=pro, residual=res)
    case = PROJ.case(preset="tiny", proj=name, batch=batch, wdtype=wdtype, prologue=pro, residual=res)
    d = PROJ.make_inputs(case, 1, DEV)
    p, sec = ops.prologue_of(d, case), ops.second_of(d, case)
    fused = trunk.proj(d["x"], d["w"], w_scale=ops._scale(d), residual=d.get("residual"), prologue=p, **sec,
                       backend="triton")
    a = trunk._prologue_ref(d["x"], p)
    if sec:  # the two segments' inputs side by side
        a = torch.cat([a, trunk._prologue_ref(sec["x2"], sec["prologue2"])], 1)
    two = trunk.proj(a, d["w"], w_scale=ops._scale(d), residual=d.get("residual"), backend="triton")
    assert rel_norm_error(fused, two) < 4e-3


def test_proj_rms_prologue_rows_in_several_round_trips():
    """The rms prologue's pre-pass loads RR whole rows a round trip (8192 values): 1024-wide rows take 8 a trip, so
    a batch of 11 takes two trips (the second partial), against the reference."""
    g = torch.Generator().manual_seed(5)
    x = torch.randn(11, 1024, generator=g) * 2
    w = (torch.randn(48, 1024, generator=g) * 0.03).bfloat16()
    nw = (1 + 0.2 * torch.randn(1024, generator=g)).bfloat16()
    pro = ("rms", nw.to(DEV), 1e-6)
    got = trunk.proj(x.to(DEV), w.to(DEV), prologue=pro, backend="triton").cpu()
    want = trunk.proj(x.double(), w, torch.empty(11, 48, dtype=torch.float64),
                      prologue=("rms", nw.double(), 1e-6))
    assert rel_norm_error(got, want) < 4e-3


@pytest.mark.parametrize("batch", [1, 3])
def test_proj_rmsp_prologue_and_glu_output(batch):
    """The MoE output with its glue folded (k3lab.step.moe_glue_fold): x = [bf16(y gamma) | a] whose first 32 columns
    are scaled by rsqrt(sum of 7 partial sums of squares / 32 + eps) (the "rmsp" prologue), with the residual: the
    reference backend against the fp64 oracle (the cute kernel's twins: tests/test_proj_cute_emulated.py and, on the
    GPU, tests/test_proj_cute.py); the group's GLU output on the reference backend against situ of its rounded rows;
    what triton refuses by name."""
    g = torch.Generator().manual_seed(batch)
    y = torch.randn(batch, 32, generator=g) * 3
    nw = (1 + 0.2 * torch.randn(32, generator=g)).bfloat16()
    x2 = torch.randn(batch, 16, generator=g).bfloat16()
    x = torch.cat([(y * nw.float()).bfloat16(), x2], 1)
    ssp = (y * y).view(batch, 8, 4).sum(2)[:, :7].contiguous()  # any partition of the sum: seven partials here
    ssp[:, 0] += (y * y).view(batch, 8, 4).sum(2)[:, 7]
    w = (torch.randn(24, 48, generator=g) * 0.1).bfloat16()
    r = torch.randn(batch, 24, generator=g).bfloat16()
    pro = ("rmsp", ssp.to(DEV), 32, 1e-6)
    got = trunk.proj(x, w, residual=r, prologue=("rmsp", ssp, 32, 1e-6))
    with pytest.raises(TrunkArgumentError, match="'prologue'.*cute backend"):
        trunk.proj(x.to(DEV), w.to(DEV), residual=r.to(DEV), prologue=pro, backend="triton")
    want = trunk.proj(x.double(), w, torch.empty(batch, 24, dtype=torch.float64), residual=r.double(),
                      prologue=("rmsp", ssp.double(), 32, 1e-6))
    yn = y.double() * torch.rsqrt(y.double().pow(2).mean(1, keepdim=True) + 1e-6) * nw.double()
    assert rel_norm_error(want, torch.cat([yn, x2.double()], 1) @ w.double().T + r.double()) < 1e-2
    assert rel_norm_error(got, want) < 4e-3
    with pytest.raises(TrunkArgumentError, match="'prologue'"):
        trunk.proj(x, w, prologue=("rmsp", ssp, 49, 1e-6))
    with pytest.raises(TrunkArgumentError, match="'prologue'"):
        trunk.proj(x, w, prologue=("rmsp", ssp[:1], 32, 1e-6)) if batch > 1 else trunk.proj(
            x, w, prologue=("rmsp", ssp, 32, 0.0))
    outs = [torch.empty(batch, 8), torch.empty(batch, 8, dtype=torch.bfloat16)]
    trunk.proj_group(x2, w[:24, :16].contiguous(), outs, glu=(4.0, 25.0))
    full = (x2.float() @ w[:24, :16].float().T)
    gu = full[:, 8:].bfloat16().float()
    from k3lab.ref.situ import situ

    assert rel_norm_error(outs[1].float(), situ(gu[:, :8], gu[:, 8:])) < 1e-2
    with pytest.raises(TrunkArgumentError, match="'glu'"):
        trunk.proj_group(x2.to(DEV), w[:24, :16].contiguous().to(DEV), [o.to(DEV) for o in outs], glu=(4.0, 25.0),
                         backend="triton")
    with pytest.raises(TrunkArgumentError, match="widths must add up"):
        trunk.proj_group(x2, w[:24, :16].contiguous(), [outs[0], outs[1][:, :4]], glu=(4.0, 25.0))


@pytest.mark.parametrize("kw,name", [
    (dict(prologue=("gelu", 1.0, 2.0)), "'prologue'"),
    (dict(prologue=("situ", 4.0, -1.0)), "'prologue'"),
    (dict(prologue=("rms", torch.ones(7), 1e-6)), "'prologue'"),
    (dict(prologue=("rms", torch.ones(24, dtype=torch.bfloat16), 0.0)), "'prologue'"),
    (dict(prologue=("situ", 4.0, 25.0)), "'x'"),
    (dict(prologue=("situ", 4.0, 25.0), path="rows", xw=(2, 48)), "'path'"),
    (dict(prologue2=("situ", 4.0, 25.0)), "'x2'"),
    (dict(prologue=("rms", torch.ones(16), 1e-6), x2=torch.randn(2, 32).bfloat16(), prologue2=("situ", 4.0, 25.0),
          xw=(2, 16)), "'w'"),
    (dict(prologue=("situ", 4.0, 25.0), x2=torch.randn(2, 16).bfloat16(), prologue2=("situ", 4.0, 25.0),
          xw=(2, 16)), "'prologue2'"),
    (dict(prologue=("rms", torch.ones(8), 1e-6), x2=torch.randn(2, 32).bfloat16(), prologue2=("situ", 4.0, 25.0),
          xw=(2, 8)), "'x'"),
], ids=lambda v: v if isinstance(v, str) else "")
def test_proj_prologue_argument_errors(kw, name):
    kw = dict(kw)
    x = torch.randn(*kw.pop("xw", (2, 24))).bfloat16()
    w = torch.randn(16, 24).bfloat16()
    with pytest.raises(TrunkArgumentError, match=name):
        trunk.proj(x, w, backend="triton", **kw)


@pytest.mark.parametrize("options", [dict(split_k=1), dict(split_k=4, block_k=64), dict(block_n=16, num_warps=2),
                                     dict(block_n=64, block_k=128, num_stages=2)])
def test_proj_kernel_options(options):
    _check(PROJ, options=options, preset="tiny", proj="moe_down", batch=2)


def test_proj_pdl_knob():
    """Option pdl (the decode step's chain, as one knob of a call): under the interpreter there is no griddepcontrol,
    so the launch is plain and the results are the checker's; a non-bool, or pdl on a backend without a kernel
    launch, is refused by name; the bench times it as rows triton_pdl / cute_pdl (registry variants)."""
    _check(PROJ, options=dict(pdl=True), preset="tiny", proj="kda_o", batch=2, wdtype="bf16", residual=True)
    _check(GROUP, options=dict(pdl=False), preset="tiny", group="kda_in", batch=1, wdtype="fp8")
    x, w = torch.randn(2, 24).bfloat16(), torch.randn(16, 24).bfloat16()
    with pytest.raises(ValueError, match="'pdl' must be one of"):
        trunk.proj(x, w, backend="triton", pdl=1)
    with pytest.raises(ValueError, match="'pdl' is a cute/triton kernel option"):
        trunk.proj(x, w, backend="reference", pdl=True)
    assert PROJ.variants == GROUP.variants == {"triton_pdl": ("triton", {"pdl": True}),
                                               "cute_pdl": ("cute", {"pdl": True})}


def test_proj_beyond_256_rows():
    """A verify step's token count (64 sequences x 8 positions = 512 at K3's largest studied shape): the batch
    tiles over the grid (BM 128, several row tiles), with and without the residual, against fp64; past
    MAX_BATCH the op's `supports` refuses triton so that `auto` passes over it (a named triton is refused by
    the call's argument check, test_argument_errors)."""
    _check(PROJ, preset="tiny", proj="mla_uq", batch=300, wdtype="bf16")
    _check(PROJ, preset="tiny", proj="kda_o", batch=260, wdtype="fp8", residual=True)
    _check(GROUP, preset="tiny", group="moe_in", batch=270, wdtype="bf16")
    from k3lab.components.trunk import MAX_BATCH

    assert MAX_BATCH >= 512 and PROJ.supports("triton", {"batch": MAX_BATCH}) is None
    assert "rows" in PROJ.supports("triton", {"batch": MAX_BATCH + 1})
    assert GROUP.supports("triton", {"batch": MAX_BATCH + 1}) and GROUP.supports("reference", {"batch": 10**6}) is None


def test_proj_split_k_at_tp16_shape():
    """A real per-GPU shape (TP16 beta: 6 x 7168) at batch 1: 6 rows in one 32-row tile, K split 14 ways."""
    _check(PROJ, preset="tp16", proj="kda_b", batch=1, wdtype="fp8")


# ---- groups --------------------------------------------------------------------------------------------

@pytest.mark.parametrize("group", list(ops.GROUPS))
@pytest.mark.parametrize("batch,wdtype", [(1, "bf16"), (5, "fp8"), (20, "bf16")])
def test_group(group, wdtype, batch):
    _check(GROUP, preset="tiny", group=group, batch=batch, wdtype=wdtype)


@pytest.mark.parametrize("group", list(ops.GROUPS))
def test_group_equals_parts_and_writes_where_consumers_read(group):
    """The fused launch against the same projections run one by one (our kernel, the part's rows of the
    weight), and outputs that are column slices of one wider buffer (a consumer's layout)."""
    case = GROUP.case(preset="tiny", group=group, batch=3, wdtype="bf16")
    d = GROUP.make_inputs(case, 0, DEV)
    parts = ops.GROUPS[group]
    sizes = [ops.proj_shapes("tiny")[p][0] for p in parts]
    wide = torch.full((3, sum(sizes) + 7), float("nan"), dtype=torch.bfloat16, device=DEV)
    outs, a = [], 0
    for n in sizes:
        outs.append(wide[:, a:a + n])
        a += n
    for i, p in enumerate(parts):  # the router's logits stay fp32
        if p in ops.FP32_OUT:
            outs[i] = torch.empty(3, sizes[i], dtype=torch.float32, device=DEV)
    ran = []
    trunk.proj_group(d["x"], d["w"], outs, backend="triton", ran=ran)
    assert ran[-1].op == "proj_group" and ran[-1].shape["outputs"] == len(parts)
    assert torch.isnan(wide[:, a:].float()).all()
    for w, o in zip(d["w"].split(sizes), outs):
        one = trunk.proj(d["x"], w, torch.empty_like(o), backend="triton")
        assert rel_norm_error(o, one) < 4e-3 and not torch.isnan(o.float()).any()


@pytest.mark.parametrize("batch,wdtype,options", [(1, "bf16", {}), (5, "fp8", {}), (16, "bf16", dict(split_k=3))])
def test_group_fused_router_selection(batch, wdtype, options):
    """The MoE input group with the router's top-k in its launch: against the fp64 oracle (logits, ids in order,
    weights), and ids/weights bit-equal to the stand-alone router_topk run on the kernel's own logits."""
    res = _check(GROUP, options=options, preset="tiny", group="moe_in", batch=batch, wdtype=wdtype, select=True)
    assert res.ran[-1].shape["select"] == ops.SELECT_K
    case = GROUP.case(preset="tiny", group="moe_in", batch=batch, wdtype=wdtype, select=True)
    d = GROUP.make_inputs(case, 4, DEV)
    ops.call_group(d, case, "triton", dict(options))
    i2, w2 = trunk.router_topk(d["y0"], d["e_bias"], top_k=ops.SELECT_K, backend="triton")
    assert torch.equal(d["idx"], i2) and torch.equal(d["weights"], w2)


def test_group_select_argument_errors():
    case = GROUP.case(preset="tiny", group="moe_in", batch=17, wdtype="bf16", select=False)
    d = GROUP.make_inputs(case, 0, DEV)
    outs = [d[f"y{i}"] for i in range(4)]
    E = outs[0].shape[1]
    good = dict(e_bias=torch.zeros(E, device=DEV), idx=torch.empty(17, 16, dtype=torch.int64, device=DEV),
                weights=torch.empty(17, 16, device=DEV))
    for kw, name in ((dict(e_bias=torch.zeros(E - 1, device=DEV)), "'select.e_bias'"),
                     (dict(idx=torch.empty(17, 16, dtype=torch.int32, device=DEV)), "'select.idx'"),
                     (dict(weights=torch.empty(17, 8, device=DEV)), "'select.weights'"), ({}, "'select'")):
        with pytest.raises(TrunkArgumentError, match=name):  # ({}: batch 17 is above the fused selection's 16)
            trunk.proj_group(d["x"], d["w"], outs, select=trunk.Select(**{**good, **kw}), backend="triton")
    with pytest.raises(TrunkArgumentError, match="'outs\\[0\\]'"):
        trunk.proj_group(d["x"], d["w"], outs[1:] + outs[:1], select=trunk.Select(**good), backend="triton")


@pytest.mark.parametrize("wdtype", [torch.bfloat16, torch.float8_e4m3fn])
@pytest.mark.parametrize("budget", [40 * 8 * 128, 2 * 40 * 8 * 128, 1 << 30])
def test_l2_prefetch_lines(wdtype, budget):
    """The prefetch kernel's record mode (the same index maths as its prefetches): the first `span` columns of every
    split-K range of the projection's launch, a short last range cut at K; and the registry's cases."""
    w = torch.zeros(40, 900).to(wdtype)  # batch 2: the dot path, 8 K ranges of 128 columns (the last 4 wide)
    plan = trunk.prefetch_plan(w, 2, budget)
    assert plan["splits"] == 8 and plan["ksplit"] == 128 and plan["bytes"] <= budget
    rec = torch.full((plan["lines"],), -7, dtype=torch.int64)
    ran = []
    trunk.prefetch_l2(w, 2, budget=budget, record=rec, backend="triton", ran=ran)
    want = trunk.prefetch_lines(40, 900, 128, plan["span"], w.element_size())
    assert torch.equal(rec, want) and ran[-1].backend == "triton"
    el = 128 // w.element_size()  # elements a line
    assert bool((want == -1).any()) == (plan["span"] > el)  # the last range's second line starts past K: skipped
    _check(registry.get("l2_prefetch"), preset="tiny", group="kda_in", batch=3, wdtype="bf16", budget=1 << 16)
    with pytest.raises(TrunkArgumentError, match="'budget'"):
        trunk.prefetch_l2(w, 2, budget=-1)
    with pytest.raises(TrunkArgumentError, match="'record'"):
        trunk.prefetch_l2(w, 2, budget=budget, record=torch.empty(1, dtype=torch.int64))


# ---- router --------------------------------------------------------------------------------------------

@pytest.mark.parametrize("scores,batch", [("random", 1), ("near", 1), ("ties", 1)])
def test_router_topk(scores, batch):
    _check(ROUTER, batch=batch, scores=scores)


@pytest.mark.parametrize("experts,top_k", [(16, 16), (40, 16), (896, 1), (100, 8)])
def test_router_small_pools_and_k(experts, top_k):
    _check(ROUTER, batch=3, experts=experts, top_k=top_k, scores="ties")


def test_router_tie_rule_lower_id_first():
    logits = torch.zeros(1, 32)
    bias = torch.zeros(32)
    bias[[3, 9, 20, 30]] = 1.0  # four equal winners, then 28 equal scores: ids in order
    for be in ("triton", "reference"):
        idx, w = trunk.router_topk(logits, bias, top_k=6, backend=be)
        assert idx.tolist() == [[3, 9, 20, 30, 0, 1]], be
        assert torch.allclose(w, torch.full((1, 6), 1 / 6))


def test_route_projection_then_topk_matches_oracle():
    g = torch.Generator().manual_seed(3)
    h = torch.randn(5, 64, generator=g).bfloat16()
    r = RouterWeights(w=(torch.randn(48, 64, generator=g) * 0.2).bfloat16(), e_bias=torch.randn(48, generator=g) * 0.1,
                      top_k=8, scaling=2.5)
    ran = []
    idx, w = trunk.route(h, r, backend="triton", ran=ran)
    # 5 rows: the selection in the projection's launch (test_route_fuses_the_selection_on_triton: both forms)
    assert [x.op for x in ran] == ["proj_group"] and all(x.backend == "triton" for x in ran)
    logits = h.double() @ r.w.double().T
    want = ops.ref_router(dict(logits=logits, e_bias=r.e_bias), ROUTER.case(top_k=8))
    assert torch.equal(idx, want["idx"].long())
    assert rel_norm_error(w, want["weights"] * 2.5) < 1e-5


# ---- AttnRes + RMSNorm ---------------------------------------------------------------------------------

@pytest.mark.parametrize("n_blocks", range(10))
@pytest.mark.parametrize("update", ops.UPDATES)
def test_attnres_blocks_and_updates(n_blocks, update):
    """0..9 blocks; the partial given, updated (p = prefix + a, bit-exact bf16) or a new block's (p = a).
    D = 200 over 2 programs of 128 columns (the second part-masked): the cross-program sums and the
    barrier's interpreter path (CI time: the full 7168 runs in test_attnres_batches_and_widths)."""
    _check(ATT, options=dict(block_d=128, path="split"), batch=1, n_blocks=n_blocks, update=update, dim=200)


@pytest.mark.parametrize("batch,dim,options", [(9, 7168, {}), (1, 7168, dict(block_d=1024)), (3, 100, {}),
                                                (2, 1, {}), (2, 300, dict(block_d=256)), (2, 300, dict(path="row"))])
def test_attnres_batches_and_widths(batch, dim, options):
    """The row path (batch > 8 by default), the split path over 7 programs of 1024 columns, odd widths."""
    _check(ATT, options=options, batch=batch, n_blocks=9, update="add", dim=dim)


def test_attnres_in_place_partial_and_mix_norm_triton():
    """partial_out may be the prefix itself (the layer updates p in place); mix_norm on triton = update none."""
    case = ATT.case(batch=2, n_blocks=3, update="add", dim=256)
    d = ATT.make_inputs(case, 0, DEV)
    want = ops.ref_attnres(d, case)
    blocks = ops.blocks_of(d)
    p = d["prefix"].clone()
    ran = []
    out = attnres.update_mix_norm(blocks, p, d["new"], d["w_norm"], d["w_proj"], d["norm_w"], partial_out=p,
                                  update="add", backend="triton", ran=ran)
    assert torch.equal(p.double(), want["partial_out"]) and rel_norm_error(out, want["out"]) < 4e-3
    assert ran[-1].op == "attnres_norm" and ran[-1].kernel.endswith("attnres_norm:attnres_norm")
    y = attnres.mix_norm(blocks, p, d["w_norm"], d["w_proj"], d["norm_w"], backend="triton")
    assert torch.equal(y, out)


# ---- argument errors, by name --------------------------------------------------------------------------

def _xw(B=2, K=64, N=24):
    return torch.randn(B, K).bfloat16(), torch.randn(N, K).bfloat16()


@pytest.mark.parametrize("fn,name", [
    (lambda: trunk.proj(torch.randn(2, 64), _xw()[1], backend="triton"), "'x'"),
    (lambda: trunk.proj(_xw()[0], torch.randn(24, 63).bfloat16(), backend="triton"), "'w'"),
    (lambda: trunk.proj(_xw()[0], _xw()[1].to(torch.float8_e4m3fn), backend="triton"), "'w_scale'"),
    (lambda: trunk.proj(_xw()[0], _xw()[1], w_scale=torch.ones(24), backend="triton"), "'w_scale'"),
    (lambda: trunk.proj(*_xw(), torch.empty(2, 23, dtype=torch.bfloat16), backend="triton"), "'out'"),
    (lambda: trunk.proj(*_xw(), residual=torch.empty(2, 5, dtype=torch.bfloat16), backend="triton"), "'residual'"),
    (lambda: trunk.proj(torch.randn(1025, 64).bfloat16(), _xw()[1], backend="triton"), "'x'"),
    (lambda: trunk.proj(*_xw(), backend="triton", block_n=48), "'block_n'"),
    (lambda: trunk.proj(*_xw(), backend="reference", split_k=2), "'split_k'"),
    (lambda: trunk.proj(torch.randn(9, 64).bfloat16(), _xw()[1], backend="triton", path="rows"), "'path'"),
    (lambda: trunk.proj(*_xw(), backend="triton", path="tiles"), "'path'"),
    (lambda: trunk.proj(*_xw(), backend="triton", path="rows", split_k=2), "'split_k'"),
    (lambda: trunk.proj_group(*_xw(), [torch.empty(2, 20, dtype=torch.bfloat16)], backend="triton"), "'outs'"),
    (lambda: trunk.proj_group(*_xw(), torch.empty(2, 24), backend="triton"), "'outs'"),
    (lambda: trunk.proj_group(*_xw(), [torch.empty(2, 3, dtype=torch.bfloat16)] * 8, backend="triton"), "'outs'"),
    (lambda: trunk.router_topk(torch.randn(2, 40), torch.zeros(40), top_k=41), "'top_k'"),
    (lambda: trunk.router_topk(torch.randn(2, 40), torch.zeros(39)), "'e_bias'"),
    (lambda: trunk.router_topk(torch.randn(2, 40).bfloat16(), torch.zeros(40), backend="triton"), "'logits'"),
    (lambda: trunk.router_topk(torch.randn(2, 40), torch.zeros(40), top_k=4, idx=torch.empty(2, 4)), "'idx'"),
    (lambda: trunk.route(torch.randn(2, 8), object()), "'router'"),
], ids=lambda v: v if isinstance(v, str) else "")
def test_trunk_argument_errors(fn, name):
    with pytest.raises(TrunkArgumentError, match=name):
        fn()


def _att(B=2, D=32, n=2):
    t = [torch.randn(B, D).bfloat16() for _ in range(n + 2)]
    w = [torch.ones(D).bfloat16() for _ in range(3)]
    return t[:n], t[n], t[n + 1], w


@pytest.mark.parametrize("kw,name", [
    (dict(update="sum"), "'update'"),
    (dict(update="none"), "'new'"),
    (dict(new=torch.randn(2, 31).bfloat16()), "'new'"),
    (dict(out=torch.empty(2, 32)), "'out'"),
    (dict(partial_out=torch.empty(3, 32, dtype=torch.bfloat16)), "'partial_out'"),
    (dict(blocks=[torch.randn(2, 32).bfloat16()] * 10), "'blocks'"),
    (dict(blocks=[torch.randn(2, 31).bfloat16()]), "'blocks\\[0\\]'"),
    (dict(num_warps=3), "'num_warps'"),
    (dict(path="rows"), "'path'"),
    (dict(prefix=torch.randn(2, 32)), "'prefix'"),
], ids=lambda v: v if isinstance(v, str) else "")
def test_attnres_argument_errors(kw, name):
    blocks, prefix, new, (wn, wp, nw) = _att()
    args = dict(blocks=blocks, prefix=prefix, new=new, update="add", backend="triton")
    if kw.get("prefix") is not None:
        args["new"] = torch.randn(2, 32)
    args.update(kw)
    with pytest.raises(ValueError, match=name):
        attnres.update_mix_norm(args.pop("blocks"), args.pop("prefix"), args.pop("new"), wn, wp, nw, **args)


def test_backend_refusals_by_name():
    x, w = _xw()
    with pytest.raises(SwitchError, match="'bogus'"):
        trunk.proj(x, w, backend="bogus")
    with pytest.raises(BackendUnavailable, match="'cute'"):
        trunk.proj(x, w, backend="cute")


def test_auto_follows_the_measured_table():
    """data/trunk_defaults.json: triton where it can run (a GPU), else its reference fallback rule."""
    x, w = (t.to("cuda" if torch.cuda.is_available() else "cpu") for t in _xw())
    ran = []
    trunk.proj(x, w, backend="auto", ran=ran)
    want = "triton" if torch.cuda.is_available() else "reference"
    assert ran[-1].backend == want and "trunk_defaults.json" in ran[-1].why


# ---- GPU: every TP8 and TP16 per-GPU shape -------------------------------------------------------------

@pytest.mark.gpu
@pytest.mark.parametrize("preset", ["tp8", "tp16"])
@pytest.mark.parametrize("name", ops.NAMES)
def test_gpu_every_projection_shape(preset, name):
    """The default path at batch 1, fp8 weights on the default path at batch 8 (the long-input split rule,
    FP8_LONG_K), the tma path with fp8 weights and at batch 64."""
    for batch, wdtype, opts in ((1, "bf16", {}), (8, "fp8", {}), (5, "fp8", dict(path="tma")),
                                (64, "bf16", dict(path="tma"))):
        _check(PROJ, options=opts, preset=preset, proj=name, batch=batch, wdtype=wdtype)


@pytest.mark.gpu
@pytest.mark.parametrize("options", [dict(path="dot"), dict(path="rows"), dict(path="tma", num_stages=8),
                                     dict(path="tma", block_k=256, num_stages=3)])
def test_gpu_paths(options):
    for name in ("kda_q", "kda_o", "kda_b"):
        for batch in (1, 3) if options["path"] == "rows" else (1, 16, 40, 512):
            _check(PROJ, options=options, preset="tp8", proj=name, batch=batch, wdtype="bf16")
    _check(PROJ, options=options, preset="tp16", proj="kda_o", batch=2, wdtype="fp8", residual=True)


@pytest.mark.gpu
@pytest.mark.parametrize("preset", ["tp8", "tp16"])
def test_gpu_prologues(preset):
    """The input prologues at the real shapes, on the tma path (x through pointers, W through the copy engine)
    and the dot path, batch 1 to 64."""
    for name, pro in (("shared_w2", "situ"), ("moe_up", "rms"), ("mla_uq", "rms"), ("moe_up_shared", "rms+situ")):
        for batch, wdtype, opts in ((1, "bf16", {}), (1, "bf16", dict(path="dot")), (7, "fp8", {}),
                                    (64, "bf16", dict(path="tma"))):
            _check(PROJ, options=opts, preset=preset, proj=name, batch=batch, wdtype=wdtype, prologue=pro,
                   residual=name != "mla_uq")
        if pro == "rms+situ":
            continue
        case = PROJ.case(preset=preset, proj=name, batch=3, wdtype="bf16", prologue=pro, residual=False)
        d = PROJ.make_inputs(case, 2, "cuda")
        p = ops.prologue_of(d, case)
        fused = trunk.proj(d["x"], d["w"], prologue=p, backend="triton")
        a = (glue.situ_glu(d["x"], b1=p[1], b2=p[2], backend="triton") if pro == "situ"
             else glue.rms_norm(d["x"], p[1], eps=p[2], backend="triton"))
        assert rel_norm_error(fused, trunk.proj(a, d["w"], backend="triton")) < 1e-3  # the unfused kernels


@pytest.mark.gpu
@pytest.mark.parametrize("preset", ["tp8", "tp16"])
@pytest.mark.parametrize("group", list(ops.GROUPS))
def test_gpu_groups(preset, group):
    for batch, wdtype, opts in ((1, "fp8", {}), (16, "bf16", {}), (64, "bf16", dict(path="dot"))):
        _check(GROUP, options=opts, preset=preset, group=group, batch=batch, wdtype=wdtype)


@pytest.mark.gpu
@pytest.mark.parametrize("preset", ["tp8", "tp16"])
def test_gpu_fused_selection(preset):
    for batch, wdtype, opts in ((1, "bf16", {}), (1, "fp8", {}), (8, "bf16", dict(path="dot")), (16, "bf16", {})):
        _check(GROUP, options=opts, preset=preset, group="moe_in", batch=batch, wdtype=wdtype, select=True)


@pytest.mark.gpu
def test_gpu_router_and_attnres():
    for scores in ("random", "near", "ties"):
        for opts in ({}, dict(num_warps=4, pdl=True)):
            _check(ROUTER, options=opts, batch=64, scores=scores)
    for batch in (1, 64):
        for n, u in ((0, "fresh"), (9, "add"), (9, "none"), (4, "add")):
            for opts in (dict(path="split"), dict(path="row"), dict(path="split", block_d=1024, num_warps=8)):
                _check(ATT, options=opts, batch=batch, n_blocks=n, update=u)


@pytest.mark.slow
def test_prefetch_experiment_smoke(tmp_path):
    """The prefetch experiment's code path at the tiny preset (CPU smoke timings, one stream): its rows and the L2
    size it records."""
    from k3lab.harness.bundle import load

    b = load(ops.prefetch_experiment(str(tmp_path), preset="tiny", groups=("moe_in",), batches=(1,),
                                     budgets_mb=(0, 0.05), reps=1, device="cpu", log=lambda *a: None))
    assert [r.name for r in b.rows] == ["moe_in.b1.proj", "moe_in.b1.attnres", "moe_in.b1.seq.0MB",
                                        "moe_in.b1.seq.0.05MB", "moe_in.b1.phase.0.05MB"]
    assert "l2_bytes_assumed" in b.config and b.rows[3].extra["prefetched_bytes"] > 0


def test_h200_explore_runs_the_shared_entry_loop(tmp_path):
    """k3lab.bench.runner.explore (the named-variant sweeps of every component) at a tiny case on the CPU: each
    variant and the named peer checked against fp64, one row each."""
    from k3lab.harness.bundle import load

    entry = ("proj", dict(preset="tiny", proj="kda_q", batch=1, wdtype="bf16"), ({}, dict(path="dot")), ("cublas",))
    b = load(ops.h200_explore(str(tmp_path), entries=(entry,), reps=1, device="cpu", log=lambda *a: None))
    assert [r.backend for r in b.rows] == ["triton", "triton", "cublas"] and all(r.error["ok"] for r in b.rows)
    assert b.config["entries"][0]["op"] == "proj"


@pytest.mark.parametrize("batch", [1, 3, 16, 17])
def test_route_fuses_the_selection_on_triton(batch):
    """trunk.route on triton: up to SELECT_MAX_BATCH rows one launch (the selection in the projection group's
    launch), above it the projection then router_topk; the same experts as the fp64 route (distinct scores) and the
    weights within 1e-5."""
    g = torch.Generator().manual_seed(batch)
    E, D, k = 64, 128, 8
    w = (torch.randn(E, D, generator=g) / D ** 0.5).to(torch.bfloat16)
    bias = torch.randn(E, generator=g) * 0.1
    h = torch.randn(batch, D, generator=g).to(torch.bfloat16)
    r = RouterWeights(w=w, e_bias=bias, top_k=k, scaling=2.5)
    ran = []
    idx, wk = trunk.route(h, r, backend="triton", ran=ran)
    r64 = RouterWeights(w=w.double(), e_bias=bias.double(), top_k=k, scaling=2.5)
    i64, w64 = trunk.route(h.double(), r64, backend="reference")
    assert torch.equal(idx, i64) and rel_norm_error(wk, w64) < 1e-5
    assert [x.op for x in ran] == (["proj_group"] if batch <= 16 else ["proj", "router_topk"])


@pytest.mark.parametrize("op_name,kw", [("proj", dict(proj="moe_router")), ("proj", dict(proj="kda_q")),
                                        ("proj_group", dict(group="moe_in"))])
def test_cublas_peers_pass_the_checker(op_name, kw):
    """The cuBLAS peers write what ours writes: the router's logits in fp32 (a bf16 GEMM output rounded every logit
    and failed the fp32 check, so the router's `ours / cuBLAS` rows compared against a failing peer)."""
    op = registry.get(op_name)
    case = op.case(preset="tiny", batch=3, wdtype="bf16", **kw)
    inputs = op.make_inputs(case, 5, "cpu")
    peers = [p for p in ops.proj_peers(case) if p.name.startswith("cublas")]
    assert peers
    for p in peers:
        assert p.check(case, inputs).ok, p.name


def test_auto_fp8_batch1_rule(monkeypatch):
    """data/trunk_defaults.json's fp8 batch-1 rule (measured: profiles/h100-80gb-hbm3/fp8_b1.json.gz, git history at
    ab6ca59): the cute GEMV for fp8 weights at batch 1 with >= 768 output rows, triton otherwise (bf16, fewer rows,
    batch 4); at batch 2 the shapes where the GEMV won (fp8_b2_rule.json.gz: mla_uq, moe_down, TP16 shared_w2) by rows
    and input width; where the rule's cute cannot run the call (no CuTe DSL, an input prologue) the fallback's triton,
    then the reference. The bench's variant rows look the rule up with the case's facts (k3lab.ops.trunk.proj_facts), as
    a call does from its tensors (the component's _proj_facts)."""
    from k3lab import policy
    from k3lab.components import dispatch
    from k3lab.components import trunk as ct

    def pick(B, shape, runs=lambda b: True):
        return policy.choose("trunk", "proj", B, 1, runs, shape)[0]

    assert pick(1, {"fmt": "fp8", "n": 768}) == "cute"
    assert pick(1, {"fmt": "fp8", "n": 576}) == "triton"
    assert pick(1, {"fmt": "bf16", "n": 7168}) == "triton"
    assert pick(4, {"fmt": "fp8", "n": 2304, "k": 1536}) == "triton"
    # bf16 at batch 1 (the H200's proj_cute30 / proj_cute / proj_group_cute): the short inputs and >= 3,584 rows over
    # the model width on cute, as the step's proj_cute switch chooses them
    for preset in ("tp8", "tp16"):
        for name, (n, k) in ops.proj_shapes(preset).items():
            want = "cute" if name in ("kda_fb", "kda_o", "mla_uq", "mla_o", "moe_down", "shared_w2") else "triton"
            assert pick(1, {"fmt": "bf16", "n": n, "k": k}) == want, (preset, name)
        for group, parts in ops.GROUPS.items():
            n = sum(ops.proj_shapes(preset)[p][0] for p in parts)
            got = policy.choose("trunk", "proj_group", 1, 1, lambda b: True, {"fmt": "bf16", "n": n, "k": 7168})[0]
            assert got == ("cute" if n >= 3584 else "triton"), (preset, group, n)
            assert policy.choose("trunk", "proj_group", 2, 1, lambda b: True,
                                 {"fmt": "bf16", "n": n, "k": 7168})[0] == "triton"
            assert policy.choose("trunk", "proj_group", 1, 1, lambda b: b != "cute",
                                 {"fmt": "bf16", "n": n, "k": 7168})[0] == "triton"
    # batch 2: the measured winners by (rows, width), every other projection of K3's TP8 / TP16 shapes on triton
    for preset in ("tp8", "tp16"):
        for name, (n, k) in ops.proj_shapes(preset).items():
            want = "cute" if (name in ("mla_uq", "moe_down") or (preset, name) == ("tp16", "shared_w2")
                              or (preset, name) == ("tp8", "kda_fb")) else "triton"
            assert pick(2, {"fmt": "fp8", "n": n, "k": k}) == want, (preset, name)
            assert pick(2, {"fmt": "bf16", "n": n, "k": k}) == "triton"
    assert pick(1, {"fmt": "fp8", "n": 7168}, lambda b: b != "cute") == "triton"
    assert pick(1, {"fmt": "fp8", "n": 7168}, lambda b: b == "reference") == "reference"
    for preset, name, n in (("tp8", "kda_q", 1536), ("tp16", "mla_dkv", 576), ("tp16", "shared_w1", 384)):
        case = PROJ.case(preset=preset, proj=name, batch=1, wdtype="fp8", residual=False, prologue="none")
        assert ops.proj_facts(case) == {"fmt": "fp8", "n": n, "k": 7168}
        want = "cute" if n >= 768 else "triton"
        assert policy.rule("trunk", "proj", 1, 1, PROJ.rule_facts(case))["backend"] == want
    w8 = torch.zeros(1536, 64).to(torch.float8_e4m3fn)
    facts = ct._proj_facts(w8, None, None, None)
    assert facts == {"fmt": "fp8", "n": 1536, "k": 64, "prologue": "none", "select": False}
    assert "multiple of 16" in PROJ.supports("cute", {"batch": 1, **facts, "k": 40})
    # an input prologue: the op's supports refuses cute, so auto takes the fallback's first backend that runs
    rms = ct._proj_facts(w8, ("rms", torch.ones(64), 1e-6), None, None)
    assert "prologue" in PROJ.supports("cute", {"batch": 1, **rms})
    monkeypatch.setattr(dispatch, "can_run", lambda op, b: b in ("cute", "triton", "reference"))
    assert dispatch.select("proj", "auto", B=1, shape={"batch": 1, **facts})[0] == "cute"
    be, _, why = dispatch.select("proj", "auto", B=1, shape={"batch": 1, **rms})
    assert be == "triton" and "fallback" in why and "passed over" in why


def test_policy_rules_on_facts_need_the_facts():
    """k3lab.policy.matches: a rule filtering on the weight format, the output rows or the input width matches only a
    query that states them (within the bounds); a query without them gets the rules that hold whatever the shape."""
    from k3lab import policy

    r = {"max_batch": 2, "fmt": ["fp8"], "min_n": 1152, "max_n": 2304, "max_k": 1536, "backend": "cute"}
    assert policy.matches(r, 2, 1, {"fmt": "fp8", "n": 2304, "k": 1536})
    for shape in (None, {}, {"fmt": "fp8"}, {"fmt": "fp8", "n": 2304}, {"n": 2304, "k": 1536},
                  {"fmt": "bf16", "n": 2304, "k": 1536}, {"fmt": "fp8", "n": 2305, "k": 1536},
                  {"fmt": "fp8", "n": 1151, "k": 1536}, {"fmt": "fp8", "n": 2304, "k": 1537}):
        assert not policy.matches(r, 2, 1, shape), shape
    assert not policy.matches(r, 3, 1, {"fmt": "fp8", "n": 2304, "k": 1536})
    lo = {"min_k": 7168, "backend": "cute"}
    assert policy.matches(lo, 1, 1, {"k": 7168}) and not policy.matches(lo, 1, 1, {"k": 3584})
    assert policy.matches({"max_batch": None, "backend": "triton"}, 64, 1, None)
    assert policy.rule("trunk", "proj", 1)["backend"] == "triton"
    assert policy.rule("trunk", "proj", 1, 1, {"fmt": "bf16"})["backend"] == "triton"
    assert "min_k" in policy.RULE_KEYS and "max_n" in policy.RULE_KEYS


@pytest.mark.gpu
@pytest.mark.parametrize("name,batch,wdtype,rule", [
    ("kda_q", 1, "fp8", "cute"), ("mla_dkv", 1, "fp8", "triton"), ("mla_uq", 2, "fp8", "cute"),
    ("kda_q", 2, "fp8", "triton"), ("kda_o", 1, "bf16", "cute"), ("kda_q", 1, "bf16", "triton")])
def test_gpu_auto_fp8_batch1(name, batch, wdtype, rule):
    """The batch-1 / batch-2 rules on the GPU: auto runs the cute GEMV over fp8 kda_q's 1,536 rows at batch 1, fp8
    mla_uq's 2,304 at batch 2 and bf16 kda_o's short input at batch 1 (triton where CuTe DSL is not installed), triton
    over fp8 mla_dkv's 576, fp8 kda_q at batch 2 and bf16 kda_q, each checked against fp64 by the shared checker."""
    from k3lab.components import dispatch

    case = PROJ.case(preset="tp8", proj=name, batch=batch, wdtype=wdtype, residual=False, prologue="none")
    res = checker.check(PROJ, case, backend="auto")
    want = "cute" if rule == "cute" and dispatch.can_run("proj", "cute") else "triton"
    assert res.ok, res.failures
    assert res.ran[-1].backend == want, res.ran[-1]


def test_proj_grid_takes_cluster_and_tile_m_with_path_mma_only():
    """A grid sweeping the cute projection's paths beside path "mma"'s tile_m / cluster gives the GEMV (path None /
    "gemv") only its own combination: it refuses those options by name, which a bench row would record as an error
    (the sixty-fifth session's proj_mma65 run)."""
    from k3lab import registry

    for name in ("proj", "proj_group"):
        op = registry.get(name)
        case = op.case(**({"proj": "kda_q"} if name == "proj" else {"group": "kda_in"}), preset="tiny", batch=4,
                       wdtype="bf16")
        combos = op.options("cute", {"path": (None, "gemv", "mma"), "tile_m": (None, 32), "cluster": (None, 2)}, case)
        pairs = {(o["path"], o["tile_m"], o["cluster"]) for o in combos}
        assert pairs == {(None, None, None), ("gemv", None, None), ("mma", None, None), ("mma", 32, None),
                         ("mma", None, 2), ("mma", 32, 2)}
        assert all(o["path"] != "mma" for o in op.options("triton", {"path": (None, "tma", "mma")}, case))


def test_bench_says_why_no_option_combination_ran(monkeypatch):
    """A grid whose options leave a backend no combination that fits the case (cute's tile_m without path "mma")
    lists the backend as skipped with the reason instead of dropping it in silence."""
    from k3lab import registry
    from k3lab.bench import runner

    monkeypatch.setattr(runner, "backend_status", lambda be: (True, ""))
    op = registry.get("proj")
    case = op.case(preset="tiny", proj="kda_q", batch=4, wdtype="bf16")
    impls, skipped = runner.implementations(op, case, ["cute"], peers=False, only={"tile_m": (32,)}, gpu=False)
    assert not impls and "option_valid" in skipped["cute"]
    impls, skipped = runner.implementations(op, case, ["cute"], peers=False, only={"tile_m": (32,), "path": ("mma",)},
                                            gpu=False)
    assert [i.options["tile_m"] for i in impls] == [32] and not skipped

