"""notebooks/06_decode_step and 07_draft_depth headless through `k3lab run` on the CPU tiny preset."""
from __future__ import annotations

import gzip
import json
import os
import subprocess
import sys
from pathlib import Path

import papermill as pm
import pytest

from k3lab import dashboards as dash
from k3lab.harness.bundle import find_bundles, load

ROOT = Path(__file__).resolve().parent.parent
NB06 = ROOT / "notebooks" / "06_decode_step.ipynb"
NB07 = ROOT / "notebooks" / "07_draft_depth.ipynb"


def _run(nb: Path, out: Path, *params: str) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "k3lab.cli", "run", str(nb), *params, "--out", str(out), "--quiet"]
    # one intra-op thread: the tiny preset's ops are microseconds, and spinning OpenMP threads on a busy 2-core
    # CI machine make them milliseconds (measured: the 06 run 46 s -> 11 s in-process)
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    return subprocess.run(cmd, capture_output=True, text=True, timeout=600, cwd=ROOT, env=env)


def test_parameter_cells_name_what_the_library_reads():
    """The parameters cell and the panel share one list of names (dashboards.STEP_PARAMS / DEPTH_PARAMS), and
    papermill parses every line of both cells."""
    for nb, names in ((NB06, dash.STEP_PARAMS), (NB07, dash.DEPTH_PARAMS)):
        known = set(pm.inspect_notebook(str(nb))) - {"out_dir"}
        assert known == set(names), (nb.name, known ^ set(names))
        src = json.loads(nb.read_text())
        assert all(not c.get("outputs") for c in src["cells"] if c["cell_type"] == "code")


def test_step_notebook_tiny(tmp_path):
    out = tmp_path / "step"
    r = _run(NB06, out, "-p", "expert_dtype", "bf16", "-p", "compare", "reference", "-p", "numerics_steps", "2",
             "-p", "reps", "1", "-p", "context", "24")
    assert r.returncode == 0, r.stdout + r.stderr
    (bpath,) = find_bundles(out)
    b = load(bpath)
    names = {(x.name, x.backend) for x in b.rows}
    assert {("step", "fused"), ("step", "reference"), ("estimate:93_layers", "fused")} <= names
    assert any(n.startswith("toggle:") for n, _ in names) and any(n.startswith("numerics:") for n, _ in names)
    assert sum(1 for n, be in names if be == "fused" and n.startswith("L") and n.count(".") == 1) == 8
    html = (out / "06_decode_step.html").read_text()
    assert html.count("Plotly.newPlot") >= 5  # layers, launches, toggles, gaps, errors
    trace = next(out.glob("trace-*.json.gz"))
    assert f'href="{trace.name}"' in html  # linked beside the report
    assert json.loads(gzip.open(trace, "rt").read())["traceEvents"]
    assert "nsight-python metrics not collected" in html  # the CPU says why
    assert "93-layer estimate" in html and "assumed" in html
    assert json.loads((out / "run.json").read_text())["status"] == "ok"
    assert bpath.stat().st_size < 400_000


@pytest.mark.slow  # ~20 s: CI's 10-minute budget (python3 -m pytest -q -m slow runs it)
def test_draft_depth_notebook_tiny(tmp_path):
    out = tmp_path / "depth"
    r = _run(NB07, out, "-p", "batches", "2", "-p", "depths", "0,2", "-p", "reps", "1", "-p", "components", "false",
             "-p", "expert_dtype", "bf16", "-p", "context", "24")
    assert r.returncode == 0, r.stdout + r.stderr
    (bpath,) = find_bundles(out)
    b = load(bpath)
    cyc = {x.name: x for x in b.rows}
    assert set(cyc) == {"cycle:b2-d0", "cycle:b2-d2"}
    r2 = cyc["cycle:b2-d2"].extra
    assert abs(r2["committed[agentx_fixed]"] - (1 + 0.8353078 + 0.8353078 * 0.7943269)) < 1e-6
    assert cyc["cycle:b2-d0"].extra["committed[al6_at7]"] == 1.0
    assert sum(x.extra["best[agentx_fixed]"] for x in cyc.values()) == 1
    # the curve's cycle: the verify estimate + 69 KDA commits at the curve's accepted counts (timed); decode has none
    assert r2["commit_us[agentx_fixed]"] > 0 and cyc["cycle:b2-d0"].extra["commit_us[agentx_fixed]"] == 0
    assert abs(r2["cycle_us[agentx_fixed]"] - (r2["cycle_us"] + 69 * r2["commit_us[agentx_fixed]"])) < 1e-6
    assert abs(r2["tok_s[agentx_fixed]"] - 2 * r2["committed[agentx_fixed]"] / (r2["cycle_us[agentx_fixed]"] * 1e-6)) \
        < 1e-6
    html = (out / "07_draft_depth.html").read_text()
    assert html.count("Plotly.newPlot") >= 3 and "best at batch" in html


