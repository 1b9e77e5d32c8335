"""The CuTe DSL MLA decode (kernels/cute/mla_decode.py) on the CPU emulator (tests/cute_emulate.py): the bulk copies
and their mbarrier ring, the tensor-core products (mma.sync m16n8k16, emulated warp-collectively with its PTX fragment
layouts), the online softmax and the cluster's merge in distributed shared memory, checked without a GPU through the
shared checker (fresh inputs, outputs poisoned, the fp64 reference, inputs unchanged; the registry's o_lat / lse
tolerances).

The kernel's partials (merge=False) are merged here in fp64 (the P > 1 merge is the Triton merge kernel, tested with
it); P = 1 writes o_lat / lse itself (the `direct` case). Shapes are small (tens of positions, clusters of 1..4) to
keep the emulated grids short; the per-thread work does not depend on the head count (always 16 MMA rows).
"""
import pytest
import torch

import cute_emulate as emulate
from k3lab import registry
from k3lab.harness import checker
from k3lab.ops.mla import SCALE

pytestmark = pytest.mark.cute_emu
DEC = registry.get("mla_decode")


def run(d, *, merge=False, pdl=False, early=None, seed=0, queries=None, **kw):
    """mla_decode on the emulator with the input dict's tensors; returns what the wrapper returned. queries: (q_lat,
    q_rope, the tensors they are views of) to pass strided views instead."""
    got = {}
    emulate._PDL["early"] = frozenset(t.data_ptr() for t in (early or []))
    q_lat, q_rope, bases = queries or (d["q_lat"], d["q_rope"], ())
    args = dict(q_lat=q_lat, q_rope=q_rope, kv=d["kv_cache"], lengths=d["lengths"], block_table=d.get("block_table"))
    if merge:
        args.update(o_lat=d["o_lat"], lse=d["lse"])
    words = _words(args)
    words.update({f"base{i}_words": t.reshape(-1).view(torch.int32) for i, t in enumerate(bases)})

    def call(m, **a):
        for k in words:
            a.pop(k)
        got["r"] = m.mod["mla_decode"].mla_decode(**a, scale=SCALE, merge=merge, pdl=pdl,
                                                  n_max=int(d["lengths"].max()) + 1, **kw)
    emulate._run(call, dict(args, **words), seed)
    return got["r"]


def _words(args):
    """The int32 views the wrapper makes (the bf16 pairs of q_lat, q_rope and the cache; int64 lengths' words),
    registered with the emulator beside the tensors."""
    return {f"{k}_words": v.reshape(-1).view(torch.int32) for k, v in args.items()
            if k in ("q_lat", "q_rope", "kv", "lengths") and isinstance(v, torch.Tensor) and v.dtype != torch.int32
            and v.is_contiguous() and v.dtype != torch.float32}


def strided(d):
    """The decode step's query views: q_lat the transpose of an [H, B, C] buffer, q_rope the rope slice of [B, H, Dn +
    Dr] rows (Dn = 128)."""
    B, _, H, C = d["q_lat"].shape
    Dr = d["q_rope"].shape[-1]
    ql = d["q_lat"][:, 0].transpose(0, 1).contiguous()          # [H, B, C]
    qr = torch.zeros(B, H, 128 + Dr, dtype=torch.bfloat16)
    qr[..., 128:] = d["q_rope"][:, 0]
    return ql.transpose(0, 1).unsqueeze(1), qr[..., 128:].unsqueeze(1), (ql, qr)


def impl(strided_q=False, **kw):
    def f(d):
        q = strided(d) if strided_q else None
        if kw.get("partitions") == 1:  # the kernel writes o_lat / lse itself
            run(d, merge=True, queries=q, **kw)
            return
        o, lse = run(d, queries=q, **kw)
        assert torch.isfinite(o).all(), "a partial holds NaN (an unwritten column?)"
        lse64 = lse.double()
        top = lse64.amax(dim=1, keepdim=True)
        w = torch.where(torch.isinf(lse64), torch.zeros_like(lse64), torch.exp(lse64 - top))
        d["o_lat"].copy_(((w.unsqueeze(-1) * o.double()).sum(1) / w.sum(1).unsqueeze(-1)).float())
        d["lse"].copy_((top.squeeze(1) + torch.log(w.sum(1))).float())
    f.__name__ = f"emulated cute mla_decode({kw})"
    return f


