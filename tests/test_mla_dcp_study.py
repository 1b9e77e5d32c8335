"""The DCP study (k3lab.studies.mla_dcp): shard history lengths, and one small run under the interpreter."""
import pytest

from k3lab.studies import mla_dcp


def test_shard_context():
    assert [mla_dcp.shard_context(32768, n) for n in (1, 2, 4, 16)] == [32768, 16384, 8192, 2048]
    assert mla_dcp.shard_context(1, 4) == 0  # a history shorter than the shards: one position each at most
    assert mla_dcp.shard_context(0, 1) == 0


@pytest.mark.slow
def test_study_runs_and_frames():
    bd = mla_dcp.run(context=48, ns=(1, 2, 4), reps=2, page_size=16, heads=2)
    df = mla_dcp.frame(bd)
    assert list(df["n"]) == [1, 2, 4] and df["shard_us"].notna().all() and df["merge_us"].notna().all()
    assert all(r.error is None or r.error.get("ok") for r in bd.rows)
    with pytest.raises(ValueError, match="dcp_study"):
        bd.config.pop("dcp_study")
        mla_dcp.frame(bd)
