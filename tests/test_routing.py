"""Routing traces (k3lab.routing): the format round trip, the recorder on the reference model, the synthetic
generator's statistics, the traces in data/routing/ as NOTES_moe states them, and a trace driving the MoE
benchmark's routing through the shared checker."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from k3lab import registry, routing
from k3lab.config import preset
from k3lab.harness import checker
from k3lab.ref.stack import Stack
from k3lab.weights import make_stack


def test_round_trip_and_format_errors(tmp_path):
    tr = routing.synthetic(24, 4, 20, 3, zipf=0.5, reuse=0.3, seed=3)
    p = tr.save(tmp_path / "t.npz")
    back = routing.Trace.load(p)
    assert np.array_equal(back.ids, tr.ids) and np.array_equal(back.weights, tr.weights)
    assert back.n_experts == 24 and back.top_k == 4 and back.meta["source"].startswith("k3lab.routing.synthetic")
    np.testing.assert_allclose(back.weights.astype(np.float32).sum(-1), 1.0, atol=4e-3)
    with pytest.raises(routing.TraceError, match="0..23"):
        routing.Trace(tr.ids + 24, tr.weights, 24)
    dup = tr.ids.copy()
    dup[0, 0, 0, 1] = dup[0, 0, 0, 0]
    with pytest.raises(routing.TraceError, match="distinct"):
        routing.Trace(dup, tr.weights, 24)
    with pytest.raises(routing.TraceError, match="no routing trace"):
        routing.load("nope")
    with pytest.raises(routing.TraceError, match="trace name"):
        routing.name_path("../x")


def test_recorder_on_the_reference_stack():
    """Every MoE layer of a tiny K3 stack, every step: the ids the router chose, distinct per token, weights
    summing to the routed scaling; the model's own moe_forward is restored afterwards."""
    from k3lab.ref import layers

    orig = layers.moe_forward
    view = preset("tiny")
    st = Stack(make_stack(view, 0, n_layers=3, dtype=torch.float32), batch=2, capacity=8)
    tr = routing.record(st, torch.tensor([3, 5]), 3)
    assert layers.moe_forward is orig
    assert tr.shape == (2, 3, 3 - view.cfg.first_k_dense, view.cfg.num_experts_per_tok)
    assert tr.n_experts == view.cfg.n_routed_experts
    np.testing.assert_allclose(tr.weights.astype(np.float32).sum(-1), 1.0, atol=4e-3)
    s = routing.stats(tr, (1, 2))
    assert s["distinct"][1] == view.cfg.num_experts_per_tok and 0.0 <= s["next_token_reuse"] <= 1.0


def test_synthetic_statistics():
    u = routing.stats(routing.synthetic(896, 16, 128, 1, seed=0), (64,))
    assert u["next_token_reuse"] < 0.05  # chance overlap: 16/896
    assert abs(u["distinct"][64] - routing.uniform_distinct(896, 16, 64)) < 25
    r = routing.stats(routing.synthetic(896, 16, 128, 1, zipf=0.5, reuse=0.275, seed=1), (64,))
    assert 0.25 < r["next_token_reuse"] < 0.34
    sk = routing.stats(routing.synthetic(896, 16, 128, 1, zipf=0.8, seed=2), (64,))
    assert sk["top10_share"] > 0.4 and sk["distinct"][64] < u["distinct"][64]


def test_data_traces_as_stated():
    """data/routing/ as docs/NOTES_moe.md states it: under 200 KB, K3's 896 experts / top 16, the reuse trace at
    the public 29.5% next-token reuse."""
    names = routing.available()
    assert {"k3_reuse30", "k3_skew"} <= set(names)
    assert sum(routing.name_path(n).stat().st_size for n in names) < 200_000
    r = routing.stats(routing.load("k3_reuse30"))
    assert r["n_experts"] == 896 and r["top_k"] == 16
    assert r["next_token_reuse"] == pytest.approx(0.295, abs=0.005)
    assert routing.stats(routing.load("k3_skew"))["top10_share"] > 0.45


def test_trace_drives_the_benchmark_routing(tmp_path, monkeypatch):
    """routing=<trace name> takes each input set's ids and weights from the trace (`Trace.batch_ids`), checked
    against fp64 like any routing."""
    monkeypatch.setattr(routing, "DATA", tmp_path)
    monkeypatch.setattr(routing, "_cache", {})
    routing.synthetic(24, 4, 40, 2, zipf=0.6, reuse=0.3, seed=5).save(tmp_path / "tiny.npz")
    op = registry.get("moe_experts")
    case = op.case(batch=3, routing="tiny", dtype="bf16")
    assert op.valid(case)
    inp = op.make_inputs(case, 7, "cpu")
    ids, w = routing.load("tiny").batch_ids(3, 7)
    assert torch.equal(inp["idx"], torch.from_numpy(ids)) and torch.equal(inp["weights_k"], torch.from_numpy(w))
    checker.require(checker.check(op, case, backend="reference", seed=7))
