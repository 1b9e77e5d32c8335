"""CLI: parameter parsing, run failures naming the cell, sweep, compare exit codes, env, publish."""
from __future__ import annotations

import json
from pathlib import Path

from k3lab import cli  # first: it keeps jsonschema from importing rfc3987-syntax (~3 s) through nbformat

import nbformat  # noqa: E402
import pytest  # noqa: E402
import typer  # noqa: E402
from nbformat.v4 import new_code_cell, new_notebook  # noqa: E402
from typer.testing import CliRunner  # noqa: E402

from k3lab.report import shared_plotly_js

runner = CliRunner()


def _nb(path: Path, body: str) -> Path:
    params = new_code_cell("x = 1\nout_dir = ''", metadata={"tags": ["parameters"]})
    nb = new_notebook(cells=[params, new_code_cell(body)],
                      metadata={"kernelspec": {"name": "python3", "display_name": "Python 3", "language": "python"}})
    nbformat.write(nb, str(path))
    return path


def test_parse_values():
    assert cli.parse_value("3") == 3 and cli.parse_value("true") is True
    assert cli.parse_value("[1, 2]") == [1, 2] and cli.parse_value("tiny") == "tiny"
    assert cli.parse_value('"5"') == "5" and cli.parse_value("1.5") == 1.5
    assert cli._split_values("1,2, [3,4],x") == ["1", "2", "[3,4]", "x"]
    assert cli._params_from_args(["-p", "a", "1", "--param", "b", "[1]"]) == {"a": 1, "b": [1]}
    with pytest.raises(typer.BadParameter, match="needs NAME VALUE"):
        cli._params_from_args(["-p", "a"])
    h = cli.param_hash({"a": 1, "b": 2})
    assert h == cli.param_hash({"b": 2, "a": 1}) and len(h) == 8


def test_run_writes_run_dir(tmp_path):
    nb = _nb(tmp_path / "ok.ipynb", "print('x is', x)\nimport pathlib\n"
             "assert pathlib.Path(out_dir).is_dir()")
    r = runner.invoke(cli.app, ["run", str(nb), "-p", "x", "7", "--out", str(tmp_path / "run"), "-q"])
    assert r.exit_code == 0, r.output
    meta = json.loads((tmp_path / "run" / "run.json").read_text())
    assert meta["status"] == "ok" and meta["params"]["x"] == 7
    assert (tmp_path / "run" / "ok.html").exists() and (tmp_path / "run" / "ok.ipynb").exists()


def test_failing_notebook_names_the_cell(tmp_path):
    nb = _nb(tmp_path / "bad.ipynb", "y = 2\nraise ValueError('boom at ' + str(x))")
    r = runner.invoke(cli.app, ["run", str(nb), "-p", "x", "5", "--out", str(tmp_path / "run"), "-q"])
    assert r.exit_code == 1
    err = r.output + (r.stderr if r.stderr_bytes is not None else "")
    assert "ValueError" in err and "boom at 5" in err and "cell" in err
    assert "cell 1 of the notebook" in err and "raise ValueError" in err  # the line that raised
    meta = json.loads((tmp_path / "run" / "run.json").read_text())
    assert meta["status"] == "failed" and "ValueError" in meta["error"]
    assert (tmp_path / "run" / "bad.html").exists()  # the report of a failed run still shows the error


def test_sweep_grid(tmp_path):
    nb = _nb(tmp_path / "sw.ipynb", "assert x != 3, 'three'")
    r = runner.invoke(cli.app, ["sweep", str(nb), "--grid", "x=1,2", "--out", str(tmp_path / "runs")])
    assert r.exit_code == 0, r.output
    runs = sorted(p for p in (tmp_path / "runs").iterdir() if p.is_dir())
    assert len(runs) == 2
    index = (tmp_path / "runs" / "index.html").read_text()
    for d in runs:  # the index links every run's report and executed notebook (relative links)
        assert f"href='{d.name}/sw.html'" in index and f"href='{d.name}/sw.ipynb'" in index
        assert str(d) in r.output  # run paths printed whole
    r = runner.invoke(cli.app, ["sweep", str(nb), "--grid", "x=3", "--out", str(tmp_path / "runs2")])
    assert r.exit_code == 1 and "failed" in r.output and "three" in r.output


