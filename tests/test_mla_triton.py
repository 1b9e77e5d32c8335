"""Triton MLA kernels (decode attention split-KV + merge, combine, cache write) through the shared checker
(k3lab.harness.checker: fp64 reference, outputs NaN-poisoned, caches compared, inputs unchanged) at every
switch value the kernels claim, small shapes. Without a GPU they run under TRITON_INTERPRET=1
(tests/conftest.py). The caches' unused rows and spare pages hold NaN (k3lab.ops.mla), so a kernel that
reads past a sequence's visible positions fails. Tolerances and their reasons: k3lab.ops.mla."""
from __future__ import annotations

import pytest
import torch

from k3lab import registry
from k3lab.harness import checker

DEC = registry.get("mla_decode")
COMB = registry.get("mla_combine")
WRITE = registry.get("mla_cache_write")


def _check(op, backend="triton", options=None, seed=0, **shape):
    res = checker.require(checker.check(op, op.case(**shape), backend=backend, options=options or {}, seed=seed))
    assert res.ran and res.ran[-1].backend == backend
    return res


# ---- decode attention ------------------------------------------------------------------------------

@pytest.mark.parametrize("shape", [
    dict(context=1, page_size=0),                                   # one cached position
    dict(context=1, T=4, page_size=1),                               # the whole history is the new positions
    dict(context=3, partitions=16, page_size=0),                     # history shorter than the partitions
    dict(context=40, partitions=64, page_size=16),                   # most pieces empty
    dict(context=50, batch=3, ragged=True, T=2, partitions=4),       # ragged lengths 50, 25, 1
    dict(context=37, batch=2, ragged=True, partitions=1, page_size=0),
], ids=lambda d: ",".join(f"{k}={v}" for k, v in d.items()))
def test_decode_small_histories_and_ragged(shape):
    _check(DEC, **shape)


@pytest.mark.parametrize("heads", [6, 12, 16])
@pytest.mark.parametrize("pad_heads", [0, 16])
def test_decode_heads_and_padding(heads, pad_heads):
    _check(DEC, heads=heads, pad_heads=pad_heads, context=30, T=2 if heads == 6 else 1, partitions=2)


@pytest.mark.parametrize("page_size", [0, 1, 16, 64])
def test_decode_page_sizes(page_size):
    _check(DEC, page_size=page_size, context=70, batch=2, ragged=True, partitions=3)


@pytest.mark.parametrize("page_size", [0, 16])
@pytest.mark.parametrize("fp8_scale", ["tensor", "token"])
def test_decode_fp8(page_size, fp8_scale):
    """Against the dequantized cache (e4m3 * scale): the kernel's own error only."""
    _check(DEC, kv_dtype="fp8", fp8_scale=fp8_scale, page_size=page_size, context=45, batch=2, ragged=True,
           T=2, partitions=2)


@pytest.mark.parametrize("T", [1, 2, 3, 4])
def test_decode_verify_T(T):
    """T new positions read the cache once, query t sees positions <= lengths + t."""
    _check(DEC, T=T, context=20, batch=2, ragged=True, partitions=2, page_size=16)


@pytest.mark.parametrize("dcp,layout", [(2, "interleave"), (3, "contiguous"), (4, "interleave"),
                                        (4, "contiguous"), (16, "interleave")])
def test_decode_dcp_equals_unsharded(dcp, layout):
    """DCP-N emulated: every shard's partials (all heads over its positions) merged by lse equal the
    unsharded fp64 answer; context 2 < N leaves shards empty."""
    _check(DEC, dcp=dcp, dcp_layout=layout, context=2 if dcp == 16 else 21, batch=2, ragged=True, partitions=2,
           page_size=0)


def test_decode_dcp_one_cached_position():
    """The issue's new-user case: dcp=4 at the start of a conversation."""
    _check(DEC, dcp=4, context=1, partitions="auto")


@pytest.mark.parametrize("options", [dict(block_n=64), dict(block_m=16), dict(block_n=16, num_warps=8, num_stages=3),
                                     dict(ksplit=4), dict(ksplit=4, block_n=16)])
