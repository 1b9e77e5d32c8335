"""`k3lab sweep plans/cpu_smoke.yaml` on the CPU: every run of the plan, the index page linking them, each bundle
compared with its baseline under profiles/ (cpu-smoke rows shown, never gated), the reports in report mode, and
`k3lab report` leaving a bundle unchanged. The plan runs once per test session (`plan_run`); tests/test_browser.py
loads the pages it made."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

from typer.testing import CliRunner

from k3lab import cli
from k3lab.harness.bundle import find_bundles, load

ROOT = Path(__file__).resolve().parent.parent
PLAN = ROOT / "plans" / "cpu_smoke.yaml"


def plan_run(tmp_path_factory) -> dict:
    """The CPU plan, run once per test session (kept in the session's temporary folder, shared by the xdist workers
    under a file lock, so every test that asks gets the same run): {"dir": the sweep folder, "proc": returncode,
    stdout, stderr}."""
    import fcntl
    import os

    base = tmp_path_factory.getbasetemp()
    if os.environ.get("PYTEST_XDIST_WORKER"):  # each worker has its own folder below the session's
        base = base.parent
    out = base / "cpu_smoke_plan"
    done = out / "proc.json"
    with open(base / "cpu_smoke_plan.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # the first worker runs the plan, the others wait for its result
        if not done.exists():
            out.mkdir(exist_ok=True)
            p = subprocess.run([sys.executable, "-m", "k3lab.cli", "sweep", str(PLAN), "--out", str(out)],
                               capture_output=True, text=True, timeout=600, cwd=ROOT)
            done.write_text(json.dumps({"returncode": p.returncode, "stdout": p.stdout, "stderr": p.stderr}))
    return {"dir": out, "proc": SimpleNamespace(**json.loads(done.read_text()))}


def test_cpu_plan_runs_indexes_and_gates(tmp_path_factory):
    run = plan_run(tmp_path_factory)
    out, proc = run["dir"], run["proc"]
    assert proc.returncode == 0, proc.stdout + proc.stderr
    # no warning breaks into the progress output
    assert "WARNING" not in proc.stderr and "Unable to parse" not in proc.stderr, proc.stderr
    meta = json.loads((out / "sweep.json").read_text())
    runs = meta["runs"]
    assert [Path(r["notebook"]).name for r in runs] == ["03_mla.ipynb", "02_kda.ipynb"]
    assert [r["grid"] for r in runs] == [{"contexts": "40"}, {"drift_steps": 10}]
    # 02_kda's drift study ran (the notebook's headless test is marked slow): bf16 state drifts further than fp32
    (kda,) = [load(p) for r in runs if "02_kda" in r["notebook"] for p in r["bundles"]]
    drift = json.loads(next(n for n in kda.notes if n.startswith("drift: "))[len("drift: "):])
    assert drift["state_err"]["bf16"] > drift["state_err"]["fp32"]
    index = (out / "index.html").read_text()
    for r in runs:
        assert r["status"] == "ok" and Path(r["report"]).exists() and Path(r["executed"]).exists()
        for p in (r["report"], r["executed"], *r["bundles"]):
            assert f"href='{Path(p).relative_to(out).as_posix()}'" in index
    # the MLA bundle meets its committed CPU baseline: compared, never gated, and the output says so
    (mla,) = [g for g in meta["gates"] if Path(g["bundle"]).name == "mla_sweep-cpu.json"]
    assert Path(mla["baseline"]) == ROOT / "profiles" / "cpu" / "mla_sweep-cpu.json"
    assert mla["compared"] > 0 and mla["cpu_smoke"] == mla["compared"] and mla["gated"] == 0
    assert not mla["regressions"]
    assert "compared and never gated on time" in proc.stdout and "never gated" in index


def test_reports_are_in_report_mode(tmp_path_factory):
    run = plan_run(tmp_path_factory)
    r = next(x for x in json.loads((run["dir"] / "sweep.json").read_text())["runs"] if "03_mla" in x["notebook"])
    html = Path(r["report"]).read_text()
    assert "runner.run(" not in html and "sweep_figures" not in html  # no code
    assert "<h3>Parameters</h3>" in html and "<td>contexts</td><td>40</td><td>set</td>" in html
    assert "<td>page_size</td><td>64</td><td>default</td>" in html
    assert "<h3>Environment</h3>" in html and "source_digest" in html
    assert "Plotly.newPlot" in html and "rel err vs fp64" in html
    nb = json.loads(Path(r["executed"]).read_text())  # the executed notebook keeps its code
    assert any("runner.run(" in "".join(c["source"]) for c in nb["cells"])


def test_report_command_leaves_the_bundle_unchanged(tmp_path_factory, tmp_path):
    run = plan_run(tmp_path_factory)
    (bpath,) = [p for p in find_bundles(run["dir"]) if p.name == "mla_sweep-cpu.json"]
    b = load(bpath)
    assert b.rows and all(row.floor_bw == "read" and row.error["ok"] for row in b.rows)
    before = bpath.read_bytes()
    r = CliRunner().invoke(cli.app, ["report", str(bpath), "--out", str(tmp_path / "r.html")])
    assert r.exit_code == 0, r.output
    assert (tmp_path / "r.html").exists() and bpath.read_bytes() == before


def test_a_sweep_outside_the_repository_carries_one_plotly(tmp_path_factory):
    """A sweep written outside the repository holds one copy of the shared plotly.js at its root, which every run's
    report links by a relative path: the folder opens anywhere once copied."""
    from k3lab.report import shared_plotly_js

    run = plan_run(tmp_path_factory)
    js = shared_plotly_js()
    assert (run["dir"] / js.name).read_bytes() == js.read_bytes()
    for r in json.loads((run["dir"] / "sweep.json").read_text())["runs"]:
        html = Path(r["report"])
        assert f'src="../{js.name}"' in html.read_text() and not (html.parent / js.name).exists()