def test_sweep_checks_everything_before_the_first_run(tmp_path):
    nb = _nb(tmp_path / "sw.ipynb", "pass")
    r = runner.invoke(cli.app, ["sweep", str(tmp_path / "nosuch.ipynb"), "--grid", "x=1,2"])
    assert r.exit_code == 2 and r.output.count("does not exist") == 1 and "run directory" not in r.output
    r = runner.invoke(cli.app, ["sweep", str(nb), "--grid", "x=1,abc", "--out", str(tmp_path / "o")])
    assert r.exit_code == 2 and "'x' expects a number" in r.output and not (tmp_path / "o").exists()
    plan = tmp_path / "p.yaml"
    for text, msg in [("runs: []", "'runs' must be a non-empty list"), ("nme: x\nruns: [{notebook: sw.ipynb}]",
                      "unknown keys ['nme']"), ("runs: [{notebook: none.ipynb}]", "does not exist"),
                      ("runs: [{notebook: sw.ipynb, params: {x: 1}, grid: {x: [2]}}]", "both fixed and on the grid"),
                      ("runs: [{notebook: sw.ipynb, grid: {seeed: [1]}}]", "no parameter ['seeed']")]:
        plan.write_text(text)
        r = runner.invoke(cli.app, ["sweep", str(plan), "--out", str(tmp_path / "o")])
        assert r.exit_code == 2 and msg in r.output, (text, r.output)
    assert not (tmp_path / "o").exists()


def test_sweep_and_run_check_the_shared_parameters_values_up_front(tmp_path):
    """A grid value the GPU view or the switches refuse (`--grid preset=bogus`, a tile the KDA kernels do not have,
    a backend that does not exist) stops the sweep before its first run, naming the parameter; so does an
    int-list parameter that is not one."""
    nbs = Path(__file__).resolve().parent.parent / "notebooks"
    layer, step = nbs / "01_decode_layer.ipynb", nbs / "06_decode_step.ipynb"
    for grid, msg in [("preset=tiny,bogus", "preset must be one of"), ("batch=1,0", "batch must be >= 1"),
                      ("kda_tile_v=16,7", "switch 'kda_tile_v' = 7"), ("kv_dtype=fp4", "kv_dtype must be one of"),
                      ("mla_partitions=3,65", "an int in 1..64 or 'auto'")]:
        r = runner.invoke(cli.app, ["sweep", str(layer), "--grid", grid, "--out", str(tmp_path / "o")])
        assert r.exit_code == 2 and msg in r.output, (grid, r.output)
    r = runner.invoke(cli.app, ["sweep", str(step), "--grid", "backend_kda=cute,cuda", "--out", str(tmp_path / "o")])
    assert r.exit_code == 2 and "'backend[kda]' = 'cuda'" in r.output, r.output
    r = runner.invoke(cli.app, ["sweep", str(nbs / "02_kda.ipynb"), "--grid", 'batches="1,2","1,x"', "--out",
                                str(tmp_path / "o")])
    assert r.exit_code == 2 and "'batches' expects a comma-separated list of ints" in r.output, r.output
    assert not (tmp_path / "o").exists()
    with pytest.raises(cli.RunFailed, match="'batches' expects a comma-separated list of ints"):
        cli.check_params(nbs / "02_kda.ipynb", {"batches": "1,x"})
    assert cli.check_params(nbs / "02_kda.ipynb", {"batches": [1, 8]}) == {"batches": [1, 8]}  # -p batches '[1, 8]'
    mla = {"pad_heads": "0,16", "page_size": "1,16,64", "dcp": [1, 4]}  # the MLA notebook's lists are grids
    assert cli.check_params(nbs / "03_mla.ipynb", mla) == mla
    with pytest.raises(cli.RunFailed, match="expert_dtype must be one of"):
        cli.check_params(nbs / "07_draft_depth.ipynb", {"expert_dtype": "int4"})
    assert cli.check_params(step, {"backend": "triton", "backend_kda": ""}) == {"backend": "triton", "backend_kda": ""}
    assert cli.check_params(layer, {"preset": "tp8", "batch": 64, "mla_partitions": 12})["mla_partitions"] == 12
    r = runner.invoke(cli.app, ["run", str(layer), "-p", "preset", "nonsense", "--out", str(tmp_path / "r")])
    assert r.exit_code == 1 and "preset must be one of" in r.output and not (tmp_path / "r").exists()


_BENCH_NB = """import json, os, statistics
def row(name, kind, samples):
    s = sorted(samples)
    return dict(name=name, backend="triton", kind=kind, median_us=statistics.median(s), p10_us=s[len(s) // 10],
                p90_us=s[len(s) * 9 // 10], samples_us=s)
rows = [row("fast", "gpu-graph", [x * (10 + 0.01 * i) for i in range(50)]),
        row("steady", "gpu-graph", [10 + 0.01 * i for i in range(50)]), row("cpu_row", "cpu-smoke", [50.0 * x] * 5)]
os.makedirs(os.path.join(out_dir, "g"))
with open(os.path.join(out_dir, "g", "t-gate.json"), "w") as f:
    json.dump(dict(schema_version=1, name="t-gate", env={"gpu": "G", "gpu_slug": "g"}, config={}, switches={},
                   backends_ran={"triton": "t"}, rows=rows), f)
"""


