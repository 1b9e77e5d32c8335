"""The CuTe DSL MLA cache write (kernels/cute/mla_cache_write.py) on the GPU, through the component API
(k3lab.components.mla.write_cache, backend "cute").

Needs nvidia-cutlass-dsl and a CUDA GPU of compute capability >= 9.0; skipped cleanly otherwise. The shared
checker (k3lab.harness.checker) against fp64: the cache and per-token scales poisoned with NaN, only the rows
at lengths[b] .. lengths[b]+T-1 written, each rounded once to the cache format (tolerances: k3lab/ops/mla.py),
inputs unchanged; bf16 and fp8 (per-tensor, per-token scales), contiguous and paged 1 / 16 / 64, T 1 and 4,
batch 1, 5 and 64 (ragged). Then bit-equality with the triton backend on the same inputs (the CuTe kernel
repeats the Triton kernel's fp32 operations and their order: its module doc), with and without pdl, int64
lengths, a strided kv, and a CUDA-graph replay.
"""
import pytest
import torch
from cute_gate import require_cute_gpu

pytestmark = [pytest.mark.cute, pytest.mark.gpu]
require_cute_gpu()

from k3lab import registry  # noqa: E402
from k3lab.components import mla as comp  # noqa: E402
from k3lab.harness import checker  # noqa: E402
from k3lab.harness.checker import clone_inputs  # noqa: E402
from k3lab.ops import mla as om  # noqa: E402

WRITE = registry.get("mla_cache_write")
FORMATS = [("bf16", "tensor"), ("fp8", "tensor"), ("fp8", "token")]
PAGES = [0, 1, 16, 64]
BATCHES = [1, 5, 64]


def case(kv, page_size, batch, T, context=300):
    return WRITE.case(kv_dtype=kv[0], fp8_scale=kv[1], page_size=page_size, batch=batch, T=T, context=context,
                      ragged=batch > 1)


@pytest.mark.parametrize("T", [1, 4])
@pytest.mark.parametrize("batch", BATCHES)
@pytest.mark.parametrize("page_size", PAGES)
@pytest.mark.parametrize("kv", FORMATS, ids=lambda k: "-".join(k))
def test_matches_fp64(kv, page_size, batch, T):
    c = case(kv, page_size, batch, T)
    res = checker.require(checker.check(WRITE, c, backend="cute", options={"pdl": False}, seed=batch + T))
    assert res.ran and res.ran[-1].backend == "cute" and res.ran[-1].options == {"pdl": False}


def _write(d, backend, **kw):
    comp.write_cache(d["kv"], d["kv_norm"], om._cache_of(d, "token_scale"), d["lengths"], eps=1e-6,
                     backend=backend, check_values=False, **kw)


def _same(a, b):
    """The caches (and per-token scales) of two input dicts hold the same bytes (NaN poison included)."""
    for k in ("kv_cache", "token_scale"):
        x, y = a[k], b[k]
        if x.numel():
            assert torch.equal(x.reshape(-1).view(torch.uint8), y.reshape(-1).view(torch.uint8)), k


def _pair(c, seed, **cute_kw):
    d = WRITE.make_inputs(c, seed, "cuda")
    a, b = clone_inputs(d), clone_inputs(d)
    _write(a, "triton")
    _write(b, "cute", **cute_kw)
    torch.cuda.synchronize()
    return a, b


@pytest.mark.parametrize("T", [1, 4])
@pytest.mark.parametrize("batch", BATCHES)
@pytest.mark.parametrize("page_size", PAGES)
@pytest.mark.parametrize("kv", FORMATS, ids=lambda k: "-".join(k))
def test_bit_equal_to_triton(kv, page_size, batch, T):
    _same(*_pair(case(kv, page_size, batch, T), seed=7 * batch + T))


@pytest.mark.parametrize("page_size", [0, 64])
@pytest.mark.parametrize("kv", FORMATS, ids=lambda k: "-".join(k))
def test_pdl_bit_equal(kv, page_size):
    _same(*_pair(case(kv, page_size, 64, 4), seed=3, pdl=True))
    _same(*_pair(case(kv, page_size, 1, 1), seed=4, pdl=True))


@pytest.mark.parametrize("kv", FORMATS, ids=lambda k: "-".join(k))
def test_int64_lengths_and_strided_kv(kv):
    d = WRITE.make_inputs(case(kv, 16, 5, 4), 11, "cuda")
    a, b = clone_inputs(d), clone_inputs(d)
    _write(a, "triton")
    wide = torch.full((5, 4, 640), float("nan"), dtype=torch.bfloat16, device="cuda")
    wide[..., 64:] = b["kv"]
    b["kv"], b["lengths"] = wide[..., 64:], b["lengths"].long()
    _write(b, "cute")
    torch.cuda.synchronize()
    _same(a, b)