def check(seed=0, kw=None, inputs=None, **shape):
    base = dict(heads=12, batch=1, context=40, T=1, page_size=64, kv_dtype="bf16", fp8_scale="tensor", ragged=False,
                partitions="auto", pad_heads=0, dcp=1, dcp_layout="interleave")
    c = DEC.case(**dict(base, **shape))
    return checker.require(checker.check(DEC, c, impl=impl(**(kw or {})), seed=seed, device="cpu", inputs=inputs))


@pytest.mark.parametrize("pipe", [False, True])
def test_decode_growing_scores(pipe):
    """The running max's rescale on the registry's inputs, and on a history whose scores grow along the positions
    (the cache's rows times a ramp, the queries times 4), so the max moves in every chunk; both against fp64. (A lazy
    form of this rescale was built and timed level at batch 64: git history at 4088bad.)"""
    shape = dict(page_size=0, context=150, heads=6)
    kw = dict(cluster=1, partitions=1, stages=2, pipe=pipe)
    check(seed=21, kw=kw, **shape)
    c = DEC.case(**dict(heads=6, batch=1, context=150, T=1, page_size=0, kv_dtype="bf16", fp8_scale="tensor",
                        ragged=False, partitions="auto", pad_heads=0, dcp=1, dcp_layout="interleave"))
    d = DEC.make_inputs(c, 22, "cpu")
    ramp = 1.0 + torch.arange(d["kv_cache"].shape[1], dtype=torch.float32) / 6.0
    d["kv_cache"] = (d["kv_cache"].float() * ramp[:, None]).to(torch.bfloat16)
    d["q_lat"] = (d["q_lat"].float() * 4).to(torch.bfloat16)
    check(seed=22, kw=kw, inputs=d, **shape)


@pytest.mark.parametrize("shape,kw", [
    (dict(page_size=0, context=70), dict(cluster=2, partitions=2, stages=2)),   # contiguous, 4 pieces of 18
    (dict(page_size=16, batch=2, ragged=True, context=45, heads=5), dict(cluster=4, partitions=1, stages=2)),
    (dict(page_size=64, context=150, heads=6), dict(cluster=1, partitions=1, stages=2)),  # 5 chunks through 2 stages
    (dict(page_size=1, context=2, heads=3), dict(cluster=4, partitions=2, stages=3)),  # 3 positions, 8 pieces
], ids=["contig-cl2-p2", "page16-ragged-cl4-direct", "page64-ring-cl1", "page1-short-cl4-p2"])
def test_decode(shape, kw):
    check(seed=len(shape), kw=kw, **shape)


@pytest.mark.parametrize("shape,kw", [
    (dict(page_size=64, context=150, heads=6), dict(cluster=1, partitions=1, stages=2)),  # 5 chunks through 2 stages
    (dict(page_size=16, batch=2, ragged=True, context=45, heads=5), dict(cluster=2, partitions=2, stages=3)),
    (dict(page_size=1, context=2, heads=3), dict(cluster=4, partitions=2, stages=2)),  # empty pieces (no chunk)
], ids=["page64-ring-cl1", "page16-ragged-cl2-p2", "page1-short-cl4-p2"])
def test_decode_pipelined(shape, kw):
    """pipe=True (the pipelined chunk loop): the same checks, the ring reused, one-chunk and empty pieces."""
    check(seed=11 + len(shape), kw=dict(kw, pipe=True), **shape)


def test_strided_queries():
    """The queries as the decode step hands them (a transposed q_lat buffer, q_rope a slice of wider rows)."""
    check(seed=9, kw=dict(cluster=2, partitions=1, stages=2, strided_q=True), batch=3, heads=5, context=30,
          page_size=16)


def test_pdl_reads_nothing_before_the_wait():
    """pdl=True: every read after griddepcontrol.wait (nothing declared readable before it)."""
    check(seed=5, kw=dict(cluster=2, partitions=1, stages=2, pdl=True), context=20)
    assert emulate.LAST["launches"][-1]["use_pdl"] is True


def test_grid_and_cluster():
    d = DEC.make_inputs(DEC.case(heads=12, batch=1, context=30, T=1, page_size=16, kv_dtype="bf16",
                                 fp8_scale="tensor", ragged=False, partitions="auto", pad_heads=0, dcp=1,
                                 dcp_layout="interleave"), 0, "cpu")
    run(d, cluster=2, partitions=3, stages=2)
    launch = emulate.LAST["launches"][-1]
    assert launch["grid"] == (2, 3, 1) and launch["block"] == 256 and launch["cluster"] == (2, 1, 1)