def test_decode_kernel_options(options):
    """block_m=16 at 12 heads x T=2 splits the rows into two groups (each reads the cache); ksplit cuts the latent
    columns into pieces (independent score products, acc and the stored partial in pieces)."""
    _check(DEC, options=options, T=2, context=33, partitions=2, page_size=16)


@pytest.mark.parametrize("ksplit,page_size,fp8_scale", [(4, 0, "tensor"), (4, 0, "token"), (4, 64, None)])
def test_decode_ksplit_cache_kinds(ksplit, page_size, fp8_scale):
    """The latent pieces on the contiguous cache (the step's), fp8 with either scale, and preloaded page indices."""
    kv = dict(kv_dtype="fp8", fp8_scale=fp8_scale) if fp8_scale else {}
    _check(DEC, options=dict(ksplit=ksplit), context=70 if page_size == 64 else 45, batch=2, ragged=True,
           partitions=2, page_size=page_size, **kv)


@pytest.mark.parametrize("shape", [
    dict(T=1, context=70, batch=2, ragged=True, partitions=2, page_size=0),
    dict(T=4, context=45, batch=1, partitions=1, page_size=16),
    dict(T=2, context=40, batch=2, partitions=3, page_size=0, kv_dtype="fp8", fp8_scale="token"),
], ids=lambda d: ",".join(f"{k}={v}" for k, v in d.items()))
@pytest.mark.parametrize("ksplit", [1, 4])
def test_decode_lazy_rescale(shape, ksplit):
    """`lazy`: the running max moves only when a block's maximum passes it by LAZY_TAU. Checked on the registry's
    inputs and on a history whose scores grow along the positions (the cache's rows times a ramp, the queries times
    4: the max moves past the threshold in most blocks, and stays within it in the others), both against fp64."""
    _check(DEC, options=dict(lazy=True, ksplit=ksplit), **shape)
    case = DEC.case(**shape)
    d = DEC.make_inputs(case, 3, "cpu")
    if d["kv_cache"].dtype == torch.bfloat16:
        rows = d["kv_cache"].shape[-2]
        ramp = 1.0 + torch.arange(rows, dtype=torch.float32) / 6.0
        d["kv_cache"] = (d["kv_cache"].float() * ramp[:, None]).to(torch.bfloat16)
    d["q_lat"] = (d["q_lat"].float() * 4).to(torch.bfloat16)
    res = checker.require(checker.check(DEC, case, backend="triton", options=dict(lazy=True, ksplit=ksplit), inputs=d))
    assert res.ran[-1].backend == "triton" and "lazy True" in res.ran[-1].notes


@pytest.mark.parametrize("shape", [
    dict(context=40, partitions=4, page_size=16),
    dict(context=3, partitions=16, page_size=0),                     # most partials empty
    dict(context=50, batch=3, ragged=True, T=2, partitions=4),       # ragged, two query rows a position
    dict(T=8, context=20, partitions=3, page_size=0),                # six row groups, a ticket each
    dict(dcp=4, dcp_layout="contiguous", context=21, batch=2, ragged=True, partitions=2, page_size=0),
    dict(kv_dtype="fp8", fp8_scale="token", context=45, batch=2, ragged=True, partitions=3, page_size=16),
], ids=lambda d: ",".join(f"{k}={v}" for k, v in d.items()))
def test_decode_fused_merge(shape):
    """`fuse_merge`: the split's last programs merge the partials (no merge kernel). Under the interpreter the last
    program to arrive merges every column; twice in a row, so the counters are back at zero after a call."""
    for seed in (0, 1):
        res = _check(DEC, options=dict(fuse_merge=True), seed=seed, **shape)
        assert "fuse_merge True" in res.ran[-1].notes


def test_fused_merge_rule():
    """`default_fuse_merge`: one new position from batch FUSE_MERGE_MIN_BATCH with more than one partial; the record
    says which form ran."""
    from k3lab_kernels.triton import mla_decode as md

    assert md.default_fuse_merge(4, md.FUSE_MERGE_MIN_BATCH) and md.default_fuse_merge(16, 32)
    assert not md.default_fuse_merge(132, md.FUSE_MERGE_MIN_BATCH - 1) and not md.default_fuse_merge(1, 64)
    assert not md.default_fuse_merge(8, 16, T=4)
    res = _check(DEC, batch=md.FUSE_MERGE_MIN_BATCH, context=40, partitions=2, page_size=16)
    assert "fuse_merge True" in res.ran[-1].notes
    res = _check(DEC, batch=2, context=40, partitions=2, page_size=16)
    assert "fuse_merge False" in res.ran[-1].notes


