"""notebooks/01_decode_layer through `k3lab run` on the CPU tiny preset."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import torch

from k3lab.harness.bundle import find_bundles, load
from k3lab.report import shared_plotly_js

ROOT = Path(__file__).resolve().parent.parent
NB = ROOT / "notebooks" / "01_decode_layer.ipynb"


def test_decode_layer_notebook_tiny(tmp_path):
    out = tmp_path / "run"
    # one timed call a component, no warm-up: CPU timings say nothing, and each call interprets the Triton kernels
    cmd = [sys.executable, "-m", "k3lab.cli", "run", str(NB), "-p", "preset", "tiny", "-p", "reps", "1", "-p",
           "warmup", "0", "-p", "kda_tile_v", "32", "-p", "backends", "reference,triton", "--out", str(out), "--quiet"]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert r.returncode == 0, r.stdout + r.stderr
    html = out / "01_decode_layer.html"
    text = html.read_text()
    # plotly.js by a relative path: outside the repository a copy of the shared one in the run folder (the folder
    # opens anywhere once moved); inside, the shared copy itself (profiles/assets/)
    src = text.split("data-k3lab-plotly")[0].rsplit('src="', 1)[1].split('"')[0]
    assert not src.startswith("http") and src == shared_plotly_js().name
    assert (out / src).read_bytes() == shared_plotly_js().read_bytes()
    assert "Plotly.newPlot" in text and "cdn.plot.ly" not in text
    assert len(text) < 300_000
    bundles = find_bundles(out)
    assert len(bundles) == 1
    b = load(bundles[0])
    assert b.switches["kda_tile_v"] == 32 and b.config["view"]["batch"] == 1
    assert "reference" in b.backends_ran
    names = {r.name for r in b.rows}
    assert any(n.startswith("kda") for n in names) and any(n.startswith("mla") for n in names)
    for row in b.rows:
        assert row.error is not None and row.error["ok"], (row.name, row.backend, row.error)
        assert row.floor_us and row.median_us > 0
        if not torch.cuda.is_available():
            assert row.kind == "cpu-smoke"
    # every requested backend either ran or says why not
    for be in ("reference", "triton"):  # torch_compile's layer rows: the GPU evidence run (compile time, CI budget)
        assert be in b.backends_ran or any(k.split(":")[0] == be for k in b.backends_skipped), be
    meta = json.loads((out / "run.json").read_text())
    assert meta["status"] == "ok"
    # outputs stay small
    assert (out / "01_decode_layer.ipynb").stat().st_size < 300_000


def test_notebook_source_has_no_outputs():
    nb = json.loads(NB.read_text())
    assert all(not c.get("outputs") for c in nb["cells"] if c["cell_type"] == "code")
    assert any("parameters" in c.get("metadata", {}).get("tags", []) for c in nb["cells"])


def test_torch_compile_compiles_outside_the_timed_region():
    """torch.compile rows time compiled code only: the compile and its warm-up happen before the first timed
    sample (checked by the one checker's run, then the timer's warm-up). Every timed CPU sample is bracketed by
    the timer's clock; no dynamo compile may start inside any bracket (a compile there once made cold-run
    torch.compile rows ~1000x slower than warm ones)."""
    import time as _time

    import torch._dynamo
    from torch._dynamo.utils import counters

    from k3lab.bench import runner
    from k3lab.harness import timing

    torch._dynamo.reset()
    marks: list[int] = []

    class Clock:  # timing.bench_cpu reads perf_counter_ns right before and right after each timed call
        def __getattr__(self, k):
            return getattr(_time, k)

        def perf_counter_ns(self):
            marks.append(counters["frames"]["total"])
            return _time.perf_counter_ns()

    real = timing.time
    timing.time = Clock()
    try:
        c0 = counters["frames"]["total"]
        bd = runner.run("kda", grid=dict(heads=(2,), batch=(1,), T=(1,), D=(16,)), backends=[], peers=True,
                        reps=3, log=lambda s: None)
    finally:
        timing.time = real
    assert counters["frames"]["total"] > c0, "nothing was compiled: the test checks nothing"
    rows = [r for r in bd.rows if r.backend == "torch_compile"]
    assert rows and all(r.kind == "cpu-smoke" for r in rows)
    assert len(marks) % 2 == 0 and len(marks) >= 2 * 3 * len(rows)
    inside = [(a, z) for a, z in zip(marks[0::2], marks[1::2]) if z != a]
    assert not inside, f"{len(inside)} timed samples included a torch.compile"


def test_mla_notebook_sweeps_page_size_dtype_padding_and_dcp(tmp_path):
    """notebooks/03_mla takes lists for the cache's page size and dtype, head padding and DCP N (issue 12's sweep),
    runs the Triton kernels (interpreter) on every combination, each row checked against fp64, and draws one line a
    combination, never one line's best over different cases."""
    import os

    out = tmp_path / "run"
    cmd = [sys.executable, "-m", "k3lab.cli", "run", str(ROOT / "notebooks" / "03_mla.ipynb"), "-p", "heads", "4",
           "-p", "batches", "1", "-p", "contexts", "40", "-p", "page_size", "0,16", "-p", "kv_dtype", "bf16,fp8",
           "-p", "pad_heads", "16", "-p", "dcp", "2", "-p", "backends", "triton", "-p", "peers", "false",
           "-p", "reps", "2", "-p", "dcp_context", "0", "--out", str(out), "--quiet"]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=600, cwd=ROOT,
                       env={**os.environ, "TRITON_INTERPRET": "1"})
    assert r.returncode == 0, r.stdout + r.stderr
    (bpath,) = find_bundles(out)
    b = load(bpath)
    combos = {(r.extra["page_size"], r.extra["kv_dtype"], r.extra["pad_heads"], r.extra["dcp"]) for r in b.rows
              if r.backend == "triton"}
    assert combos == {(p, d, 16, 2) for p in (0, 16) for d in ("bf16", "fp8")}  # 4 of the grid's 16 (CI's budget)
    assert all(r.error["ok"] for r in b.rows), [(r.name, r.error) for r in b.rows if not r.error["ok"]]
    html = (out / "03_mla.html").read_text()
    assert "triton page_size=16 kv_dtype=fp8" in html  # a line a combination (the axes that vary name it)


def test_moe_notebook_tiny_shows_traffic_and_choice(tmp_path):
    """notebooks/05_moe on the CPU grid: the traffic figures, the traces' statistics, the sweep and the table of auto's
    choice beside the fastest measured (k3lab.studies.moe_choice)."""
    out = tmp_path / "run"
    cmd = [sys.executable, "-m", "k3lab.cli", "run", str(ROOT / "notebooks" / "05_moe.ipynb"), "-p", "k3_sizes",
           "false", "-p", "batches", "1,4", "-p", "dtypes", "bf16,mxfp4", "-p", "routings", "uniform,same16",
           "-p", "backends", "reference", "-p", "reps", "2", "-p", "peers", "false", "--out", str(out), "--quiet"]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert r.returncode == 0, r.stdout + r.stderr
    html = (out / "05_moe.html").read_text()
    assert "tokens a touched expert serves" in html and "kernel over the fastest measured" in html
    (bpath,) = find_bundles(out)
    assert all(r.error["ok"] for r in load(bpath).rows)