def test_sweep_gates_against_baselines(tmp_path):
    """A plan's bundles are compared with the baselines: a row slower than its spread threshold fails the sweep
    (exit 1, named); cpu-smoke rows never gate, and the output says so."""
    nb = _nb(tmp_path / "g.ipynb", _BENCH_NB)
    base = tmp_path / "profiles"
    r = runner.invoke(cli.app, ["sweep", str(nb), "--grid", "x=1.0", "--out", str(tmp_path / "s0"), "--baselines",
                                str(base)])
    assert r.exit_code == 0 and "no baseline named t-gate" in r.output, r.output
    made = next((tmp_path / "s0").glob("*/g/t-gate.json"))
    (base / "g").mkdir(parents=True)
    (base / "g" / "t-gate.json").write_text(made.read_text())
    plan = tmp_path / "plan.yaml"
    plan.write_text("name: gate\nbaselines: profiles\nruns:\n  - notebook: g.ipynb\n    grid: {x: [1.02, 1.3]}\n")
    r = runner.invoke(cli.app, ["sweep", str(plan), "--out", str(tmp_path / "s1")])
    assert r.exit_code == 1, r.output
    assert r.output.count("REGRESSION fast [triton]") == 1 and "1 regression(s)" in r.output
    assert "steady" not in r.output.split("REGRESSION")[-1]
    assert "cpu-smoke: 2 rows compared and never gated" in r.output
    index = (tmp_path / "s1" / "index.html").read_text()
    assert "slower by 30.0%" in index and "never gated" in index
    gates = json.loads((tmp_path / "s1" / "sweep.json").read_text())["gates"]
    assert [len(g["regressions"]) for g in gates] == [0, 1] and all(g["cpu_smoke"] == 1 for g in gates)


def test_spread_threshold_follows_the_samples():
    from k3lab.harness.bundle import Row
    from k3lab.harness.timing import Timing

    def row(scale, spread, n=50, kind="gpu-graph"):
        return Row.from_timing("r", "triton", Timing.from_samples(
            kind, [scale * (10 + spread * 10 * (i / (n - 1) - 0.5)) for i in range(n)]))

    tight, noisy = cli.spread_threshold(row(1, 0.001), row(1, 0.001)), cli.spread_threshold(row(1, 0.5), row(1, 0.5))
    assert tight == cli.MIN_THRESHOLD and noisy > 0.1
    assert cli.spread_threshold(row(1, 0.5, n=5), row(1, 0.5, n=5)) > noisy  # fewer samples: a wider gate


def _save(tmp_path: Path, name: str, scale: float) -> Path:
    from test_harness import _bundle

    b = _bundle(scale, kind="gpu-graph")
    return b.save_as(tmp_path / f"{name}.json")


def test_compare_exit_codes(tmp_path):
    a, same, slow = _save(tmp_path, "a", 1.0), _save(tmp_path, "b", 1.01), _save(tmp_path, "c", 1.5)
    r = runner.invoke(cli.app, ["compare", str(a), str(same)])
    assert r.exit_code == 0 and "no regressions" in r.output
    r = runner.invoke(cli.app, ["compare", str(a), str(slow)])
    assert r.exit_code == 1 and "REGRESSION" in r.output and "threshold" in r.output
    assert runner.invoke(cli.app, ["compare", str(a), str(slow), "--threshold", "0.6"]).exit_code == 0
    assert runner.invoke(cli.app, ["compare", str(a), str(slow), "--threshold", "0.2"]).exit_code == 1
    assert runner.invoke(cli.app, ["compare", str(a), str(tmp_path / "missing.json")]).exit_code == 2


def test_compare_never_gates_cpu_smoke(tmp_path):
    """Two CPU runs of the same code (cpu-smoke rows, any ratio) compare clean and say why."""
    from test_harness import _bundle

    a = _bundle(1.0).save_as(tmp_path / "a.json")
    b = _bundle(3.0).save_as(tmp_path / "b.json")
    r = runner.invoke(cli.app, ["compare", str(a), str(b)])
    assert r.exit_code == 0 and "no regressions" in r.output and "cpu-smoke: 2 rows shown, never gated" in r.output


def test_env_prints_json():
    r = runner.invoke(cli.app, ["env"])
    assert r.exit_code == 0 and "torch" in json.loads(r.output)