def test_decode_fused_merge_plan_and_refusals():
    """The mergers never outnumber the partials nor, over the pairs that merge at once, the SMs; 16-byte slices."""
    from k3lab import components
    from k3lab_kernels.triton import mla_decode as md

    for K in (2, 3, 16, 32, 100, 128, 264, 512):
        for seqs in (1, 8, 64):
            for rows in (12, 16, 6):
                NM, E, KB = md.fuse_plan(K, 512, rows, 132, False, seqs)
                assert 16 <= E <= 512 and 1 <= NM <= K and (NM == 1 or NM * seqs <= 132) and KB * E <= 8192
    assert md.fuse_plan(132, 512, 12, 132, False) == (96, 64, 128)  # batch 1 / 8K: a unit a merger
    assert md.fuse_plan(32, 512, 12, 132, False) == (24, 256, 32)   # batch 1 / 1K
    assert md.fuse_plan(128, 512, 12, 132, True)[0] == 1
    from k3lab.ops import mla as mla_ops

    case = DEC.case(context=40, partitions=4)
    d = DEC.make_inputs(case, 0, "cpu")
    args = (d["q_lat"], d["q_rope"], mla_ops._cache_of(d), d["lengths"])
    with pytest.raises(ValueError, match="fuse_merge"):
        components.mla.attend(*args, scale=0.1, backend="triton", partitions=4, merge=False, fuse_merge=True)
    with pytest.raises(ValueError, match="fuse_merge"):
        components.mla.attend(*args, scale=0.1, backend="reference", fuse_merge=True)
    with pytest.raises(ValueError, match="fuse_merge"):
        components.mla.attend(*args, scale=0.1, backend="triton", partitions=4, fuse_merge=1)


def test_decode_lazy_rule():
    """`default_lazy`: on for a verify of >= LAZY_MIN_T positions from batch LAZY_MIN_BATCH, off elsewhere; the run's
    record says which ran; DEFAULT_LAZY forces it."""
    from k3lab_kernels.triton import mla_decode as md

    assert md.default_lazy(md.LAZY_MIN_T, md.LAZY_MIN_BATCH)
    assert not md.default_lazy(md.LAZY_MIN_T - 1, 64) and not md.default_lazy(8, md.LAZY_MIN_BATCH - 1)
    assert not md.default_lazy(1, 64)
    res = _check(DEC, T=4, context=24, batch=md.LAZY_MIN_BATCH, partitions=1, page_size=0)
    assert "lazy True" in res.ran[-1].notes, res.ran[-1].notes
    res = _check(DEC, T=1, context=24, batch=2, partitions=1, page_size=0)
    assert "lazy False" in res.ran[-1].notes, res.ran[-1].notes


def test_decode_lazy_refused_where_it_does_not_apply():
    from k3lab.components.mla import MLAArgumentError

    with pytest.raises(MLAArgumentError, match="lazy"):
        _check(DEC, options=dict(lazy=1), context=8)
    with pytest.raises(MLAArgumentError, match="lazy"):
        _check(DEC, backend="reference", options=dict(lazy=True), context=8)
    # the Triton split's only: the CuTe decode's lazy form timed level and was removed (git history at 4088bad)
    assert set(DEC.option_axes["lazy"]) == {"triton"} and all("lazy" not in o for o in DEC.options("cute"))


def test_decode_reference_backends_agree():
    _check(DEC, backend="reference", context=30, dcp=2, partitions=3)


@pytest.mark.parametrize("shape", [
    dict(T=8, context=60, batch=2, ragged=True, partitions=3),  # 96 rows -> two groups of 64
    dict(T=8, heads=16, pad_heads=16, context=40, kv_dtype="fp8", fp8_scale="token", page_size=1),
], ids=lambda d: ",".join(f"{k}={v}" for k, v in d.items()))
def test_decode_T8_two_row_groups(shape):
    _check(DEC, **shape)


