"""k3lab.studies.allreduce: the step's all-reduce checked against the fp64 sum and timed on every rank (gloo processes
on the CPU here; NCCL and symmetric memory on a host with several GPUs), and the step's estimate reading it."""
from __future__ import annotations

import json

import pytest
import torch

from k3lab import dashboards as dash
from k3lab.config import preset
from k3lab.studies import allreduce as ar


@pytest.fixture(scope="module")
def cpu_bundle(tmp_path_factory):
    if torch.cuda.is_available():
        pytest.skip("the gloo run is the machine without a GPU's")
    out = tmp_path_factory.mktemp("ar")
    return ar.run(out, world=2, batches=(1, 3), hidden=64, reps=3, timeout_s=60)


def test_cpu_run_checks_and_times_every_batch(cpu_bundle):
    d = json.loads(cpu_bundle.read_text())
    assert cpu_bundle.name == "allreduce_x2.json" and cpu_bundle.parent.name == "cpu"
    assert [r["name"] for r in d["rows"]] == [ar.row_name(1, 64, 2), ar.row_name(3, 64, 2)]
    for r in d["rows"]:
        assert r["backend"] == "gloo" and r["kind"] == "cpu-smoke" and r["error"]["ok"]
        assert r["error"]["tol"] == 2 * 2.0 ** -8 and r["extra"]["payload_bytes"] == r["extra"]["batch"] * 64 * 2
        assert r["extra"]["bound"] == "launch" and r["floor_bw"] is None
    assert d["config"]["env_forced"] == ar.NO_MULTICAST and any("CPU run" in n for n in d["notes"])


def test_measured_takes_the_step_tokens_row(cpu_bundle):
    us, label = ar.measured(cpu_bundle, 2)  # no batch-2 row: the next larger one
    row = [r for r in json.loads(cpu_bundle.read_text())["rows"] if r["extra"]["batch"] == 3][0]
    assert us == row["median_us"] and label.startswith("measured: gloo, batch 3, cpu x 2")
    with pytest.raises(ar.AllReduceError, match=r"no passing row at batch >= 4 \(batches \[1, 3\]\)"):
        ar.measured(cpu_bundle, 4)
    p = {"allreduce_bundle": str(cpu_bundle), "allreduce_us": 12.0}
    us2, label2 = dash.allreduce_from(p, preset("tiny", batch=1))
    assert label2.startswith("measured: gloo, batch 1") and us2 > 0
    assert dash.allreduce_from({"allreduce_us": 7.0}, preset("tiny")) == (7.0, "assumed")
    with pytest.raises(dash.DashboardError, match="'allreduce_bundle': no file"):
        dash.allreduce_from({"allreduce_bundle": "/nonexistent.json"}, preset("tiny"))


def test_bad_arguments_are_named(tmp_path):
    bundle = tmp_path / "x.json"
    bundle.write_text(json.dumps({"config": {"bench": "kda"}, "rows": []}))
    with pytest.raises(ar.AllReduceError, match="not a bundle of k3lab.studies.allreduce"):
        ar.measured(bundle, 1)
    wrong = "nccl" if not torch.cuda.is_available() else "gloo"
    for kw, says in ((dict(backends=[wrong]), f"backends \\['{wrong}'\\] do not run"), (dict(world=1), "world"),
                     (dict(batches=(0,)), "batches"), (dict(hidden=0), "hidden"), (dict(reps=0), "reps")):
        with pytest.raises(ar.AllReduceError, match=says):
            ar.run(tmp_path, **kw)
    assert ar.main([str(tmp_path), "--batches", "a,b"]) == 2


@pytest.mark.gpu
def test_gpu_all_reduce_over_two_gpus(tmp_path):
    if torch.cuda.device_count() < 2:
        pytest.skip("needs two GPUs of one host")
    path = ar.run(tmp_path, world=2, batches=(1, 8), reps=5, backends=("nccl", "nccl_graph"))
    rows = json.loads(path.read_text())["rows"]
    assert {r["backend"] for r in rows} == {"nccl", "nccl_graph"} and all(r["error"]["ok"] for r in rows)


def test_the_worst_rank_decides_the_error():
    ok = {"rel_norm": 1e-3, "ok": True}
    nan = {"rel_norm": None, "ok": False}  # NaN, as ErrorStats.to_dict stores it
    big = {"rel_norm": 0.5, "ok": False}
    assert ar.worst_error([ok, nan]) is nan and ar.worst_error([nan, ok]) is nan
    assert ar.worst_error([ok, {"rel_norm": 2e-3, "ok": True}])["rel_norm"] == 2e-3
    assert ar.worst_error([big, nan]) is nan