def test_publish_copies_and_relinks(tmp_path):
    from test_harness import _bundle

    from k3lab import report

    run = tmp_path / "runs" / "r1"
    b = _bundle()
    b.env = {**b.env, "gpu": "NVIDIA H200", "gpu_slug": "h200"}  # a stand-in: made on that device
    b.save(run)
    report.bundle_report(b, run / "01.html")
    profiles = tmp_path / "profiles"
    js = shared_plotly_js()
    (profiles / "assets").mkdir(parents=True)
    (profiles / "assets" / js.name).write_text("/* stand-in */")
    r = runner.invoke(cli.app, ["publish", str(run), "--gpu", "h200", "--profiles", str(profiles)])
    assert r.exit_code == 0, r.output
    html = (profiles / "h200" / "t-bundle.html").read_text()
    assert f'src="../assets/{js.name}"' in html
    assert json.loads((profiles / "h200" / "t-bundle.json").read_text())["name"] == "t-bundle"
    assert runner.invoke(cli.app, ["publish", str(tmp_path / "empty")]).exit_code == 2
    r = runner.invoke(cli.app, ["publish", str(run), "--gpu", "x", "--profiles", str(profiles)])
    assert r.exit_code == 2 and "measured on 'h200'" in r.output  # evidence stays under the device that made it
    b.rows, b.name = [], "t-empty"
    b.save(tmp_path / "runs" / "r2")
    r = runner.invoke(cli.app, ["publish", str(tmp_path / "runs" / "r2"), "--profiles", str(profiles)])
    assert r.exit_code == 2 and "holds no rows" in r.output


def test_publish_a_bench_bundle_gzipped_with_its_readme_row(tmp_path):
    """A bench bundle published with --gzip --no-report: NAME.json.gz under profiles/<gpu>/ and a row at the top of
    that README's table naming the bench command its config gives (found by `targets.made_by`); once only."""
    import gzip

    from test_harness import _bundle

    from k3lab import targets as tg

    b = _bundle()
    b.env = {**b.env, "gpu": "NVIDIA H100 80GB HBM3", "gpu_slug": "h100-80gb-hbm3", "commit": "abcdef123",
             "dirty": False}
    b.config = {"bench": "kda", "ops": ["kda_decode"], "grid": {"batch": [1, 8]}, "backends": ["cute"],
                "peers": False, "skip": [], "mode": "rotated", "reps": 20}
    path = b.save(tmp_path / "out")
    profiles = tmp_path / "profiles"
    (profiles / "h100-80gb-hbm3").mkdir(parents=True)
    (profiles / "h100-80gb-hbm3" / "README.md").write_text("# H100\n\n| file | made by | what |\n|---|---|---|\n"
                                                          "| `old.json.gz` | `x` | y |\n\nprose\n")
    args = ["publish", str(path), "--gzip", "--no-report", "--profiles", str(profiles), "--what", "the rows"]
    r = runner.invoke(cli.app, args)
    assert r.exit_code == 0, r.output
    out = profiles / "h100-80gb-hbm3" / "t-bundle.json.gz"
    assert json.loads(gzip.decompress(out.read_bytes()))["name"] == "t-bundle"
    assert not (profiles / "h100-80gb-hbm3" / "t-bundle.html").exists()
    lines = (profiles / "h100-80gb-hbm3" / "README.md").read_text().splitlines()
    assert lines[4].startswith("| `t-bundle.json.gz` | `python -m k3lab.cli bench kda --ops kda_decode --grid "
                               "batch=1,8 --backends cute --no-peers")
    assert "(code of `abcdef1`) | the rows |" in lines[4]
    assert lines[5].startswith("| `old.json.gz`")
    assert tg.made_by(out.relative_to(tmp_path), root=tmp_path)[1].startswith("`python -m k3lab.cli bench kda")
    assert runner.invoke(cli.app, args).exit_code == 0  # again: the row is there already
    assert (profiles / "h100-80gb-hbm3" / "README.md").read_text().count("t-bundle.json.gz") == 1


def test_defaults_table_is_the_one_the_committed_sweeps_give(tmp_path):
    """data/kda_defaults.json is exactly what `k3lab defaults kda` makes from the bundles its _source names:
    the auto table follows the measured sweep and cannot drift from it by hand."""
    root = Path(__file__).resolve().parent.parent
    committed = json.loads((root / "data" / "kda_defaults.json").read_text())
    cmd = committed["_source"].split("`")[1].split()
    assert cmd[:3] == ["k3lab", "defaults", "kda"]
    bundles = [str(root / a) for a in cmd[3:] if a.endswith((".json", ".json.gz"))]
    assert bundles
    out = tmp_path / "t.json"
    r = runner.invoke(cli.app, ["defaults", "kda", *bundles, "--write", str(out)])
    assert r.exit_code == 0, r.output
    made = json.loads(out.read_text())
    assert {k: v for k, v in made.items() if k != "_source"} == {k: v for k, v in committed.items() if k != "_source"}