def test_numerics_run_kda_pdl_off_and_say_so(tmp_path, monkeypatch):
    """kda_pdl (a CuTe launch order) with the numerics section: the tiny stack's KDA cannot take it (the first H200
    headline with kda_pdl lost its numerics to that refusal), so its numerics run with it off, noted in the bundle."""
    from types import SimpleNamespace

    from k3lab import step as stepmod
    from k3lab.harness.bundle import Bundle

    seen = {}
    view = dash.view_from_params({"preset": "tiny"})

    def fake_bench(v, sw, **kw):
        return SimpleNamespace(bundle=Bundle.new("decode_step-fake", view=v, switches=sw))

    def fake_numerics(v, sw, **kw):
        seen["sw"] = sw
        return {"layers": [0], "kinds": ["kda+moe"], "n_steps": 1, "rel_err": [[0.0]], "state_rel_err": [[0.0]],
                "backends": {}, "device": "cpu", "view": view.to_dict()}

    monkeypatch.setattr(stepmod, "bench_step", fake_bench)
    monkeypatch.setattr(stepmod, "step_numerics", fake_numerics)
    run = dash.run_step({"preset": "tiny", "kda_pdl": True, "numerics_steps": 1, "trace": False}, tmp_path,
                        log=lambda s: None)
    assert run["numerics_error"] is None and seen["sw"].kda_pdl is False
    assert any("kda_pdl off there" in n for n in run["bundle"].notes)


def test_step_notebook_replots_a_saved_step_bundle(tmp_path):
    """`-p bundle` draws the dashboards of a saved step bundle (here the committed H200 batch-1 headline) without
    running anything: its figures, its trace linked beside the report (copied with the bundle into the run
    folder, so `k3lab publish` finds both), the bundle's own environment; the input is never changed."""
    src = ROOT / "profiles" / "h200" / "decode_step-tp8-b1-c8192-d0.json.gz"
    before = src.read_bytes()
    out = tmp_path / "replot"
    r = _run(NB06, out, "-p", "bundle", str(src.relative_to(ROOT)))
    assert r.returncode == 0, r.stdout + r.stderr
    assert src.read_bytes() == before and (out / src.name).read_bytes() == before
    html = (out / "06_decode_step.html").read_text()
    assert html.count("Plotly.newPlot") >= 5 and "NVIDIA H200" in html
    assert 'href="trace-decode_step-tp8-b1-c8192-d0.json.gz"' in html
    assert (out / "trace-decode_step-tp8-b1-c8192-d0.json.gz").is_file()
    assert "the bundle holds no nsight-python record" in html  # its run (scripts/step_run.py) collected none
    assert json.loads((out / "run.json").read_text())["bundles"] == [src.name]


def test_depth_sweep_keeps_one_step_alive(monkeypatch):
    """The draft-depth sweep builds each view's step only after the last one is released: with two alive at once,
    K3's full expert pools (~45 GB a step at tp8) ran an 80 GB H100 out of memory from depth 1 (fifty-fourth
    session). Each record carries its step's peak memory (None off a GPU)."""
    import gc
    import weakref

    import torch

    from k3lab import step as stepmod

    torch.set_num_threads(1)
    alive: list[weakref.ref] = []
    seen: list[int] = []

    class Counted(stepmod.DecodeStep):
        def __init__(self, *a, **k):
            gc.collect()
            seen.append(sum(r() is not None for r in alive))
            super().__init__(*a, **k)
            alive.append(weakref.ref(self))

    monkeypatch.setattr(stepmod, "DecodeStep", Counted)
    df, bundle = dash.depth_sweep(dict(preset="tiny", batches="1", depths="0,1", reps=1, components=False,
                                       expert_dtype="bf16", context=24), log=lambda s: None)
    assert seen == [0, 0] and list(df["depth"]) == [0, 1]
    assert "peak_gb" in df.columns
