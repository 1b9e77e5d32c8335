"""k3lab.studies.moe_choice (notebooks/05_moe): the routing's effect on the experts' bytes and on the kernel choice,
read off the committed H200 bundles."""
from __future__ import annotations

from pathlib import Path

import pytest

from k3lab.harness.bundle import load
from k3lab.studies import moe_choice

H200 = Path(__file__).resolve().parent.parent / "profiles" / "h200"


def test_traffic_counts_distinct_experts_and_their_tokens():
    df = moe_choice.traffic(tp=8, batches=(1, 8, 64), routings=["uniform", "same16"], dtypes=("bf16", "mxfp4"))
    u64 = df[(df.routing == "uniform") & (df.batch == 64) & (df.dtype == "mxfp4")].iloc[0]
    assert 600 < u64.distinct < 620 and u64.tokens_per_expert == pytest.approx(64 * 16 / u64.distinct)
    s8 = df[(df.routing == "same16") & (df.batch == 8) & (df.dtype == "bf16")].iloc[0]
    assert s8.distinct == 16 and s8.tokens_per_expert == 8
    one = df[(df.batch == 1) & (df.routing == "uniform")].set_index("dtype").MB
    assert 130 < one["bf16"] < 134 and 34 < one["mxfp4"] < 36  # issue 14's 132 MB and ~35 MB
    assert len(moe_choice.traffic_figures(df)) == 3


def test_choice_shows_where_routing_would_change_the_winner():
    """On the dense experts' H200 bundle auto (by batch and format) takes the winner everywhere but fp8 with every
    token on the same 16 experts at batch 8, where the grouped CuTe kernel beats the Triton GEMV auto picks."""
    df = moe_choice.choice(load(H200 / "moe_dense.json.gz")).set_index(["routing", "batch", "dtype"])
    hit = df.loc[("same16", 8, "fp8")]
    assert hit.auto == "triton" and hit.best == "cute" and hit.best_path == "grouped" and hit.auto_over_best > 1.05
    assert df.loc[("uniform", 1, "bf16")].auto == "cute" and df.loc[("uniform", 1, "bf16")].auto_over_best == 1.0
    assert (df.auto_over_best.dropna() >= 1.0).all()
    assert len(moe_choice.choice_figure(df.reset_index()).data) > 0
    assert moe_choice.auto_backend(1, "mxfp4")[0] == "cute" and moe_choice.auto_backend(128, "mxfp4")[0] == "triton"