def test_defaults_rules_come_from_default_cases_only(tmp_path):
    """A checkpoint study's rows (c > 1: faster, at another tile) beside the default case's must not move the
    verify rule: `k3lab defaults` keys only rows of the op's default case in the axes it does not rule by."""
    def row(be, tv, us, **x):
        return dict(backend=be, median_us=us, error=dict(ok=True),
                    extra=dict(op="kda_verify", heads=12, batch=8, T=8, tile_v=tv, **x))
    rows = [row("cute", 64, 20.0, checkpoint=1), row("cute", 128, 21.0, checkpoint=1),
            row("cute", 128, 12.0, checkpoint=8), row("triton", 8, 40.0, checkpoint=1)]
    src = tmp_path / "b.json"
    src.write_text(json.dumps({"rows": rows}))
    out = tmp_path / "t.json"
    r = runner.invoke(cli.app, ["defaults", "kda", str(src), "--write", str(out)])
    assert r.exit_code == 0, r.output
    verify = json.loads(out.read_text())["verify"]
    assert [x["tile_v"] for x in verify] == [64], verify


def test_defaults_refuses_what_it_cannot_use(tmp_path):
    r = runner.invoke(cli.app, ["defaults", "nosuch", str(tmp_path)])
    assert r.exit_code == 2 and "unknown component 'nosuch'" in r.output and "kda" in r.output
    bad = tmp_path / "b.json"
    bad.write_text(json.dumps({"rows": []}))
    r = runner.invoke(cli.app, ["defaults", "kda", str(bad)])
    assert r.exit_code == 2 and "no passing" in r.output


def test_runs_lists_and_prunes_failed(tmp_path):
    for name, st in (("r1", "ok"), ("r2", "failed")):
        (tmp_path / name).mkdir()
        (tmp_path / name / "run.json").write_text(json.dumps({"status": st, "seconds": 1.0, "error": None}))
    r = runner.invoke(cli.app, ["runs", "--root", str(tmp_path), "--prune-failed"])
    assert r.exit_code == 0 and "r1" in r.output and "deleted 1" in r.output
    assert (tmp_path / "r1").exists() and not (tmp_path / "r2").exists()


def test_run_refuses_unknown_and_mistyped_parameters(tmp_path):
    nb = Path(__file__).resolve().parent.parent / "notebooks" / "02_kda.ipynb"
    with pytest.raises(cli.RunFailed, match=r"no parameter \['seeed'\]"):
        cli.check_params(nb, {"seeed": 1})
    with pytest.raises(cli.RunFailed, match="'reps' expects a number"):
        cli.check_params(nb, {"reps": "abc"})
    got = cli.check_params(nb, {"bundle": "profiles/h200/kda_sweep.json.gz", "reps": 3})
    assert Path(got["bundle"]).is_absolute() and got["reps"] == 3


def test_run_shows_progress_streams_output_and_keeps_warnings_out(tmp_path):
    """`k3lab run`: a line per code cell (n of m, elapsed) and the cells' output; papermill's parse warning
    and the kernel's own start-up messages stay out of the terminal (run.json and kernel.log keep them)."""
    params = new_code_cell("x = 1\nout_dir = ''\ny = 2  # papermill cannot parse this: y = 3",
                           metadata={"tags": ["parameters"]})
    nb = new_notebook(cells=[params, new_code_cell("print('hello from the cell', x)"),
                             new_code_cell("import sys; print('to stderr', file=sys.stderr)")],
                      metadata={"kernelspec": {"name": "python3", "display_name": "Python 3", "language": "python"}})
    path = tmp_path / "p.ipynb"
    nbformat.write(nb, str(path))
    out = tmp_path / "run"
    r = runner.invoke(cli.app, ["run", str(path), "-p", "x", "3", "--out", str(out)])
    assert r.exit_code == 0, r.output
    assert "[k3lab] cell 1 of 4" in r.output and "[k3lab] cell 4 of 4" in r.output and " s  print(" in r.output
    assert "hello from the cell 3" in r.output and "to stderr" in r.output
    assert "Unable to parse" not in r.output and "TCP" not in r.output and "WARNING" not in r.output
    meta = json.loads((out / "run.json").read_text())
    assert any("Unable to parse" in w for w in meta["warnings"])
    assert (out / "kernel.log").exists()
    r = runner.invoke(cli.app, ["run", str(path), "--out", str(tmp_path / "q"), "--quiet"])
    assert r.exit_code == 0 and "[k3lab] cell" not in r.output and "hello" not in r.output


def test_report_mode_hides_code_and_shows_parameters_and_environment(tmp_path):
    nb = _nb(tmp_path / "rm.ipynb", "secret_code_line = 41\nprint('result', secret_code_line + x)")
    r = runner.invoke(cli.app, ["run", str(nb), "-p", "x", "1", "--out", str(tmp_path / "a"), "-q"])
    assert r.exit_code == 0, r.output
    html = (tmp_path / "a" / "rm.html").read_text()
    assert "result 42" in html and "secret_code_line" not in html
    assert "<h3>Parameters</h3>" in html and "<h3>Environment</h3>" in html and "torch" in html
    params = html.split("k3-params")[1].split("</table>")[0]
    assert "<td>x</td><td>1</td><td>set</td>" in params and "out_dir" not in params
    src = json.loads((tmp_path / "a" / "rm.ipynb").read_text())  # the executed notebook keeps its code
    assert any("secret_code_line" in "".join(c["source"]) for c in src["cells"])
    from k3lab.report import export_html  # what `k3lab run --code` asks for

    html = export_html(tmp_path / "a" / "rm.ipynb", tmp_path / "b.html", code=True).read_text()
    assert "secret_code_line" in html and "result 42" in html