@pytest.mark.slow
@pytest.mark.parametrize("shape", [
    dict(context=1000, batch=1, partitions="auto", page_size=64),
    dict(context=300, batch=8, ragged=True, partitions="auto", kv_dtype="fp8", page_size=16, dcp=2),
    dict(context=200, heads=6, T=4, dcp=8, dcp_layout="contiguous", partitions=4, page_size=64),
], ids=lambda d: ",".join(f"{k}={v}" for k, v in d.items()))
def test_decode_larger(shape):
    _check(DEC, **shape)


@pytest.mark.parametrize("C,rows,block_c,block_k", [(512, 1, 128, 32), (512, 1, 32, 256), (96, 4, 64, 16)])
def test_merge_kernel_gpu_tiling(C, rows, block_c, block_k):
    """The merge at GPU tilings (one row, 128 or 32 columns, 32 or all partials a step; the interpreter's default
    takes 16 rows and all columns), and columns and rows that do not divide into the program's (C = 96 by 64, four
    rows a program over six), K = 40 with empty partials."""
    from k3lab.ref.mla import merge_stacked
    from k3lab_kernels.triton.mla_decode import merge_partials

    g = torch.Generator().manual_seed(2)
    o, lse = torch.randn(2, 40, 1, 3, C, generator=g), torch.randn(2, 40, 1, 3, generator=g) * 3
    o[:, 5:9], lse[:, 5:9] = 0.0, float("-inf")
    out, lo = torch.full((2, 1, 3, C), float("nan")), torch.full((2, 1, 3), float("nan"))
    merge_partials(o, lse, out, lo, rows=rows, block_c=block_c, block_k=block_k)
    wo, wl = merge_stacked(o.double(), lse.double())
    assert float((out.double() - wo).norm() / wo.norm()) < 1e-6
    assert float((lo.double() - wl).abs().max()) < 1e-5


def test_merge_kernel_rows_must_be_a_power_of_two():
    from k3lab_kernels.triton.mla_decode import merge_partials

    o, lse = torch.zeros(1, 4, 1, 3, 64), torch.zeros(1, 4, 1, 3)
    with pytest.raises(ValueError, match="rows must be a power of two"):
        merge_partials(o, lse, torch.empty(1, 1, 3, 64), torch.empty(1, 1, 3), rows=3)


# ---- combine -----------------------------------------------------------------------------------------

@pytest.mark.parametrize("shape", [
    dict(partitions=1),                                 # an already merged o_lat
    dict(partitions=8),                                 # with empty partials (lse = -inf)
    dict(partitions=2, dcp=4, heads=6, batch=3, T=2),   # pieces x shards
    dict(partitions=3, heads=16),
], ids=lambda d: ",".join(f"{k}={v}" for k, v in d.items()))
def test_combine(shape):
    _check(COMB, **shape)


@pytest.mark.parametrize("block_v", [16, 64])
def test_combine_block_v(block_v):
    _check(COMB, options=dict(block_v=block_v), partitions=2, batch=2, heads=6)


@pytest.mark.parametrize("block_r,batch", [(16, 1), (1, 3)])
def test_combine_both_paths(block_r, batch):
    """The tensor-core rows kernel forced at batch 1, the one-row kernel forced at 3 rows x T=2."""
    _check(COMB, options=dict(block_r=block_r), partitions=3, batch=batch, T=2, heads=6)


@pytest.mark.parametrize("premerge,block_r,partitions", [(True, 16, 3), (False, 1, 10)])
def test_combine_premerge(premerge, block_r, partitions, monkeypatch):
    """The split's merge kernel first on the rows path (premerge True), none on the one-row path over more than
    PREMERGE_ABOVE partials (False), against fp64."""
    from k3lab_kernels.triton import mla_decode

    calls, real = [], mla_decode.merge_partials
    monkeypatch.setattr(mla_decode, "merge_partials", lambda *a, **k: calls.append(1) or real(*a, **k))
    _check(COMB, options=dict(premerge=premerge, block_r=block_r), partitions=partitions, batch=3, T=1, heads=6)
    assert bool(calls) == premerge


