"""k3lab.bench.peers_mla: FlashInfer's batch MLA paged decode as a peer.

CPU: the pure-torch parts (paging a contiguous cache and back, the CSR metadata, the lse base conversion,
head padding, clear errors for what the adapter does not take). GPU (H200, marker `gpu`): the peer on
fa3 and fa2 against an fp32 torch reference of the absorbed attention, eagerly and replayed from a CUDA
graph; skipped when FlashInfer's MLA decode is not available."""
from __future__ import annotations

import math

import pytest
import torch

from k3lab.bench import peers_mla as pm

SCALE = 192 ** -0.5


def _cache(B, S, seed=0, dtype=torch.bfloat16, device="cpu"):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(B, S, pm.ENTRY, generator=g).to(dtype=dtype, device=device)


# ---- paging ------------------------------------------------------------------------------------------

@pytest.mark.parametrize("page_size", [1, 7, 64, 300])
@pytest.mark.parametrize("lengths", [None, [1, 64, 200]])
def test_from_contiguous_round_trips(page_size, lengths):
    cache = _cache(3, 200)
    pool, table = pm.from_contiguous(cache, lengths, page_size, seed=3)
    lens = [200] * 3 if lengths is None else lengths
    assert table.dtype == torch.int32 and table.shape[0] == 3
    assert pool.shape[1:] == (page_size, pm.ENTRY)
    back = pm.to_contiguous(pool, table, lens, capacity=200)
    for b, n in enumerate(lens):
        assert torch.equal(back[b, :n], cache[b, :n])
        assert not back[b, n:].any()
    # every live page is used once, and each holds its slice of the contiguous cache
    live = [int(table[b, j]) for b, n in enumerate(lens) for j in range(-(-n // page_size))]
    assert len(set(live)) == len(live) == pool.shape[0]
    for b, n in enumerate(lens):
        for j in range(-(-n // page_size)):
            lo, hi = j * page_size, min((j + 1) * page_size, 200)
            assert torch.equal(pool[int(table[b, j]), : hi - lo], cache[b, lo:hi])


def test_block_table_is_shuffled_and_spare_pages_unused():
    cache = _cache(2, 512)
    pool, table = pm.from_contiguous(cache, [512, 300], 64, seed=1, spare_pages=5)
    assert pool.shape[0] == 8 + 5 + 5
    live = torch.cat([table[0, :8], table[1, :5]]).tolist()
    assert live != sorted(live) and live != list(range(len(live)))  # not trivially contiguous
    assert len(set(live)) == 13 and max(live) < pool.shape[0]
    spare = sorted(set(range(pool.shape[0])) - set(live))
    assert len(spare) == 5 and not pool[spare].any()
    assert table[1, 5:].tolist() == [0, 0, 0]  # past a sequence's pages: a valid id, never read
    p2, t2 = pm.from_contiguous(cache, [512, 300], 64, seed=1, spare_pages=5)
    assert torch.equal(t2, table) and torch.equal(p2, pool)  # seeded


def test_from_contiguous_refuses_bad_input():
    with pytest.raises(ValueError, match="exceed the cache capacity"):
        pm.from_contiguous(_cache(2, 100), [10, 101], 64)
    with pytest.raises(ValueError, match="page_size"):
        pm.from_contiguous(_cache(2, 100), [10, 10], 0)
    with pytest.raises(ValueError, match=r"\[B, S_max, width\]"):
        pm.from_contiguous(torch.zeros(100, pm.ENTRY), None, 64)
    with pytest.raises(ValueError, match="entries for a batch of 2"):
        pm.from_contiguous(_cache(2, 100), [10], 64)


def test_csr_metadata_by_hand():
    table = torch.tensor([[5, 2, 9, 0], [7, 1, 0, 0], [3, 4, 6, 8]], dtype=torch.int32)
    qo, kvp, kvi, kvl = pm.csr_metadata(table, torch.tensor([129, 64, 1]), 64)
    assert qo.tolist() == [0, 1, 2, 3]
    assert kvp.tolist() == [0, 3, 4, 5]
    assert kvi.tolist() == [5, 2, 9, 7, 3]
    assert kvl.tolist() == [129, 64, 1]
    assert all(t.dtype == torch.int32 and t.device.type == "cpu" for t in (qo, kvp, kvi, kvl))
    _, kvp, kvi, _ = pm.csr_metadata(table, [0, 1, 0], 64)  # an empty sequence has no pages
    assert kvp.tolist() == [0, 0, 1, 1] and kvi.tolist() == [7]
    with pytest.raises(ValueError, match="holds 4 pages a sequence"):
        pm.csr_metadata(table, [257, 1, 1], 64)


# ---- lse and heads -----------------------------------------------------------------------------------

def test_lse_base2_converts_to_natural():
    s = torch.randn(4, 12, 300, dtype=torch.float64) * 3
    natural = torch.logsumexp(s, -1)
    # log2 sum exp(s), as FlashInfer writes it by default: log2 sum 2^(s log2 e)
    base2 = torch.log2(torch.exp2(s * math.log2(math.e)).sum(-1))
    assert torch.allclose(pm.lse_to_natural(base2, "base2").double(), natural, atol=1e-5)
    assert torch.allclose(pm.lse_to_natural(natural.float(), "basee").double(), natural, atol=1e-5)
    assert pm.lse_to_natural(natural, "none") is None
    ninf = torch.full((2, 3), -math.inf)
    assert torch.isneginf(pm.lse_to_natural(ninf, "base2")).all()
    with pytest.raises(ValueError, match="lse mode"):
        pm.lse_to_natural(natural, "log10")


def test_pad_queries_and_drop_heads():
    q, r = torch.randn(2, 12, 512), torch.randn(2, 12, 64)
    qn, qp = pm.pad_queries(q, r, 16)
    assert qn.shape == (2, 16, 512) and qp.shape == (2, 16, 64)
    assert torch.equal(qn[:, :12], q) and not qn[:, 12:].any() and not qp[:, 12:].any()
    out, lse2 = torch.randn(2, 16, 512), torch.randn(2, 16)
    o, lse = pm.to_ours(out, lse2, 12, "base2")
    assert torch.equal(o, out[:, :12]) and torch.allclose(lse, lse2[:, :12] * math.log(2))
    assert o.data_ptr() != out.data_ptr()  # a copy: later replays do not change it
    assert pm.to_ours(out, None, 12, "none")[1] is None
    with pytest.raises(ValueError, match="pad_heads"):
        pm.pad_queries(q, r, 8)


# ---- clear errors ------------------------------------------------------------------------------------

def _inputs(B=2, H=2, page=8, n_pages=6, max_pages=3):
    return dict(q_lat=torch.zeros(B, H, 512, dtype=torch.bfloat16), q_rope=torch.zeros(B, H, 64, dtype=torch.bfloat16),
                ckv_pages=torch.zeros(n_pages, page, pm.ENTRY, dtype=torch.bfloat16), kpe_pages=None,
                block_table=torch.arange(B * max_pages, dtype=torch.int32).view(B, max_pages),
                lengths=torch.tensor([5, 17][:B]), scale=SCALE)


def _bad(**change):
    kw = _inputs()
    kw.update(change)
    return kw


BAD = [
    ("T = 1 decode", _bad(q_lat=torch.zeros(2, 3, 2, 512, dtype=torch.bfloat16))),
    (r"q_lat must be \[B, H, 512\]", _bad(q_lat=torch.zeros(2, 2, 128, dtype=torch.bfloat16))),
    (r"q_rope must be \[B, H, 64\]", _bad(q_rope=torch.zeros(2, 3, 64, dtype=torch.bfloat16))),
    ("bf16 or fp16 queries", _bad(q_lat=torch.zeros(2, 2, 512), q_rope=torch.zeros(2, 2, 64))),
    ("in the query dtype", _bad(ckv_pages=torch.zeros(6, 8, pm.ENTRY, dtype=torch.float16))),
    (r"\[n_pages, page_size, 576\]", _bad(ckv_pages=torch.zeros(6, 8, 512, dtype=torch.bfloat16))),
    ("must share", _bad(ckv_pages=torch.zeros(6, 8, 512, dtype=torch.bfloat16),
                        kpe_pages=torch.zeros(6, 4, 64, dtype=torch.bfloat16))),
    ("holds 3 pages a sequence", _bad(lengths=[5, 25])),
    ("lengths must be >= 0", _bad(lengths=[5, -1])),
    ("entries for a batch of 2", _bad(lengths=[5])),
    ("outside the pool", _bad(block_table=torch.tensor([[0, 1, 2], [3, 40, 5]], dtype=torch.int32))),
    (r"block_table must be \[B = 2", _bad(block_table=torch.zeros(3, 3, dtype=torch.int32))),
    ("scale must be", _bad(scale=float("nan"))),
]


@pytest.mark.parametrize("why,kw", BAD, ids=[b[0] for b in BAD])
def test_unsupported_shapes_are_refused_clearly(why, kw):
    with pytest.raises(ValueError, match=why):
        pm.FlashInferMLADecode(**kw)


def test_bad_options_are_refused_clearly():
    with pytest.raises(ValueError, match="backend must be one of"):
        pm.FlashInferMLADecode(**_inputs(), backend="xqa")
    with pytest.raises(ValueError, match="pad_heads"):
        pm.FlashInferMLADecode(**_inputs(), pad_heads=1)
    with pytest.raises(ValueError, match="lse_mode"):
        pm.FlashInferMLADecode(**_inputs(), lse_mode="base10")
    with pytest.raises(ValueError, match=r"cache must be \[B, S_max, 576\]"):
        pm.FlashInferMLADecode.from_contiguous_cache(torch.zeros(1, 2, 512, dtype=torch.bfloat16),
                                                     torch.zeros(1, 2, 64, dtype=torch.bfloat16),
                                                     torch.zeros(1, 9, 512, dtype=torch.bfloat16), [3], SCALE)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU refusal")
def test_cpu_tensors_and_no_gpu_are_reported():
    with pytest.raises(ValueError, match="CUDA tensors"):
        pm.FlashInferMLADecode(**_inputs())
    for backend in pm.BACKENDS:
        ok, why = pm.flashinfer_mla_available(backend)
        assert not ok and "GPU" in why
    ok, why = pm.flashinfer_mla_available("trtllm-gen")
    assert not ok and "backend must be one of" in why


# ---- GPU: against fp32 --------------------------------------------------------------------------------

def reference(q_lat, q_rope, cache, lengths, scale):
    """fp32 absorbed attention over the valid positions: (o_lat [B, H, 512], lse [B, H] natural log)."""
    B, H, _ = q_lat.shape
    o = torch.zeros(B, H, pm.C_DIM, dtype=torch.float32, device=q_lat.device)
    lse = torch.full((B, H), -math.inf, dtype=torch.float32, device=q_lat.device)
    for b, n in enumerate(lengths):
        if n == 0:
            continue
        c, kr = cache[b, :n, : pm.C_DIM].float(), cache[b, :n, pm.C_DIM:].float()
        s = (q_lat[b].float() @ c.T + q_rope[b].float() @ kr.T) * scale  # [H, n]
        lse[b] = torch.logsumexp(s, -1)
        o[b] = torch.softmax(s, -1) @ c
    return o, lse


def _gpu_case(B, H, lengths, seed=0, garbage=6.0):
    """Queries and a contiguous cache whose positions past each length hold large values (reading them
    would move the result far off)."""
    dev = "cuda"
    S = max(lengths) + 37
    g = torch.Generator().manual_seed(seed)
    q_lat = (torch.randn(B, H, 512, generator=g) * 0.5).to(torch.bfloat16).to(dev)
    q_rope = (torch.randn(B, H, 64, generator=g) * 0.5).to(torch.bfloat16).to(dev)
    cache = _cache(B, S, seed + 1, device=dev)
    for b, n in enumerate(lengths):
        cache[b, n:] = garbage
    return q_lat, q_rope, cache


def _check(got, want):
    o, lse = got
    wo, wl = want
    assert torch.isfinite(o.float()).all()
    rel = (o.float() - wo).abs().max().item() / wo.abs().max().item()
    assert rel < 2e-2, f"o_lat max error {rel:.3g} of max |o|"
    if lse is not None:
        err = (lse - wl).abs().max().item()
        assert err < 2e-2, f"lse max error {err:.3g}"


def _skip_unless(backend):
    ok, why = pm.flashinfer_mla_available(backend)
    if not ok:
        pytest.skip(why)


@pytest.mark.gpu
@pytest.mark.parametrize("backend", pm.BACKENDS)
@pytest.mark.parametrize("heads", [12, 16])
@pytest.mark.parametrize("lengths", [[777], [1, 130, 2049]], ids=["b1", "b3_ragged"])
def test_flashinfer_mla_matches_fp32(backend, heads, lengths):
    _skip_unless(backend)
    q_lat, q_rope, cache = _gpu_case(len(lengths), heads, lengths)
    pool, table = pm.from_contiguous(cache, lengths, 64, seed=2)
    peer = pm.FlashInferMLADecode(q_lat, q_rope, pool, None, table, torch.tensor(lengths), SCALE, backend=backend)
    peer.out.fill_(float("nan"))
    peer()
    torch.cuda.synchronize()
    _check(peer.result(), reference(q_lat, q_rope, cache, lengths, SCALE))


@pytest.mark.gpu
@pytest.mark.parametrize("backend", pm.BACKENDS)
def test_flashinfer_mla_replays_from_a_cuda_graph(backend):
    """Captured after plan; queries updated in place between replays are seen (read in place)."""
    _skip_unless(backend)
    lengths = [1, 130, 2049]
    q_lat, q_rope, cache = _gpu_case(3, 12, lengths)
    peer = pm.FlashInferMLADecode.from_contiguous_cache(q_lat, q_rope, cache, lengths, SCALE, page_size=64,
                                                        backend=backend)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        peer()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        peer()
    for seed in (5, 6):
        q2, r2, _ = _gpu_case(3, 12, lengths, seed=seed)
        q_lat.copy_(q2)
        q_rope.copy_(r2)
        peer.out.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        _check(peer.result(), reference(q_lat, q_rope, cache, lengths, SCALE))


@pytest.mark.gpu
@pytest.mark.parametrize("backend", pm.BACKENDS)
def test_flashinfer_mla_padded_heads_and_lse_modes(backend):
    _skip_unless(backend)
    lengths = [300, 65]
    q_lat, q_rope, cache = _gpu_case(2, 12, lengths)
    want = reference(q_lat, q_rope, cache, lengths, SCALE)
    pool, table = pm.from_contiguous(cache, lengths, 64)
    for lse_mode in ("basee", "none"):
        peer = pm.FlashInferMLADecode(q_lat, q_rope, pool, None, table, lengths, SCALE, backend=backend,
                                      pad_heads=16, lse_mode=lse_mode)
        peer()
        torch.cuda.synchronize()
        o, lse = peer.result()
        assert o.shape == (2, 12, 512) and (lse is None) == (lse_mode == "none")
        _check((o, lse), want)


@pytest.mark.gpu
@pytest.mark.parametrize("backend", pm.BACKENDS)
def test_flashinfer_mla_contiguous_cache_in_place(backend):
    """page_size=None: the contiguous cache read in place as one page of S_max rows a sequence."""
    _skip_unless(backend)
    lengths = [1, 130, 2049]
    q_lat, q_rope, cache = _gpu_case(3, 16, lengths)
    peer = pm.FlashInferMLADecode.from_contiguous_cache(q_lat, q_rope, cache, lengths, SCALE, page_size=None,
                                                        backend=backend)
    peer()
    torch.cuda.synchronize()
    _check(peer.result(), reference(q_lat, q_rope, cache, lengths, SCALE))