def test_missing_notebook_names_no_run_directory(tmp_path):
    r = runner.invoke(cli.app, ["run", str(tmp_path / "nosuch.ipynb")])
    assert r.exit_code == 1 and "does not exist" in r.output and "run directory" not in r.output


def test_parameters_read_whatever_their_comments_say():
    """A parameter whose comment holds '=' (`page_size = 64  # 0 = contiguous cache`) is a parameter: papermill's
    line parser drops it, ours does not; `-p n_experts 8` on the layer notebook is accepted."""
    nbs = Path(__file__).resolve().parent.parent / "notebooks"
    known = cli.notebook_parameters(nbs / "03_mla.ipynb")
    assert known["page_size"] == "64" and known["deadline_s"] == 0 and known["heads"] == "12"
    assert cli.check_params(nbs / "03_mla.ipynb", {"page_size": 0}) == {"page_size": 0}
    assert cli.check_params(nbs / "01_decode_layer.ipynb", {"n_experts": 8}) == {"n_experts": 8}
    with pytest.raises(cli.RunFailed, match="'batch' expects a number"):
        cli.check_params(nbs / "01_decode_layer.ipynb", {"batch": "abc"})
    step_nb = nbs / "06_decode_step.ipynb"  # toggles: true / false or the names to toggle alone
    names = "split_router,owned_output"
    assert cli.check_params(step_nb, {"toggles": names}) == {"toggles": names}
    assert cli.check_params(step_nb, {"toggles": "false"}) == {"toggles": False}
    with pytest.raises(cli.RunFailed, match="'profile' expects true or false"):
        cli.check_params(step_nb, {"profile": "split_router"})


@pytest.mark.parametrize("plan", sorted((Path(__file__).resolve().parent.parent / "plans").glob("*.yaml")),
                         ids=lambda p: p.name)
def test_committed_plans_are_valid(plan):
    """Every plan under plans/ loads and every run's parameters pass the notebook's check."""
    import itertools

    p = cli.load_plan(plan)
    assert p["runs"] and p["baselines"].is_dir()
    for nb, fixed, axes in p["runs"]:
        for vs in itertools.product(*axes.values()):
            cli.check_params(nb, {**fixed, **dict(zip(axes, vs))})


def test_bool_parameters_take_python_and_json_spellings():
    nb = Path(__file__).resolve().parent.parent / "notebooks" / "03_mla.ipynb"
    assert cli.check_params(nb, {"peers": "False"}) == {"peers": False}
    assert cli.check_params(nb, {"peers": "true"}) == {"peers": True}
    with pytest.raises(cli.RunFailed, match="'peers' expects true or false"):
        cli.check_params(nb, {"peers": "no"})
    with pytest.raises(cli.RunFailed, match="'peers' expects true or false"):
        cli.check_params(nb, {"peers": 1})


@pytest.mark.parametrize("args, code, says", [
    (["bench", "mla", "--grid", "batch=0"], 2, "grid batch=[0] gives no valid case"),
    (["bench", "kda", "--grid", "heads=0"], 2, "heads is a size: at least 1"),
    (["check", "moe", "--grid", "batch=abc"], 2, "grid batch=['abc']: expected int values"),
    (["bench", "mla", "--backends", "tritn"], 2, "unknown backend 'tritn' in --backends"),
    (["check", "mla", "--ops", "nosuch"], 2, "unknown ops ['nosuch']"),
    (["check", "mla", "--grid", "contxt=5"], 2, "unknown grid names ['contxt']"),
    (["targets", "--issue", "99"], 2, "issues [99] have no targets"),
    # the value no op takes is named, wherever it sits in the grid; a combination is named as one
    (["check", "kda", "--backends", "reference", "--grid", "heads=2", "--grid", "T=9", "--grid", "D=16"], 2,
     "grid T=[9] gives no valid case"),
    (["check", "moe", "--grid", "n_experts=4", "--grid", "top_k=8"], 2, "the grid's combination gives no valid case"),
    (["check", "mla", "--ops", "mla_decode", "--grid", "heads=2", "--grid", "kv_dtype=fp16"], 2,
     "grid kv_dtype=['fp16'] gives no valid case"),
    (["check", "moe", "--grid", "tp=0"], 2, "tp is a size: at least 1"),
    (["check", "kda", "--backends", "reference", "--grid", "tile_v=7"], 2, "is not a value any backend takes"),
    (["check", "kda", "--grid", "state_dtype=fp64"], 2, "grid state_dtype=['fp64'] gives no valid case"),
    (["bench", "kda", "--grid", "batch=1", "--reps", "0"], 2, "reps must be an int >= 1"),
    (["bench", "kda", "--grid", "batch=1", "--deadline", "-1"], 2, "deadline must be None or >= 0"),
])
def test_bench_check_targets_refuse_what_would_run_nothing(args, code, says):
    """A grid value no op takes, an unknown backend or op, or an issue without targets is refused by name up front
    (before the probes), never an empty bundle, a traceback or an empty table."""
    out = runner.invoke(cli.app, args)
    assert out.exit_code == code, out.output
    assert says in out.output and "Traceback" not in out.output