def test_combine_premerge_refused_by_name():
    from k3lab.components import mla

    o, lse = torch.zeros(1, 2, 1, 2, 512), torch.zeros(1, 2, 1, 2)
    w_uv, gate = torch.zeros(2, 512, 128, dtype=torch.bfloat16), torch.zeros(1, 1, 256, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="'premerge'"):
        mla.combine(o, lse, w_uv, gate, backend="triton", premerge="yes")


@pytest.mark.slow
def test_combine_batch_over_one_row_block():
    _check(COMB, partitions=2, batch=40, T=2)  # 80 rows: two row blocks of 64


# ---- cache write ---------------------------------------------------------------------------------------

@pytest.mark.parametrize("page_size", [0, 1, 16, 64])
@pytest.mark.parametrize("kv", [("bf16", "tensor"), ("fp8", "tensor"), ("fp8", "token")])
def test_cache_write(page_size, kv):
    """Only the rows at lengths[b] .. lengths[b]+T-1 are written (everything else keeps its NaN poison),
    rounded once like the fp64 reference; per-token scales beside them."""
    _check(WRITE, kv_dtype=kv[0], fp8_scale=kv[1], page_size=page_size, batch=3, ragged=True, T=2, context=20)


@pytest.mark.parametrize("T", [1, 4])
def test_cache_write_T_and_empty_history(T):
    _check(WRITE, T=T, context=0, batch=2, page_size=16)


# ---- registry and bench ---------------------------------------------------------------------------------

def test_registry_entries():
    ops = {o.name for o in registry.ops_of("mla")}
    assert ops == {"mla_decode", "mla_combine", "mla_cache_write", "mla_query"}
    for op in registry.ops_of("mla"):
        assert op.floor_bw in ("read", "copy")
        assert op.test_file == ("tests/test_mla_query.py" if op.name == "mla_query" else "tests/test_mla_triton.py")
        want = {"reference", "torch_compile", "triton", "cute"} | ({"aiter"} if op.name == "mla_decode" else set())
        assert set(op.backends) == want
        for case in op.cases():
            assert op.nbytes(case) > 0 and op.flops(case) > 0
    # 32K context, batch 1, 12 heads, bf16: the cache alone is 37.7 MB
    c = DEC.case(context=32768, batch=1, heads=12, page_size=64)
    assert 37.7e6 < DEC.nbytes(c) < 38.0e6
    assert DEC.nbytes(DEC.case(kv_dtype="fp8", context=32768)) < 0.55 * DEC.nbytes(c)
    assert not DEC.valid(DEC.case(heads=16, pad_heads=6)) and not DEC.valid(DEC.case(dcp=1, dcp_layout="contiguous"))


def test_bench_runs_on_cpu():
    """`k3lab bench mla` end to end on the smallest grid (every op, the triton backend, no peers; the query step at
    a narrow width: at K3's (Q 1536 over 12 heads) the interpreter takes a minute)."""
    from k3lab.bench import runner

    bd = runner.run("mla", grid=dict(heads=(2,), batch=(1,), context=(16,), partitions=(2,), q_rank=(64,), nope=(16,),
                                     latent=(64,)), backends=("triton",), peers=False, reps=1, log=lambda s: None)
    rows = {r.extra["op"]: r for r in bd.rows}
    assert set(rows) == {"mla_decode", "mla_combine", "mla_cache_write", "mla_query"}
    assert all(r.error["ok"] for r in rows.values()), [r.error for r in rows.values()]


@pytest.mark.gpu
@pytest.mark.parametrize("shape", [
    dict(heads=12, batch=1, context=32768, page_size=64),
    dict(heads=12, batch=64, context=8192, page_size=64, partitions="auto"),
    dict(heads=12, batch=1, context=32768, T=4, page_size=64, kv_dtype="fp8"),
    dict(heads=6, batch=16, context=4096, ragged=True, dcp=8, page_size=1),
    # issue 12's longest histories: 128K in bf16, and 1M at batch 1 with the fp8 cache (per-position scales)
    dict(heads=12, batch=1, context=131072, page_size=64),
    dict(heads=12, batch=1, context=1 << 20, page_size=64, kv_dtype="fp8", fp8_scale="token"),
])
def test_decode_gpu_shapes(shape):
    _check(DEC, **shape)


