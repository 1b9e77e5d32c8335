"""MLA reference: absorbed == non-absorbed == explicit loops; split-KV, DCP, head padding and multi-token
verify all equal the plain form in float64; the fp8 cache stays close."""
import math

import pytest
import torch

from k3lab.config import preset
from k3lab.ref import mla
from k3lab.weights import make_mla_attn

D64 = torch.float64


def _setup(batch=2, ctx=13, seed=0):
    view = preset("tiny", batch=batch)
    w = make_mla_attn(view, 3, seed, dtype=D64)
    g = torch.Generator().manual_seed(seed)
    cache = mla.MLACache.empty(batch, ctx + 8, w.entry_width, dtype=D64)
    hist = torch.randn(batch, ctx, w.entry_width, generator=g, dtype=D64)
    cache.write(torch.zeros(batch, dtype=torch.long), hist)
    lengths = torch.tensor([ctx, ctx - 4][:batch])
    h = torch.randn(batch, view.cfg.hidden_size, generator=g, dtype=D64)
    return view, w, cache, lengths, h


def _clone(c):
    return mla.MLACache(c.data.clone(), None if c.scale is None else c.scale.clone())


def test_absorbed_equals_naive():
    _, w, cache, lengths, h = _setup()
    a = mla.mla_decode(h, w, _clone(cache), lengths)
    b = mla.mla_decode_naive(h, w, _clone(cache), lengths)
    assert torch.allclose(a, b, rtol=0, atol=1e-12)


def test_one_head_three_positions_by_loops():
    g = torch.Generator().manual_seed(5)
    D, Q, C, Dn, Dr, Dv = 5, 4, 3, 2, 2, 2
    r = lambda *s: torch.randn(*s, generator=g, dtype=D64)
    w = mla.MLAWeights(w_dq=r(Q, D), q_norm=1 + 0.1 * r(Q), w_uq=r(Dn + Dr, Q), w_dkv=r(C + Dr, D),
                       kv_norm=1 + 0.1 * r(C), w_uk=r(1, Dn, C), w_uv=r(1, C, Dv), w_gate=r(Dv, D),
                       w_o=r(D, Dv), qk_rope_dim=Dr, eps=1e-6)
    hist = r(1, 2, C + Dr)
    cache = mla.MLACache.empty(1, 3, C + Dr, dtype=D64)
    cache.write(torch.zeros(1, dtype=torch.long), hist.clone())
    h = r(1, D)
    got = mla.mla_decode(h, w, cache, torch.tensor([2]))

    def mv(M, v):
        return [sum(float(M[i, j]) * v[j] for j in range(len(v))) for i in range(M.shape[0])]

    def rms(v, wt):
        ms = sum(x * x for x in v) / len(v)
        return [x / math.sqrt(ms + 1e-6) * float(wt[i]) for i, x in enumerate(v)]

    hv = [float(x) for x in h[0]]
    q = mv(w.w_uq, rms(mv(w.w_dq, hv), w.q_norm))
    q_nope, q_rope = q[:Dn], q[Dn:]
    ckv = mv(w.w_dkv, hv)
    new = rms(ckv[:C], w.kv_norm) + ckv[C:]
    rows = [[float(x) for x in hist[0, t]] for t in range(2)] + [new]
    scores = []
    for t in range(3):
        k_nope = mv(w.w_uk[0], rows[t][:C])  # Wuk[h] c_t
        s = sum(q_nope[i] * k_nope[i] for i in range(Dn)) + sum(q_rope[i] * rows[t][C + i] for i in range(Dr))
        scores.append(s / math.sqrt(Dn + Dr))
    m = max(scores)
    p = [math.exp(s - m) for s in scores]
    p = [x / sum(p) for x in p]
    v = [[sum(float(w.w_uv[0, c, j]) * rows[t][c] for c in range(C)) for j in range(Dv)] for t in range(3)]
    o = [sum(p[t] * v[t][j] for t in range(3)) for j in range(Dv)]
    gate = [1 / (1 + math.exp(-x)) for x in mv(w.w_gate, hv)]
    out = mv(w.w_o, [o[j] * gate[j] for j in range(Dv)])
    assert torch.allclose(got[0], torch.tensor(out, dtype=D64), atol=1e-12)
    assert torch.allclose(cache.data[0, 2], torch.tensor(new, dtype=D64), atol=1e-12)


@pytest.mark.parametrize("kw", [{"partitions": 2}, {"partitions": 4}, {"partitions": 64}, {"dcp": 2},
                                {"dcp": 4, "dcp_layout": "contiguous"}, {"dcp": 8}, {"dcp": 2, "partitions": 3},
                                {"pad_heads": 16}, {"pad_heads": 16, "pad_fill": "random"},
                                {"pad_heads": 8, "dcp": 4, "partitions": 2}])
def test_split_dcp_padding_equal_plain(kw):
    _, w, cache, lengths, h = _setup()
    plain = mla.mla_decode(h, w, _clone(cache), lengths)
    other = mla.mla_decode(h, w, _clone(cache), lengths, **kw)
    assert torch.allclose(plain, other, rtol=0, atol=1e-12)


