"""The AITER MLA adapter (k3lab_kernels.aiter.mla_decode), everything around the call: AITER runs on ROCm only,
so its `mla_decode_fwd` is stood in for by `FakeAiterMLA`, written from AITER's documented contract (a query
row per new position of each sequence, 16 heads of C+Dr; a page-size-1 kv buffer addressed by
kv_indptr/kv_indices; multi-token decode causal over the last T entries of a sequence's list; o written in
place; (logits, lse) returned with return_lse=True). The adapter's output is compared with the fp64 reference
of k3lab.ref.mla; on this machine the component refuses backend 'aiter' by name."""
from __future__ import annotations

import pytest
import torch

from k3lab.components import mla
from k3lab.ref import mla as ref
from k3lab.switches import BackendUnavailable
from k3lab_kernels.aiter import mla_decode as adapter

C, DR = 64, 16  # small latent / rope widths (the adapter takes any)


class FakeAiterMLA:
    """aiter.mla.mla_decode_fwd as documented, in float64 (its o written in bf16, like AITER's)."""

    def __init__(self):
        self.calls = []

    def mla_decode_fwd(self, q, kv_buffer, o, qo_indptr, kv_indptr, kv_indices, kv_last_page_lens, max_seqlen_q,
                       page_size=1, sm_scale=None, num_kv_splits=None, return_lse=False, **kw):
        assert page_size == 1 and kv_buffer.dim() == 4 and kv_buffer.shape[1:3] == (1, 1)
        assert q.shape[1] == 16 and q.dtype == torch.bfloat16 and bool((kv_last_page_lens == 1).all())
        self.calls.append(dict(rows=q.shape[0], splits=num_kv_splits, n=int(kv_indptr[-1])))
        kv = kv_buffer.reshape(kv_buffer.shape[0], -1).double()
        lse = torch.full(q.shape[:2], float("-inf"), dtype=torch.float64)
        for b in range(len(qo_indptr) - 1):
            rows = kv_indices[int(kv_indptr[b]):int(kv_indptr[b + 1])].long()
            ent = kv[rows]  # [n, W]
            q0, q1 = int(qo_indptr[b]), int(qo_indptr[b + 1])
            T = q1 - q0
            for t in range(T):
                n_vis = len(rows) - (T - 1 - t)  # causal among the last T entries
                if n_vis <= 0:
                    continue
                e = ent[:n_vis]
                s = (q[q0 + t].double() @ e.T) * sm_scale  # [16, n]
                m = s.amax(-1, keepdim=True)
                p = torch.exp(s - m)
                o[q0 + t] = ((p @ e[:, :o.shape[-1]]) / p.sum(-1, keepdim=True)).to(o.dtype)
                lse[q0 + t] = (m.squeeze(-1) + torch.log(p.sum(-1)))
        return (o, lse.float()) if return_lse else o


def _inputs(B=2, T=1, H=12, context=20, page_size=0, ragged=True, seed=0):
    g = torch.Generator().manual_seed(seed)
    lengths = torch.tensor([max(0, context - 7 * b) if ragged else context for b in range(B)])
    cap = int(lengths.max()) + T
    data = torch.randn(B, cap, C + DR, generator=g).to(torch.bfloat16)
    cache = ref.MLACache(data)
    if page_size:
        cache = ref.PagedMLACache.from_contiguous(cache, page_size, spare_pages=2, seed=seed)
    q = torch.randn(B, T, H, C, generator=g).to(torch.bfloat16)
    qr = torch.randn(B, T, H, DR, generator=g).to(torch.bfloat16)
    return q, qr, cache, lengths


def _reference(q, qr, cache, lengths, dcp=1, layout="interleave"):
    T = q.shape[1]
    kv = cache.read(torch.float64)
    return ref.mla_attend(q.double(), qr.double(), kv, lengths, scale=0.125, partitions=1, dcp=dcp, dcp_layout=layout,
                          n_positions=int(lengths.max()) + T)


def _rel(a, b):
    a, b = a.double(), b.double()
    ok = torch.isfinite(b)
    return float((a[ok] - b[ok]).norm() / b[ok].norm().clamp_min(1e-30))