def test_nothing_ran_is_no_success(tmp_path, monkeypatch):
    """Every backend skipped (Triton without a GPU or the interpreter, no CuTe DSL here): `bench` saves no empty
    bundle and `check` reports no pass; both say why and exit 1."""
    import torch

    if torch.cuda.is_available():
        pytest.skip("Triton runs on a GPU: this is the machine without one")
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    out = runner.invoke(cli.app, ["bench", "mla", "--ops", "mla_query", "--backends", "triton", "--no-peers",
                                  "--no-variants", "--grid", "batch=1", "--out", str(tmp_path)])
    assert out.exit_code == 1 and "no row ran, nothing saved" in out.output and "TRITON_INTERPRET" in out.output
    assert not list(tmp_path.rglob("*.json"))
    out = runner.invoke(cli.app, ["check", "mla", "--ops", "mla_query", "--backends", "triton"])
    assert out.exit_code == 1 and "no check ran" in out.output


def test_notebook_option_grid_parameter():
    """The trunk notebook's `options` (kernel options as a bench grid): "" none, "NAME=v1,v2; NAME2=v3" with values
    parsed as the CLI's --grid parses them, or a dict given as JSON; a malformed item names the parameter."""
    from k3lab.report import option_grid

    assert option_grid("", "options") == {} == option_grid(" ; ", "options")
    assert option_grid("path=null,mma; tile_m=16,64", "options") == {"path": (None, "mma"), "tile_m": (16, 64)}
    assert option_grid({"path": [None, "mma"], "cluster": 8}, "options") == {"path": (None, "mma"), "cluster": (8,)}
    with pytest.raises(ValueError, match="parameter 'options': expected 'NAME=v1,v2"):
        option_grid("path", "options")
    with pytest.raises(ValueError, match="parameter 'options'"):
        option_grid(3, "options")


def test_notebook_list_parameters_take_strings_lists_and_one_value():
    """A list parameter of the notebooks (`batches`, ...) as its parameters cell writes it ("1,8"), as JSON (`-p batches
    '[1, 8]'`, which used to split into '[1' and '8]') or one value; a non-integer where integers are due names it."""
    from k3lab.report import param_values

    assert param_values("1, 8,64", "batches", ints=True) == [1, 8, 64] == param_values([1, 8, 64], "batches", ints=True)
    assert param_values(8, "batches", ints=True) == [8]
    assert param_values("auto,64", "partitions", ints="auto") == ["auto", 64]
    assert param_values(["triton", "cute"], "backends") == ["triton", "cute"] == param_values("triton,cute", "b")
    with pytest.raises(ValueError, match="parameter 'batches': expected integers"):
        param_values("[0]", "batches", ints=True)


_EMPTY_NB = """from k3lab.harness.bundle import Bundle
b = Bundle.new("t-empty")
b.backends_skipped = {"triton": "no GPU here"}
b.config = {"rows_expected": bool(x)}
b.save(out_dir)
"""


def test_a_run_that_measured_nothing_fails_and_says_why(tmp_path):
    """A notebook whose bundle holds no rows (every backend skipped, every case refused) is a failed run naming the
    reasons, unless the bundle says it holds a study without rows (rows_expected False: the KDA drift study)."""
    nb = _nb(tmp_path / "e.ipynb", _EMPTY_NB)
    r = runner.invoke(cli.app, ["run", str(nb), "--out", str(tmp_path / "a"), "-q"])
    assert r.exit_code == 1 and "measured nothing" in r.output and "triton: no GPU here" in r.output
    r = runner.invoke(cli.app, ["run", str(nb), "-p", "x", "0", "--out", str(tmp_path / "b"), "-q"])
    assert r.exit_code == 0, r.output