@pytest.mark.parametrize("bad,match", [
    (dict(cluster=3), "'cluster' must be None or one of"),
    (dict(stages=5), "'stages' must be None or one of"),
    (dict(partitions=0), "'partitions' must be None or an int"),
    (dict(pdl=1), "'pdl' must be None or a bool"),
    (dict(q_lat=torch.zeros(1, 2, 12, 512, dtype=torch.bfloat16)), "T = 2: one new position only"),
    (dict(q_lat=torch.zeros(1, 1, 17, 512, dtype=torch.bfloat16)), "17 heads"),
    (dict(lengths=torch.zeros(1, dtype=torch.float32)), "'lengths' must have dtype"),
    (dict(q_rope=torch.zeros(1, 12, 1, 66, dtype=torch.bfloat16)[:, :, :, 2:].transpose(1, 2)),
     "'q_rope' must have batch and head strides that are multiples of 4"),
])
def test_arguments_named(bad, match):
    d = DEC.make_inputs(DEC.case(heads=12, batch=1, context=10, T=1, page_size=16, kv_dtype="bf16",
                                 fp8_scale="tensor", ragged=False, partitions="auto", pad_heads=0, dcp=1,
                                 dcp_layout="interleave"), 0, "cpu")
    args = dict(q_lat=d["q_lat"], q_rope=d["q_rope"], kv=d["kv_cache"], lengths=d["lengths"],
                block_table=d["block_table"])
    kw = {k: bad.pop(k) for k in ("cluster", "stages", "partitions", "pdl") if k in bad}
    args.update(bad)
    words = _words(args)

    def call(m, **a):
        for k in words:
            a.pop(k)
        m.mod["mla_decode"].mla_decode(**a, scale=SCALE, **kw)
    with pytest.raises(ValueError, match=match):
        emulate._run(call, dict(args, **words), 0)


def test_supports_names_the_limit():
    from k3lab_kernels.cute import mla_decode as kdm

    assert kdm.supports(dict(T=1, H=12)) is None
    assert "T = 4" in kdm.supports(dict(T=4, H=12))
    assert "fp8" in kdm.supports(dict(T=1, H=12, kv_dtype="fp8"))
    assert "dcp = 2" in kdm.supports(dict(T=1, H=12, dcp=2))
    assert kdm.default_cluster(1) == 4 and kdm.default_cluster(4) == 2
    assert kdm.default_partitions(1, 8192, 4, sms=132) == 16 and kdm.default_partitions(1, 8192, 8, sms=132) == 8
    assert kdm.default_partitions(4, 8192, 2, sms=132) == 16 and kdm.default_partitions(64, 8192, 2, sms=132) == 1
    assert kdm.default_partitions(1, 100, 4, sms=132) == 1


def test_shared_memory_bound():
    """smem_bytes is the kernel's allocation (the emulator's count, allocator alignment aside; the peers' columns of
    the real heads only), every cluster and stage count fits the H200's 227 KB a CTA, and two stages at 12 (or
    fewer) heads fit two CTAs an SM."""
    from k3lab_kernels.cute import mla_decode as kdm

    c = DEC.case(heads=4, batch=1, context=20, T=1, page_size=16, kv_dtype="bf16", fp8_scale="tensor", ragged=False,
                 partitions="auto", pad_heads=0, dcp=1, dcp_layout="interleave")
    d = DEC.make_inputs(c, 0, "cpu")
    run(d, cluster=2, partitions=1, stages=3)
    assert 0 <= kdm.smem_bytes(2, 3, 4) - emulate.LAST["max_smem"] <= 1024
    assert all(kdm.smem_bytes(c, s) <= 227 * 1024 for c in kdm.CLUSTERS for s in kdm.STAGES_ALLOWED)
    assert all(kdm.ctas_per_sm(c, 2, h) == 2 for c in kdm.CLUSTERS for h in (6, 12))
    assert kdm.ctas_per_sm(4, 2, 16) == 1 and kdm.ctas_per_sm(4, 4, 12) == 1
    one, two = (kdm.default_partitions(1, 8192, 4, sms=132, per_sm=k) for k in (1, 2))
    assert (one, two) == (16, 33)  # clusters of 4 over half the SMs' worth of slots, doubled


def test_default_loop_by_history():
    """Two stages and the pipelined loop from LONG_HISTORY positions (measured at 8K and 32K), four and plain below."""
    from k3lab_kernels.cute import mla_decode as md

    assert md.default_loop(8192) == (4, False)
    assert md.default_loop(32768) == (2, True)
    assert md.default_loop(md.LONG_HISTORY) == (2, True)
    assert md.ctas_per_sm(2, 2, 12) == 2 and md.ctas_per_sm(2, 4, 12) == 1