@pytest.mark.parametrize("kw", [
    dict(),                                   # contiguous, ragged, 12 heads padded to 16
    dict(page_size=16, H=6),                  # paged: rows through the block table, 6 heads
    dict(page_size=1, T=3, B=1, ragged=False),  # multi-token decode (causal among the new positions)
    dict(page_size=64, context=2, B=3),         # a history shorter than a page, one sequence at length 0
])
def test_adapter_matches_the_fp64_reference(kw):
    q, qr, cache, lengths = _inputs(**kw)
    fake = FakeAiterMLA()
    o, lse = adapter.mla_decode(q, qr, cache, lengths, scale=0.125, aiter_mla=fake)
    o_ref, lse_ref = _reference(q, qr, cache, lengths)
    assert o.shape == q.shape and o.dtype == torch.float32 and lse.shape == q.shape[:3]
    assert _rel(o, o_ref) < 5e-3  # AITER writes o in bf16: 2^-9 relative rounding
    assert _rel(lse, lse_ref) < 1e-5
    assert len(fake.calls) == 1 and fake.calls[0]["rows"] == q.shape[0] * q.shape[1]


@pytest.mark.parametrize("dcp,layout,context", [(2, "interleave", 21), (4, "contiguous", 30), (8, "interleave", 3)])
def test_adapter_dcp_shards_merged(dcp, layout, context):
    """One AITER call per shard; shards with nothing for a sequence (history shorter than the shards) are
    empty partials; the shared lse merge gives the unsharded answer."""
    q, qr, cache, lengths = _inputs(B=2, context=context, page_size=16)
    fake = FakeAiterMLA()
    o, lse = adapter.mla_decode(q, qr, cache, lengths, scale=0.125, dcp=dcp, dcp_layout=layout, aiter_mla=fake)
    o_ref, lse_ref = _reference(q, qr, cache, lengths)
    assert _rel(o, o_ref) < 5e-3 and _rel(lse, lse_ref) < 1e-5
    assert len(fake.calls) == sum(1 for r in range(dcp) if any(
        len(ref.dcp_shard_positions(int(n) + 1, dcp, layout)[r]) for n in lengths))


def test_adapter_metadata_rows_through_the_table():
    q, qr, cache, lengths = _inputs(B=2, context=40, page_size=16)
    qo, kvp, kvi, last, counts = adapter.shard_metadata(cache, lengths.tolist(), 1, 0, 1, "interleave")
    assert counts == [41, 34] and kvp.tolist() == [0, 41, 75] and qo.tolist() == [0, 1, 2]
    rows = cache.pool.reshape(-1, C + DR)[kvi.long()]
    assert torch.equal(rows[:41], cache.read(torch.bfloat16)[0, :41])


def test_adapter_refusals_by_name():
    q, qr, cache, lengths = _inputs(T=2)
    fake = FakeAiterMLA()
    with pytest.raises(ValueError, match="dcp"):
        adapter.mla_decode(q, qr, cache, lengths, scale=0.1, dcp=2, aiter_mla=fake)
    q17 = torch.zeros(2, 1, 17, C, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="17 heads"):
        adapter.mla_decode(q17, q17[..., :DR], cache, lengths, scale=0.1, aiter_mla=fake)
    fp8 = ref.MLACache(torch.zeros(2, 30, C + DR).to(torch.float8_e4m3fn), scale=torch.tensor(1.0))
    with pytest.raises(ValueError, match="'cache'"):
        adapter.mla_decode(q, qr, fp8, lengths, scale=0.1, aiter_mla=fake)
    with pytest.raises(RuntimeError, match="contract"):
        adapter._lse_of(torch.zeros(3), 3)


def test_component_refuses_aiter_here():
    q, qr, cache, lengths = _inputs()
    with pytest.raises(BackendUnavailable, match="AITER's MLA decode on AMD ROCm GPUs only"):
        mla.attend(q, qr, cache, lengths, scale=0.1, backend="aiter")
    with pytest.raises(BackendUnavailable, match="no mla_combine adapter"):
        mla.combine(torch.zeros(1, 2, 1, 2, C), torch.zeros(1, 2, 1, 2), torch.zeros(2, C, 8), torch.zeros(1, 1, 16),
                    backend="aiter")
    with pytest.raises(ImportError, match="ROCm"):
        adapter.load_aiter()