def test_cuda_graph_replay():
    """Compiled once, captured in a CUDA graph, replayed on new kv: the same bytes as a direct call."""
    c = case(FORMATS[2], 64, 5, 2)
    d = WRITE.make_inputs(c, 0, "cuda")
    g_in, direct = clone_inputs(d), clone_inputs(d)
    _write(g_in, "cute")  # compile outside the capture
    graph = torch.cuda.CUDAGraph()
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s), torch.cuda.graph(graph, stream=s):
        _write(g_in, "cute")
    torch.cuda.current_stream().wait_stream(s)
    new_kv = torch.randn_like(d["kv"], dtype=torch.float32).to(d["kv"].dtype)
    g_in["kv"].copy_(new_kv)
    direct["kv"].copy_(new_kv)
    graph.replay()
    _write(direct, "cute")
    torch.cuda.synchronize()
    _same(g_in, direct)


# ---- the combine (kernels/cute/mla_combine.py) ---------------------------------------------------------

COMB = registry.get("mla_combine")


@pytest.mark.parametrize("shape", [
    dict(batch=1, T=1, partitions=1), dict(batch=1, T=1, partitions=132), dict(batch=1, T=2, partitions=8),
    dict(batch=64, T=1, partitions=4), dict(batch=8, T=4, partitions=2, dcp=2), dict(batch=5, T=3, partitions=3),
], ids=lambda d: ",".join(f"{k}={v}" for k, v in d.items()))
@pytest.mark.parametrize("pdl", [False, True])
def test_combine_matches_fp64(shape, pdl):
    """12 heads, K3's C = 512 and Dv = 128: one partial, many (batch 1), rows in blocks of four with a part-empty
    last block, pieces x shards; with and without pdl."""
    c = COMB.case(**dict(dict(heads=12, dcp=1), **shape))
    checker.require(checker.check(COMB, c, backend="cute", options=dict(pdl=pdl), seed=len(shape) + pdl))


@pytest.mark.parametrize("block_r", [1, 2, 4, 8])
def test_combine_block_r(block_r):
    checker.require(checker.check(COMB, COMB.case(heads=12, batch=9, T=1, partitions=4, dcp=1), backend="cute",
                                  options=dict(block_r=block_r), seed=block_r))


# ---- the decode attention (kernels/cute/mla_decode.py) ---------------------------------------------------

DEC = registry.get("mla_decode")


def dec_case(**shape):
    base = dict(heads=12, batch=1, context=300, T=1, page_size=64, kv_dtype="bf16", fp8_scale="tensor", ragged=False,
                partitions="auto", pad_heads=0, dcp=1, dcp_layout="interleave")
    return DEC.case(**dict(base, **shape))


@pytest.mark.parametrize("shape,opts", [
    (dict(), dict()),                                                            # auto partitions, cluster 8
    (dict(context=8192), dict(cluster=4)),
    (dict(context=5000, page_size=0), dict(cluster=2, stages=2)),                # contiguous cache
    (dict(context=1000, page_size=16, batch=5, ragged=True), dict(cluster=4)),   # ragged, short sequences
    (dict(context=200, page_size=1, heads=6), dict(cluster=1, stages=3)),        # TP16's heads, page 1
    (dict(context=3, heads=16, partitions=4), dict(cluster=8)),                  # 4 positions over 32 pieces
    (dict(context=4096, batch=64, ragged=True), dict(cluster=2)),
    (dict(context=2048, partitions=1), dict(pdl=True)),                          # P = 1 writes o_lat / lse itself
    (dict(context=8192), dict(pipe=True)),                                       # the pipelined chunk loop
    (dict(context=1000, page_size=16, batch=5, ragged=True), dict(cluster=4, pipe=True, stages=2)),
    (dict(context=4096, batch=64, ragged=True), dict(cluster=2, pipe=True, pdl=True)),
    (dict(context=3, heads=16, partitions=4), dict(cluster=8, pipe=True)),       # empty pieces
    (dict(context=8192), dict(cluster=4, stages=2)),                             # two CTAs an SM, 33 clusters
    (dict(context=8192, heads=6), dict(cluster=4, stages=2, pipe=True)),
    (dict(context=32768, batch=4, ragged=True), dict(cluster=2, pipe=True)),       # ragged long histories
], ids=lambda d: ",".join(f"{k}={v}" for k, v in d.items()) or "default")
def test_decode_matches_fp64(shape, opts):
    res = checker.require(checker.check(DEC, dec_case(**shape), backend="cute", options=opts, seed=len(shape)))
    assert res.ran and res.ran[-1].backend == "cute"