@pytest.mark.gpu
@pytest.mark.parametrize("shape", [
    dict(heads=12, batch=1, context=32768, page_size=64),
    dict(heads=12, batch=4, context=32768, T=8, page_size=64, ragged=True),
    dict(heads=12, batch=64, context=8192, page_size=0, kv_dtype="fp8", fp8_scale="token"),
], ids=lambda d: ",".join(f"{k}={v}" for k, v in d.items()))
def test_decode_lazy_gpu(shape):
    """The lazy rescale at the GPU shapes it would run (issue 12's 32K, the long verify, batch 64)."""
    _check(DEC, options=dict(lazy=True), **shape)


@pytest.mark.gpu
@pytest.mark.parametrize("shape", [
    dict(heads=12, batch=1, context=1024, page_size=64),
    dict(heads=12, batch=1, context=8192, page_size=64),
    dict(heads=12, batch=1, context=131072, page_size=64),            # 264 partials, 128 mergers
    dict(heads=12, batch=2, context=32768, T=4, page_size=64, ragged=True),  # three row groups a sequence
    dict(heads=12, batch=8, context=8192, page_size=0, kv_dtype="fp8", fp8_scale="token"),
    dict(heads=12, batch=1, context=8192, dcp=4, page_size=1),
], ids=lambda d: ",".join(f"{k}={v}" for k, v in d.items()))
def test_decode_fused_merge_gpu(shape):
    """The merge inside the split with its waiting mergers (the GPU path), twice: the counters reset."""
    for seed in (0, 1):
        res = _check(DEC, options=dict(fuse_merge=True), seed=seed, **shape)
        assert "fuse_merge True" in res.ran[-1].notes



@pytest.mark.parametrize("options,case", [
    (dict(block_n=64, pdl=True), dict(context=200, page_size=64, partitions=2)),    # one page index a block
    (dict(block_n=16), dict(context=90, page_size=64, batch=2, ragged=True, partitions=3, T=2)),
    (dict(pdl=True), dict(context=150, page_size=16, partitions=100)),              # the merge's online steps
    (dict(preload_pages=0, pdl=False), dict(context=200, page_size=64, partitions=2)),  # index loaded a block
    # page indices preloaded 16 at a time: 300-position pieces of 19 pages take two steps of the outer loop
    (dict(preload_pages=16, block_n=16), dict(context=600, page_size=16, batch=2, ragged=True, partitions=2)),
    (dict(preload_pages=16, block_n=16), dict(context=90, page_size=16, partitions=2, kv_dtype="fp8",
                                              fp8_scale="token", T=2)),
    # pieces cut per sequence in the kernel (no host-side piece length): the ragged 600 / 1 histories
    (dict(host_chunk=False, preload_pages=16, block_n=16), dict(context=600, page_size=16, batch=2, ragged=True,
                                                                partitions=3)),
])
def test_decode_page_rows_and_pdl(options, case):
    """The one-index-per-block gather (page size a multiple of block_n, no DCP), with the piece's page indices
    preloaded before the block loop or loaded in it, and PDL (a GPU launch attribute: plain launches under the
    interpreter, the same result); the merge over more partials than it takes a step (one pass, a running
    max)."""
    _check(DEC, options=options, **case)


def test_combine_pdl():
    _check(COMB, options=dict(pdl=True), partitions=40, batch=3, heads=6)
    _check(COMB, options=dict(pdl=True), partitions=20, batch=1, heads=6)