def test_partials_merge_and_empty_partition():
    _, w, cache, lengths, h = _setup(ctx=5)
    qn, qr = mla.mla_q(h.unsqueeze(1), w)
    ql = mla.absorb_q(qn, w)
    kv = cache.read(D64)
    o1, l1 = mla.mla_attend(ql, qr, kv, lengths, scale=w.scale)
    o2, l2 = mla.mla_attend(ql, qr, kv, lengths, scale=w.scale, partitions=16)  # most pieces empty
    assert torch.allclose(o1, o2, atol=1e-12) and torch.allclose(l1, l2, atol=1e-12)
    # an all-masked piece has lse = -inf and o = 0
    o, lse = mla.attend(ql, qr, kv[:, :0], torch.arange(0), lengths[:, None], w.scale)
    assert o.shape[-1] == w.kv_lora and bool(torch.isinf(lse).all())


def test_dcp_shards_hold_one_nth():
    shards = mla.dcp_shard_positions(10, 4)
    assert [s.tolist() for s in shards] == [[0, 4, 8], [1, 5, 9], [2, 6], [3, 7]]
    assert sum(s.numel() for s in mla.dcp_shard_positions(10, 4, "contiguous")) == 10


def test_verify_equals_repeated_steps():
    view, w, cache, lengths, _ = _setup()
    g = torch.Generator().manual_seed(9)
    T = 4
    hs = torch.randn(2, T, view.cfg.hidden_size, generator=g, dtype=D64)
    c1 = _clone(cache)
    multi = mla.mla_verify(hs, w, c1, lengths)
    c2 = _clone(cache)
    steps = torch.stack([mla.mla_decode(hs[:, t], w, c2, lengths + t) for t in range(T)], 1)
    assert torch.allclose(multi, steps, rtol=0, atol=1e-12)
    assert torch.allclose(c1.data, c2.data, rtol=0, atol=1e-12)
    multi_split = mla.mla_verify(hs, w, _clone(cache), lengths, partitions=3, dcp=2, pad_heads=8)
    assert torch.allclose(multi, multi_split, rtol=0, atol=1e-12)


@pytest.mark.parametrize("mode", ["tensor", "token"])
def test_fp8_cache(mode):
    _, w, cache, lengths, h = _setup()
    ref = mla.mla_decode(h, w, _clone(cache), lengths)
    c8 = mla.MLACache.empty(2, cache.capacity, w.entry_width, kv_dtype="fp8", fp8_scale=mode)
    c8.write(torch.zeros(2, dtype=torch.long), cache.data[:, : int(lengths.max())])
    assert c8.data.dtype == torch.float8_e4m3fn and c8.scale_mode == mode
    got = mla.mla_decode(h, w, c8, lengths)
    assert (got - ref).norm() / ref.norm() < 0.1
    per_pos = c8.nbytes() / (2 * c8.capacity)
    assert per_pos == (w.entry_width if mode == "tensor" else w.entry_width + 4) + (4 / (2 * c8.capacity)
                                                                                   if mode == "tensor" else 0)


def test_cache_overflow_is_refused():
    _, w, cache, _, h = _setup()
    with pytest.raises(ValueError, match="capacity"):
        mla.mla_decode(h, w, cache, torch.tensor([cache.capacity, 0]))


# ---- DCP with histories shorter than the ranks, paged caches, the combine and the cache entry ----------

@pytest.mark.parametrize("layout", ["interleave", "contiguous"])
def test_dcp_every_n_and_short_histories(layout):
    """DCP-N for N = 2..16 equals the unsharded result, histories 1..N+1 included (ranks past the history
    hold nothing and contribute an empty partial); dcp=4 with one cached position no longer raises."""
    g = torch.Generator().manual_seed(3)
    B, T, H, C, Dr = 2, 2, 3, 8, 4
    ql, qr = torch.randn(B, T, H, C, generator=g, dtype=D64), torch.randn(B, T, H, Dr, generator=g, dtype=D64)
    kv = torch.randn(B, 24, C + Dr, generator=g, dtype=D64)
    for ctx in (0, 1, 3, 17):
        lengths = torch.tensor([ctx, max(0, ctx - 2)])
        plain = mla.mla_attend(ql, qr, kv, lengths, scale=0.4)
        for n in range(2, 17):
            o, lse = mla.mla_attend(ql, qr, kv, lengths, scale=0.4, dcp=n, dcp_layout=layout, partitions=2)
            assert torch.allclose(o, plain[0], atol=1e-12) and torch.allclose(lse, plain[1], atol=1e-12), (ctx, n)
    o, lse = mla.mla_attend_partials(ql, qr, kv, torch.tensor([1, 1]), scale=0.4, dcp=4)
    assert o.shape == (B, 4, T, H, C)
    assert bool(torch.isinf(lse[:, 3, 0]).all()) and not bool(o[:, 3, 0].any())  # rank 3 holds nothing for t=0