def test_decode_strided_queries():
    """The queries as the decode step hands them: q_lat a transpose of an [H, B, C] buffer, q_rope the rope slice of
    [B, H, Dn + Dr] rows (the kernel takes batch and head strides)."""
    c = dec_case(batch=64, context=4096, ragged=True)
    d = DEC.make_inputs(c, 3, "cuda")
    ref_o, ref_l = comp.attend(d["q_lat"], d["q_rope"], om._cache_of(d), d["lengths"], scale=om.SCALE,
                               backend="cute", check_values=False, n_positions=c["context"] + 1)
    B, _, H, C = d["q_lat"].shape
    ql = d["q_lat"][:, 0].transpose(0, 1).contiguous()
    qr = torch.zeros(B, H, 128 + 64, dtype=torch.bfloat16, device="cuda")
    qr[..., 128:] = d["q_rope"][:, 0]
    o, lse = comp.attend(ql.transpose(0, 1).unsqueeze(1), qr[..., 128:].unsqueeze(1), om._cache_of(d), d["lengths"],
                         scale=om.SCALE, backend="cute", check_values=False, n_positions=c["context"] + 1)
    torch.cuda.synchronize()
    assert torch.equal(o, ref_o) and torch.equal(lse, ref_l)


def test_decode_refuses_what_it_cannot_take():
    from k3lab.switches import BackendUnavailable

    d = DEC.make_inputs(dec_case(T=2), 0, "cuda")
    with pytest.raises(BackendUnavailable, match="T = 2"):
        comp.attend(d["q_lat"], d["q_rope"], om._cache_of(d), d["lengths"], scale=om.SCALE, backend="cute")
    d = DEC.make_inputs(dec_case(kv_dtype="fp8"), 0, "cuda")
    with pytest.raises(BackendUnavailable, match="bf16 caches only"):
        comp.attend(d["q_lat"], d["q_rope"], om._cache_of(d), d["lengths"], scale=om.SCALE, backend="cute")
    d = DEC.make_inputs(dec_case(), 0, "cuda")
    with pytest.raises(comp.MLAArgumentError, match="lazy"):  # the Triton split's option only
        comp.attend(d["q_lat"], d["q_rope"], om._cache_of(d), d["lengths"], scale=om.SCALE, backend="cute", lazy=True)


def test_layer_decode_on_cute_matches_triton():
    """The layer API (decode) on cute: the CuTe cache write, decode and combine, against the triton layer on the same
    inputs (K3's widths at TP8: 12 heads, C 512, Dr 64; bf16 both ways, the same rounding points)."""
    from k3lab.config import preset
    from k3lab.ref import mla as ref
    from k3lab.weights import make_mla_attn

    view = preset("tp8", batch=3)
    w = make_mla_attn(view, 3, 0, device="cuda")
    g = torch.Generator(device="cuda").manual_seed(0)
    ctx = 700
    cache = ref.MLACache.empty(3, ctx + 1, w.entry_width, dtype=torch.bfloat16, device="cuda")
    cache.write(torch.zeros(3, dtype=torch.long, device="cuda"),
                torch.randn(3, ctx, w.entry_width, generator=g, device="cuda").bfloat16())
    lengths = torch.tensor([ctx, 5, 0], device="cuda")
    h = torch.randn(3, view.cfg.hidden_size, generator=g, device="cuda").bfloat16()
    c_tri, c_cute = cache.clone(), cache.clone()
    ran = []
    y_tri = comp.decode(h, w, c_tri, lengths, backend="triton", partitions=None)
    y = comp.decode(h, w, c_cute, lengths, backend="cute", partitions=None, ran=ran)
    torch.cuda.synchronize()
    assert [(r.op, r.backend) for r in ran] == [("mla_cache_write", "cute"), ("mla_decode", "cute"),
                                                ("mla_combine", "cute")]
    assert torch.equal(c_cute.data, c_tri.data)  # the two cache writes agree bit for bit (test_bit_equal_to_triton)
    rel = float((y.float() - y_tri.float()).norm() / y_tri.float().norm())
    assert rel < 1e-2, rel  # both round P and the combine's input to bf16, in different orders