def test_preload_and_block_n_rules():
    """Page indices preloaded 16 at a time from 2 blocks a piece (batch 1: 8K, 32K and 128K yes, 1K no; batch 64
    yes); block_n 64 only at batch >= 16 where nothing can be preloaded."""
    from k3lab_kernels.triton import mla_decode as kern

    assert kern.default_preload(1025, 33, 32) == 0 and kern.default_preload(8193, 132, 32) == 16
    assert kern.default_preload(32769, 132, 32) == kern.default_preload(131073, 264, 32) == 16
    assert kern.default_preload(8193, 4, 32) == 16
    assert kern.default_block_n(16, 64) == 32 and kern.default_block_n(16, 64, preload=False) == 64
    assert kern.default_block_n(16, 1, preload=False) == 32 and kern.default_block_n(64, 1) == 16
    # a contiguous cache's rows are streamed (32 positions, three stages) but for 32-row tiles from batch 16
    assert kern.streamed_rows(False, 16) and kern.streamed_rows(False, 16, B=8)
    assert kern.streamed_rows(False, 32, B=8) and not kern.streamed_rows(False, 32, B=16)
    assert kern.streamed_rows(True, 16, 1, 64, None) and not kern.streamed_rows(True, 16, 2, 64, None)
    assert not kern.streamed_rows(True, 16, 1, 16, None) and not kern.streamed_rows(True, 16, 1, 64, 0)
    assert kern.default_num_stages(0, contiguous=True) == 3 and kern.default_num_stages(0) == 2
    for B, T, paged, want in ((16, 1, False, (32, 3)), (1, 1, False, (32, 3)), (16, 1, True, (32, 3)),
                              (1, 4, False, (32, 3)), (8, 2, False, (32, 3)), (16, 4, False, (64, 2))):
        bf = torch.bfloat16
        kv = torch.zeros(B * 2, 64, 576, dtype=bf) if paged else torch.zeros(B, 128, 576, dtype=bf)
        bt = torch.arange(B * 2, dtype=torch.int32).view(B, 2) if paged else None
        plan: dict = {}
        kern.mla_decode(torch.zeros(B, T, 12, 512, dtype=bf), torch.zeros(B, T, 12, 64, dtype=bf), kv,
                        torch.full((B,), 100, dtype=torch.int32), scale=0.1, block_table=bt, partitions=1, n_max=101,
                        plan_out=plan)
        assert (plan["block_n"], plan["num_stages"]) == want, (B, paged, plan)


def test_ksplit_rule():
    """Four latent pieces for 16-row tiles, except on preloaded page indices with <= 2 blocks a piece (batch 1 / 8K
    / page 64); one for the verify's larger tiles."""
    from k3lab_kernels.triton import mla_decode as kern

    assert kern.default_ksplit(0, 2) == 4 and kern.default_ksplit(16, 8) == 4  # contiguous 8K; paged 32K
    assert kern.default_ksplit(16, 2) == 1 and kern.default_ksplit(0, 8, BM=64) == 1
    assert kern.default_ksplit(16, 8, BM=32) == 4 and kern.default_ksplit(0, 2, BM=32) == 4  # verify tiles
    assert kern.default_ksplit(16, 2, BM=32) == 1  # preloaded indices, two blocks a piece: as for 16 rows
    assert kern.ksplit_takes(512) and not kern.ksplit_takes(96) and not kern.ksplit_takes(32)


def test_block_m_rule():
    """32-row programs from batch 8 where they take fewer row groups (12 heads: T = 2 and 8; T = 4 from batch 16,
    where 64 rows for 48 still beat three 16-row passes over the cache); 16 at batch 1 and for T = 1."""
    from k3lab_kernels.triton import mla_decode as kern

    assert [kern.default_block_m(12 * T, 1) for T in (1, 2, 4, 8)] == [16, 16, 16, 16]
    assert [kern.default_block_m(12 * T, 8) for T in (1, 2, 4, 8)] == [16, 32, 16, 32]
    assert [kern.default_block_m(12 * T, 64) for T in (1, 2, 4, 8)] == [16, 32, 32, 32]
    assert kern.default_block_m(6 * 2, 64) == 16 and kern.default_block_m(16 * 2, 8) == 32  # TP16; padded heads
    assert kern.rows_per_program(8, 12, B=64) == (12, 32, 3) and kern.rows_per_program(8, 12, B=1) == (12, 16, 6)
    assert kern.rows_per_program(4, 12, block_m=64, B=64) == (12, 64, 1)
    # below batch 8: 32-row tiles for >= 96 rows over long histories (T = 8 at 12 heads, 32K), 16 otherwise
    assert [kern.default_block_m(12 * T, 1, 32768) for T in (1, 2, 4, 8)] == [16, 16, 16, 32]
    assert kern.default_block_m(96, 1, 8192) == 16 and kern.default_block_m(96, 4, 16384) == 32
    assert kern.default_block_m(96, 4, 8192) == 32 and kern.default_block_m(96, 2, 8192) == 16  # from batch 4
    assert kern.default_block_m(72, 1, 32768) == 16  # T = 6: three 32-row tiles would pad 96 rows for 72
    assert kern.default_block_m(6 * 8, 1, 32768) == 16 and kern.default_block_m(16 * 8, 2, 32768) == 32  # TP16; padded
    assert kern.rows_per_program(8, 12, B=1, n_max=32768) == (12, 32, 3)
    assert kern.default_partitions(1, 32768, T=8, sms=132) == kern.default_partitions(1, 32768, T=8, block_m=32,
                                                                                       sms=132)