def test_dcp_one_cached_position_through_the_layer():
    _, w, cache, _, h = _setup(ctx=1)
    lengths = torch.tensor([1, 1])
    plain = mla.mla_decode(h, w, _clone(cache), lengths)
    assert torch.allclose(mla.mla_decode(h, w, _clone(cache), lengths, dcp=4), plain, atol=1e-12)


def test_attend_ignores_garbage_past_the_history():
    _, w, cache, lengths, h = _setup()
    qn, qr = mla.mla_q(h.unsqueeze(1), w)
    ql = mla.absorb_q(qn, w)
    kv = cache.read(D64)
    want = mla.mla_attend(ql, qr, kv, lengths, scale=w.scale)
    for b, n in enumerate(lengths.tolist()):
        kv[b, n + 1:] = float("nan")
    got = mla.mla_attend(ql, qr, kv, lengths, scale=w.scale, partitions=3)
    assert torch.allclose(got[0], want[0], atol=1e-12) and torch.allclose(got[1], want[1], atol=1e-12)


@pytest.mark.parametrize("page_size", [1, 4, 16])
@pytest.mark.parametrize("kv_dtype,mode", [(None, "tensor"), ("fp8", "tensor"), ("fp8", "token")])
def test_paged_cache_equals_contiguous(page_size, kv_dtype, mode):
    g = torch.Generator().manual_seed(4)
    B, S, W = 3, 21, 12
    dt = torch.float32 if kv_dtype is None else torch.bfloat16
    flat = mla.MLACache.empty(B, S, W, dtype=dt, kv_dtype=kv_dtype, fp8_scale=mode, tensor_scale=0.5)
    paged = mla.PagedMLACache.empty(B, S, W, page_size, dtype=dt, kv_dtype=kv_dtype, fp8_scale=mode,
                                    tensor_scale=0.5, spare_pages=2, seed=1)
    assert paged.capacity >= S and paged.block_table.dtype == torch.int32 and paged.scale_mode == flat.scale_mode
    lengths = torch.tensor([0, 5, 13])
    for step in range(3):
        ent = torch.randn(B, 2, W, generator=g)
        flat.write(lengths + 2 * step, ent)
        paged.write(lengths + 2 * step, ent)
    got = paged.read(D64)[:, :S]
    assert torch.equal(got, flat.read(D64))
    again = mla.PagedMLACache.from_contiguous(flat, page_size, spare_pages=1, seed=2, fill=float("nan"))
    assert torch.equal(again.read(D64)[:, :S], flat.read(D64))
    assert not torch.equal(again.block_table.flatten().sort().values, again.block_table.flatten())  # shuffled
    with pytest.raises(ValueError, match="capacity"):
        paged.write(torch.tensor([paged.capacity, 0, 0]), torch.zeros(B, 1, W))


def test_fp8_quantize_rounds_to_nearest_and_saturates():
    x = torch.tensor([[1.9961, 0.0, 500.0, -1000.0, 1.5e-3, 448.0]], dtype=D64)
    q, s = mla.fp8_quantize(x, "tensor", 1.0)  # 1.5e-3 -> the smallest subnormal 2^-9; 1.9961 carries to 2
    assert s is None and q.to(D64).tolist()[0] == [2.0, 0.0, 448.0, -448.0, 2.0 ** -9, 448.0]
    q, s = mla.fp8_quantize(x, "token")
    assert s.shape == (1,) and float(s[0]) == pytest.approx(1000 / 448)
    assert float(q.to(D64)[0, 3]) == -448.0  # the entry's amax maps to the top of e4m3
    with pytest.raises(ValueError, match="fp8 scale mode"):
        mla.fp8_quantize(x, "row")


def test_combine_reference_by_loops():
    g = torch.Generator().manual_seed(6)
    B, K, T, H, C, Dv = 2, 3, 2, 2, 4, 3
    o, lse = torch.randn(B, K, T, H, C, generator=g, dtype=D64), torch.randn(B, K, T, H, generator=g, dtype=D64)
    lse[0, 1] = float("-inf")
    o[0, 1] = 0.0
    w_uv, gate = torch.randn(H, C, Dv, generator=g, dtype=D64), torch.randn(B, T, H * Dv, generator=g, dtype=D64)
    got = mla.mla_combine(o, lse, w_uv, gate)
    for b in range(B):
        for t in range(T):
            for h in range(H):
                ws = [math.exp(float(lse[b, k, t, h])) for k in range(K)]
                ol = sum(ws[k] * o[b, k, t, h] for k in range(K)) / sum(ws)
                y = ol @ w_uv[h]
                gt = torch.sigmoid(gate[b, t, h * Dv:(h + 1) * Dv])
                assert torch.allclose(got[b, t, h * Dv:(h + 1) * Dv], y * gt, atol=1e-12)


def test_cache_entry_is_the_kv_entry():
    _, w, _, _, h = _setup()
    from k3lab.ref.situ import linear

    assert torch.allclose(mla.mla_cache_entry(linear(h, w.w_dkv), w.kv_norm, w.eps), mla.mla_kv_entry(h, w),
                          atol=1e-12)
