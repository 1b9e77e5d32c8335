"""The few-token tensor-core projection (kernels/cute/proj_mma.py, path "mma" of the cute projection) on the CPU
emulator (tests/cute_emulate.py): through the shared checker (k3lab.harness.checker: fresh inputs, outputs poisoned,
the fp64 reference, inputs unchanged, the registry's tolerances) at the `tiny` preset, then at widths with several
rounds a warp and a remainder, every cluster size, one and two n-tiles, a partial row tile, fp8 weights over every
e4m3 code, the row tiles (tile_m) and the module's settings (UNROLL, CHAINS, X_SMEM), and what it refuses,
by name.

Tolerance of the direct checks: fp32 outputs against fp64 within 1e-5 of the largest value (bf16 and e4m3 products
are exact on the MMAs, fp32 sums; fp8's x is rounded to f16, exact for these normal-range bf16 inputs).
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


def run_mma(x, w, outs, residual=None, w_scale=None, pdl=False, cluster=None, early=None, seed=0, sms=2,
            settings=None, tile_m=None):
    """proj(..., path="mma") on the emulator, with the int32 views the wrapper makes registered (x's bf16 pairs, a
    bf16 weight's pairs). early: the tensors a PDL launch may read before its wait (default: w); settings: module
    settings of proj_mma for this call (e.g. {"X_SMEM": False})."""
    t = dict(x=x, w=w, x_words=x.reshape(-1).view(torch.int32), **{f"o{i}": o for i, o in enumerate(outs)})
    if w.dtype == torch.bfloat16:
        t["w_words"] = w.reshape(-1).view(torch.int32)
    if w_scale is not None:
        t["ws"] = w_scale
    if residual is not None:
        t["r"] = residual
    emulate._PDL["early"] = frozenset({w.data_ptr()} if early is None else early)

    def call(m, **a):
        for k, v in (settings or {}).items():
            setattr(m.mod["proj_mma"], k, v)
        m.mod["proj_gemv"].proj(a["x"], a["w"], [a[f"o{i}"] for i in range(len(outs))], residual=a.get("r"), pdl=pdl,
                                w_scale=a.get("ws"), path="mma", cluster=cluster, tile_m=tile_m)
    with emulate.emulated(seed=seed, sms=sms):
        emulate._run(call, t, seed)


def impl(n_out, pdl=False, cluster=None):
    def f(d):
        ws = d["w_scale"] if d["w"].dtype == torch.float8_e4m3fn else None
        run_mma(d["x"], d["w"], [d[f"y{i}"] for i in range(n_out)], d.get("residual"), ws, pdl, cluster)
    f.__name__ = f"emulated cute proj path mma ({n_out} outputs, pdl={pdl}, cluster={cluster})"
    return f


@pytest.mark.parametrize("name,batch,wdtype,residual,pdl", [
    ("kda_q", 3, "bf16", True, True),      # K 64: two bf16 chunks, warps 2 and 3 idle
    ("mla_dkv", 1, "bf16", False, False),  # N 40: a partial second tile
    ("kda_b", 9, "fp8", False, True),      # N 4: one partial tile; two n-tiles
    ("moe_router", 16, "fp8", True, False),
])
def test_proj_tiny(name, batch, wdtype, residual, pdl):
    c = PROJ.case(preset="tiny", proj=name, batch=batch, wdtype=wdtype, residual=residual, prologue="none")
    checker.require(checker.check(PROJ, c, impl=impl(1, pdl=pdl), seed=batch, device="cpu"))


@pytest.mark.parametrize("wdtype,batch", [("bf16", 2), ("fp8", 12)])
def test_group_tiny(wdtype, batch):
    """The MLA input group: three outputs (fp32 and bf16) of one weight, a tile straddling two of them."""
    c = GROUP.case(preset="tiny", group="mla_in", batch=batch, wdtype=wdtype, select=False)
    checker.require(checker.check(GROUP, c, impl=impl(len(trunk_ops._parts(c)), pdl=True), seed=batch, device="cpu"))


def _weights(N, K, fp8, g):
    if fp8:  # every e4m3 code and both signs (the NaNs 0x7F / 0xFF left out), a scale a row
        codes = torch.randint(0, 256, (N, K), generator=g, dtype=torch.int32)
        codes[(codes & 0x7F) == 0x7F] = 0x3F
        w = codes.to(torch.uint8).view(torch.float8_e4m3fn)
        sc = torch.rand(N, generator=g) + 0.5
        return w, sc, w.double() * sc.double()[:, None]
    w = (torch.randn(N, K, generator=g) / K ** 0.5).to(torch.bfloat16)
    return w, None, w.double()


# X_SMEM is the default: the global-memory form named
_U2, _GLOBAL = {"UNROLL": 2, "CHAINS": 1}, {"X_SMEM": False}


@pytest.mark.parametrize("fp8", [False, True])
@pytest.mark.parametrize("B,N,chunks,cluster,tile_m,settings", [
    (16, 40, 23, 1, 16, {}),        # four K parts of 5-6 chunks: a full round of four, then one past the range
    (5, 24, 37, 2, 32, {}),         # two row groups, four K parts of 9-10 chunks
    (9, 17, 50, 4, 16, {}),         # sixteen K parts of 3-4 chunks: one round, partly past the range
    (1, 40, 72, 8, 64, {}),         # four row groups (the last past N), eight K parts of 9 chunks
    (2, 16, 4, 8, 16, {}),          # four chunks over eight CTAs: half of them stage and add nothing
    (16, 40, 23, 2, 32, _GLOBAL),   # x read from global memory in the rounds
    (9, 17, 50, 4, 16, _GLOBAL),
    (16, 40, 23, 1, 32, _GLOBAL),
    (9, 17, 50, 4, 64, _GLOBAL),
    (5, 24, 37, 2, 16, _U2),        # rounds of two chunks, one accumulator chain
], ids=lambda v: "-".join(f"{k.lower()}{x}" for k, x in v.items()) if isinstance(v, dict) else None)
def test_rounds_remainders_and_clusters(fp8, B, N, chunks, cluster, tile_m, settings):
    g = torch.Generator().manual_seed(B * 1000 + chunks)
    K = chunks * (64 if fp8 else 32)
    x = torch.randn(B, K, generator=g).to(torch.bfloat16)
    w, sc, wd = _weights(N, K, fp8, g)
    out = torch.full((B, N), float("nan"), dtype=torch.float32)
    run_mma(x, w, [out], w_scale=sc, cluster=cluster, pdl=cluster % 2 == 0, settings=settings, tile_m=tile_m)
    want = x.double() @ wd.T
    assert (out.double() - want).abs().max() <= 1e-5 * want.abs().max()
    assert emulate.LAST["launches"][-1]["cluster"] == (cluster, 1, 1)
    assert emulate.LAST["launches"][-1]["grid"] == (cluster, (N + tile_m - 1) // tile_m, 1)


def test_strided_x_residual_and_bf16_output():
    """x a column slice of a wider buffer (row stride 8 more than K), the residual added in fp32 before the bf16
    rounding: equal to the rounded fp64 result within one bf16 step."""
    g = torch.Generator().manual_seed(7)
    B, N, K = 6, 32, 256
    buf = torch.randn(B, K + 8, generator=g).to(torch.bfloat16)
    x = buf[:, :K]
    w, _, wd = _weights(N, K, False, g)
    r = torch.randn(B, N, generator=g).to(torch.bfloat16)
    out = torch.full((B, N), float("nan"), dtype=torch.bfloat16)
    t = dict(buf=buf, buf_words=buf.reshape(-1).view(torch.int32), w=w, w_words=w.reshape(-1).view(torch.int32),
             o0=out, r=r)
    emulate._PDL["early"] = frozenset({w.data_ptr()})
    emulate._run(lambda m, **a: m.mod["proj_gemv"].proj(emulate._dev(a["buf"][:, :K]), a["w"], [a["o0"]],
                                                        residual=a["r"], path="mma", pdl=False), t, 0)
    want = x.double() @ wd.T + r.double()
    assert (out.double() - want).abs().max() <= 2 ** -7 * want.abs().max()


@pytest.mark.parametrize("settings", [{}, _GLOBAL], ids=["x_smem", "global"])
def test_pdl_reads_only_the_weight_before_the_wait(settings):
    """Under pdl a warp's first round of W loads before griddepcontrol.wait (W is no kernel's output), and x (its
    bulk copies into shared memory, or its loads in the rounds) only after; the emulator refuses the same launch when
    W is not declared readable early (the check is live)."""
    g = torch.Generator().manual_seed(3)
    x = torch.randn(2, 512, generator=g).to(torch.bfloat16)
    w, _, wd = _weights(16, 512, False, g)
    out = torch.full((2, 16), float("nan"), dtype=torch.float32)
    run_mma(x, w, [out], pdl=True, cluster=1, settings=settings)
    want = x.double() @ wd.T
    assert (out.double() - want).abs().max() <= 1e-5 * want.abs().max()
    with pytest.raises(emulate.EmulationError, match="before griddepcontrol.wait"):
        run_mma(x, w, [out], pdl=True, cluster=1, early=frozenset(), settings=settings)


def test_plan_fills_the_sms_with_whole_chunks():
    """The automatic (tile_m, cluster): at K3's TP8 shapes on 132 SMs at least two CTAs an SM where the chunks allow
    (the largest tile first: more warps on the same x columns), never more K parts than chunks but in a cluster of
    one; where no choice gives two an SM, the most CTAs. A value given is kept."""
    from k3lab_kernels.cute.proj_mma import CLUSTERS, TILES_M, plan

    for N, K in ((1536, 7168), (7168, 1536), (3584, 7168), (576, 7168), (12, 7168), (7168, 384), (1536, 128)):
        for fp8 in (False, True):
            tm, c = plan(N, K, fp8, 132)
            nch = K // (64 if fp8 else 32)
            assert tm in TILES_M and c in CLUSTERS and (c == 1 or 64 // tm * c <= nch)
            ctas = (N + tm - 1) // tm * c
            if ctas < 264:  # then nothing reaches two an SM
                assert all((N + t - 1) // t * k <= ctas for t in TILES_M for k in CLUSTERS
                           if k == 1 or 64 // t * k <= nch)
    assert plan(1536, 7168, False, 132) == (32, 8)   # kda_q: 48 tiles of 32 rows, eight CTAs each
    assert plan(3584, 7168, True, 132) == (64, 8)    # moe_down
    assert plan(7168, 1536, False, 132) == (64, 4)   # kda_o
    assert plan(576, 7168, False, 132) == (16, 8)    # mla_dkv
    assert plan(576, 7168, False, 132, tile_m=64) == (64, 8) and plan(576, 7168, False, 132, cluster=2) == (16, 2)


def test_plan_fits_shared_memory():
    """x staged for 16 tokens of K = 7168 bf16 in a cluster of one needs 235528 bytes (the H200 refused that launch,
    thirty-sixth session): the plan never chooses a (tile_m, cluster) past SMEM_LIMIT, and a given one is refused by
    name before any launch."""
    from k3lab_kernels.cute.proj_mma import SMEM_LIMIT, plan, smem_bytes

    assert smem_bytes(16, 7168, False, 16, 1) == 235528 > SMEM_LIMIT
    assert smem_bytes(16, 7168, False, 16, 1, x_smem=False) < SMEM_LIMIT
    for B in (1, 8, 9, 16):
        for N, K in ((3584, 7168), (12, 7168), (7168, 1536)):
            for fp8 in (False, True):
                for tm in (None, 16):
                    t, c = plan(N, K, fp8, 132, tile_m=tm, B=B)
                    assert smem_bytes(B, K, fp8, t, c) <= SMEM_LIMIT
    assert plan(12, 7168, False, 132, tile_m=16, B=16)[1] >= 2


def test_refused_by_name():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(2, 64, generator=g).to(torch.bfloat16)
    w, _, _ = _weights(16, 64, False, g)
    out = torch.zeros(2, 16)
    with pytest.raises(ValueError, match="'w' must be a contiguous .* multiple of 32 for path 'mma'"):
        run_mma(x[:, :48], w[:, :48].contiguous(), [out])
    w8 = w.to(torch.float8_e4m3fn)
    with pytest.raises(ValueError, match="'w' .* multiple of 64 for path 'mma'"):
        run_mma(x[:, :32].contiguous(), w8[:, :32].contiguous(), [out], w_scale=torch.ones(16))
    with pytest.raises(ValueError, match="'cluster' must be None or one of"):
        run_mma(x, w, [out], cluster=3)
    with pytest.raises(ValueError, match="'tile_m' must be None or one of"):
        run_mma(x, w, [out], tile_m=48)
    with pytest.raises(ValueError, match="'x' must be \\[1..16, K\\]"):
        run_mma(torch.zeros(17, 64, dtype=torch.bfloat16), w, [torch.zeros(17, 16)])
    with pytest.raises(ValueError, match="'residual' is an epilogue of a single projection"):
        run_mma(x, w, [out[:, :8], out[:, 8:]], residual=torch.zeros(2, 16, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match="'w_scale' is taken with fp8 weights only"):
        run_mma(x, w, [out], w_scale=torch.ones(16))

    def proj(**kw):
        t = dict(x=x, w=w, o0=out)
        emulate._run(lambda m, **a: m.mod["proj_gemv"].proj(a["x"], a["w"], [a["o0"]], **kw), t, 0)
    with pytest.raises(ValueError, match="'path' must be one of"):
        proj(path="wide")
    with pytest.raises(ValueError, match="'cluster' is an option of path 'mma'"):
        proj(cluster=2)
    with pytest.raises(ValueError, match="'tile_m' is an option of path 'mma'"):
        proj(tile_m=32)
    with pytest.raises(ValueError, match="'glu' is not taken by path 'mma'"):
        proj(path="mma", glu=(4.0, 25.0))


def test_component_options_by_backend():
    """The component validates path and cluster against the registry per backend before any kernel runs."""
    x = torch.zeros(1, 64, dtype=torch.bfloat16)
    w = torch.zeros(16, 64, dtype=torch.bfloat16)
    with pytest.raises(trunk.TrunkArgumentError, match="'cluster' is a cute kernel option; backend 'triton'"):
        trunk.proj(x, w, backend="triton", cluster=2)
    with pytest.raises(trunk.TrunkArgumentError, match="'path' must be one of"):
        trunk.proj(x, w, backend="triton", path="mma")
    assert set(PROJ.option_axes["path"]["cute"]) == {None, "gemv", "mma"}
    assert set(GROUP.option_axes["cluster"]["cute"]) == {None, 1, 2, 4, 8}
    assert set(GROUP.option_axes["tile_m"]["cute"]) == {None, 16, 32, 64}