def test_a_reused_run_folder_keeps_only_this_runs_bundles(tmp_path):
    body = ("import json, os\nos.makedirs(os.path.join(out_dir, 'cpu'), exist_ok=True)\n"
            "json.dump(dict(schema_version=1, name=f't-{x}', env={'gpu_slug': 'cpu'}, config={}, switches={},\n"
            "               backends_ran={'reference': 'cpu'},\n"
            "               rows=[dict(name='r', backend='reference', kind='cpu-smoke', median_us=1.0, p10_us=1.0,\n"
            "                          p90_us=1.0, samples_us=[1.0])]),\n"
            "          open(os.path.join(out_dir, 'cpu', f't-{x}.json'), 'w'))\n")
    nb = _nb(tmp_path / "w.ipynb", body)
    out = tmp_path / "run"
    assert runner.invoke(cli.app, ["run", str(nb), "-p", "x", "1", "--out", str(out), "-q"]).exit_code == 0
    assert runner.invoke(cli.app, ["run", str(nb), "-p", "x", "2", "--out", str(out), "-q"]).exit_code == 0
    meta = json.loads((out / "run.json").read_text())
    assert meta["bundles"] == ["cpu/t-2.json"] and meta["stale_bundles"] == ["cpu/t-1.json"]


def test_compare_and_sweep_refuse_what_would_check_nothing(tmp_path):
    """compare: a new bundle sharing no row with the baseline is no pass (exit 1), a negative threshold is refused
    (exit 2, no traceback); sweep: the threshold is checked before any run; a file that is not a notebook is named."""
    from test_harness import _bundle

    a = _bundle()
    a.save(tmp_path / "a")
    b = _bundle()
    b.rows = []
    b.name = a.name
    b.save(tmp_path / "b")
    r = runner.invoke(cli.app, ["compare", str(tmp_path / "a"), str(tmp_path / "b")])
    assert r.exit_code == 1 and "nothing compared" in r.output
    r = runner.invoke(cli.app, ["compare", str(tmp_path / "a"), str(tmp_path / "a"), "--threshold", "-1"])
    assert r.exit_code == 2 and "--threshold must be" in r.output and "Traceback" not in r.output
    nb = _nb(tmp_path / "s.ipynb", "pass")
    r = runner.invoke(cli.app, ["sweep", str(nb), "--grid", "x=1", "--threshold", "-1", "--out", str(tmp_path / "o")])
    assert r.exit_code == 2 and "--threshold must be" in r.output and not (tmp_path / "o").exists()
    for args in (["run", "README.md"], ["sweep", "README.md", "--grid", "a=1"]):
        r = runner.invoke(cli.app, args)
        assert r.exit_code in (1, 2) and "is not a Jupyter notebook" in r.output and "Traceback" not in r.output
    r = runner.invoke(cli.app, ["sweep", str(nb), "--grid", "x=", "--out", str(tmp_path / "o")])
    assert r.exit_code == 2 and "no values" in r.output
    r = runner.invoke(cli.app, ["sweep", str(nb), "--grid", "x=1", "-p", "x", "2", "--out", str(tmp_path / "o")])
    assert r.exit_code == 2 and "both fixed (-p) and on the grid" in r.output
    with pytest.raises(typer.BadParameter, match="given twice"):
        cli._params_from_args(["-p", "a", "1", "-p", "a", "2"])


def test_mla_partitions_take_ints_on_the_grid_and_the_runs_list_names_the_error(tmp_path):
    r = runner.invoke(cli.app, ["check", "mla", "--ops", "mla_decode", "--backends", "reference", "--grid",
                                "partitions=4", "--grid", "heads=2", "--grid", "batch=1", "--grid", "context=40"])
    assert r.exit_code == 0 and "partitions=4" in r.output, r.output
    step = Path(__file__).resolve().parent.parent / "notebooks" / "06_decode_step.ipynb"
    with pytest.raises(cli.RunFailed, match="'numerics_preset' must be one of"):
        cli.check_params(step, {"numerics_preset": "nope"})
    d = tmp_path / "r1"
    d.mkdir()
    (d / "run.json").write_text(json.dumps({"status": "failed", "seconds": 1.0, "notebook": "/x/05_moe.ipynb",
                                            "error": "notebook 05_moe.ipynb failed in cell 2 of the notebook "
                                                     "(executed cell 3, papermill adds one), execution count 3: "
                                                     "RegistryError: grid tp=[0] gives no valid case"}))
    r = runner.invoke(cli.app, ["runs", "--root", str(tmp_path)])
    assert "05_moe.ipynb" in r.output and "RegistryError: grid tp=[0]" in r.output


def test_option_combinations_fit_the_case():
    """The checker and the bench take only the option combinations that fit a case (op.option_valid): a D = 16
    test head is checked at tiles up to 16, not failed at 32..128."""
    from k3lab import registry

    op = registry.get("kda_decode")
    small = op.case(D=16, heads=2, batch=1)
    tiles = {o["tile_v"] for o in op.options("triton", {"tile_v": (4, 8, 16, 32, 64, 128)}, small)}
    assert tiles == {4, 8, 16}
    assert {o["tile_v"] for o in op.options("triton", {"tile_v": (16, 128)}, op.case(heads=2, batch=1))} == {16, 128}
