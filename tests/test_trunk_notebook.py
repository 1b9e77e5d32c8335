"""notebooks/04_trunk headless on the CPU (the tiny preset's shapes, reference rows), as tests/test_notebook.py
runs 03_mla: the notebook's parameters reach the bench and every row passes its fp64 check."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from k3lab.harness.bundle import find_bundles, load

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.slow  # ~50 s on a 2-core CPU (papermill, the probes, every trunk op): outside the default run
def test_trunk_notebook_headless(tmp_path):
    out = tmp_path / "run"
    cmd = [sys.executable, "-m", "k3lab.cli", "run", str(ROOT / "notebooks" / "04_trunk.ipynb"), "-p", "preset", "tiny",
           "-p", "projs", "kda_q", "-p", "groups", "mla_in", "-p", "batches", "1", "-p", "n_blocks", "2",
           "-p", "backends", "reference", "-p", "reps", "2", "--out", str(out), "--quiet"]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert r.returncode == 0, r.stdout + r.stderr
    (bpath,) = find_bundles(out)
    b = load(bpath)
    ops = {row.extra.get("op") for row in b.rows}
    assert ops == {"proj", "proj_group", "router_topk", "attnres_norm"}, ops
    assert all(row.floor_bw == "read" and row.error["ok"] for row in b.rows if row.error is not None)
    assert {row.backend for row in b.rows if row.error is not None} >= {"reference", "cublas"}
