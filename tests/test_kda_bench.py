"""The KDA sweep (k3lab.bench.kda, `k3lab bench kda`, notebooks/02_kda.ipynb) on tiny shapes.

On a CPU the Triton kernels run in the interpreter and timings are cpu-smoke: these tests prove the
sweep's plumbing (checks, rows, bundle, report, winners), not speed."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import torch

from k3lab.bench import kda as kb
from k3lab.harness.bundle import find_bundles, load

ROOT = Path(__file__).resolve().parent.parent


def test_bytes_count_by_hand():
    c = kb.KDACase(heads=12, batch=64, T=1)
    HD = 12 * 128
    state = 64 * 12 * 128 * 128 * 4 * 2
    io = 64 * (3 * HD + HD + 12 + HD) * 2 + 64 * HD * 2
    conv = 64 * 3 * HD * 3 * 2 * 2
    params = 3 * HD * 4 * 2 + HD * 4 + 12 * 4 + 128 * 2
    assert kb.kda_bytes(c) == state + io + conv + params
    v = kb.KDACase(heads=12, batch=1, T=4)
    st = 12 * 128 * 128 * 4
    assert kb.kda_bytes(v) - kb.kda_bytes(v, hist=False) == st * 3 + 3 * HD * 3 * 2 * 4


def test_sweep_rows_bundle_and_winners(tmp_path):
    rows, meta = kb.run(heads=(2,), batches=(1, 2), Ts=(1, 3), tiles=(8, 16), D=16, device="cpu", reps=2,
                        backends=("triton", "cute"), log=lambda s: None)
    assert "cute" in meta["unavailable"] or torch.cuda.is_available()
    ours = [r for r in rows if r["impl"] == "triton"]
    assert len(ours) == 2 * 2 * 2
    for r in ours:
        assert r["ok"], r  # checked against fp64 with poisoned outputs before timing
        assert r["timing_kind"] == "cpu-smoke"
    b = kb.to_bundle(rows, meta, name="t", grid={})
    path = b.save(tmp_path)
    back = load(path)
    assert len(back.rows) == len(rows) and back.copy_tbps == meta["copy_tbps"]
    w = kb.winners(rows)
    assert set(w) == {"H2_B1_T1", "H2_B1_T3", "H2_B2_T1", "H2_B2_T3"}
    assert all(v["tile_v"] in (8, 16) for v in w.values())


def test_kda_notebook_headless(tmp_path):
    out = tmp_path / "run"
    cmd = [sys.executable, "-m", "k3lab.cli", "run", str(ROOT / "notebooks" / "02_kda.ipynb"),
           "-p", "heads", "2", "-p", "batches", "1", "-p", "Ts", "1,2", "-p", "tiles", "8", "-p", "D", "16",
           "-p", "reps", "2", "-p", "drift_steps", "10", "-p", "drift_every", "5", "--out", str(out), "--quiet"]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert r.returncode == 0, r.stdout + r.stderr
    assert (out / "02_kda.html").exists()
    (bpath,) = find_bundles(out)
    b = load(bpath)
    assert any(n.startswith("drift: ") for n in b.notes) and any(n.startswith("winners: ") for n in b.notes)
    drift = json.loads(next(n for n in b.notes if n.startswith("drift: "))[len("drift: "):])
    # bf16 state drifts further from fp64 than fp32 state
    assert drift["state_err"]["bf16"] > drift["state_err"]["fp32"]


def test_bench_cli_refuses_unknown_component():
    r = subprocess.run([sys.executable, "-m", "k3lab.cli", "bench", "mla"], capture_output=True, text=True,
                       cwd=ROOT)
    assert r.returncode == 2 and "kda" in (r.stdout + r.stderr)