def test_block_m_rule_follows_the_history_in_the_kernel(monkeypatch):
    """The split kernel's row tile reads n_max where given, else the cache's capacity (what the component sizes the
    partitions by): a T = 8 call over a 32K-position cache runs 32-row programs, over an 8K one 16-row programs."""
    from k3lab_kernels.triton import mla_decode as kern

    seen = []
    real = kern.rows_per_program
    monkeypatch.setattr(kern, "rows_per_program", lambda *a, **k: seen.append(real(*a, **k)) or seen[-1])

    class Stop(Exception):
        pass

    def stop(*a, **k):
        raise Stop

    monkeypatch.setattr(kern, "_mla_split_kernel", type("K", (), {"__getitem__": lambda self, g: stop})())
    for cap, n_max, want in ((32768, None, 32), (8192, None, 16), (32768, 4096, 16)):
        q_lat, q_rope = torch.zeros(1, 8, 12, 512), torch.zeros(1, 8, 12, 64)
        kv = torch.zeros(1, cap, 576, dtype=torch.bfloat16)
        with pytest.raises(Stop):
            kern.mla_decode(q_lat, q_rope, kv, torch.tensor([cap - 8], dtype=torch.int32), scale=1.0, partitions=4,
                            n_max=n_max)
        assert seen[-1][1] == want, (cap, n_max, seen[-1])


@pytest.mark.parametrize("shape", [
    dict(T=2, context=40, batch=9, ragged=True, partitions=2, page_size=16),   # one 32-row group (24 rows)
    pytest.param(dict(T=8, context=30, batch=8, ragged=True, partitions=3), marks=pytest.mark.slow),  # 3 x 32
], ids=lambda d: ",".join(f"{k}={v}" for k, v in d.items()))
def test_decode_batch_rule_32_rows(shape):
    """The batch >= 8 rule's 32-row programs against fp64 (ragged lengths, partitions)."""
    _check(DEC, **shape)


def test_partition_rule_by_batch():
    """`default_partitions` at 132 SMs, T = 1 at 12 heads: one block a piece up to one program an SM, all the slots
    once pieces keep >= 4 blocks (every batch: the forty-seventh session's one program an SM from batch 8 lost on the
    H200 and is gone); a verify (several row groups) keeps the slots rule."""
    from k3lab_kernels.triton import mla_decode as kern

    got = {(b, n): kern.default_partitions(b, n + 1, sms=132) for b in (1, 4, 8, 16, 32, 64) for n in (1024, 32768)}
    assert got == {(1, 1024): 33, (1, 32768): 132, (4, 1024): 33, (4, 32768): 66, (8, 1024): 16, (8, 32768): 33,
                   (16, 1024): 8, (16, 32768): 16, (32, 1024): 8, (32, 32768): 8, (64, 1024): 4, (64, 32768): 4}
    assert kern.default_partitions(8, 32769, T=4, sms=132) == 11  # 3 row groups: 2 * 132 // 24 slots, unchanged
    assert not hasattr(kern, "ONE_PER_SM_FROM") and kern.default_partitions(8, 100, sms=132) == 4  # one block a piece


def test_partition_limits_agree():
    from k3lab.components import mla as comp
    from k3lab_kernels.triton import mla_decode as kern

    assert comp.MAX_PARTITIONS == kern.MAX_PARTITIONS
