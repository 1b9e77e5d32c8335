"""CLI: parameter parsing, run failures naming the cell, sweep, compare exit codes, env, publish."""
from __future__ import annotations

import json
from pathlib import Path

import nbformat
import pytest
import typer
from nbformat.v4 import new_code_cell, new_notebook
from typer.testing import CliRunner

from k3lab import cli
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
    assert len(list((tmp_path / "runs").iterdir())) == 2
    r = runner.invoke(cli.app, ["sweep", str(nb), "--grid", "x=2,3", "--out", str(tmp_path / "runs2")])
    assert r.exit_code == 1 and "FAILED" in r.output


def _save(tmp_path: Path, name: str, scale: float) -> Path:
    from test_harness import _bundle

    b = _bundle(scale, kind="gpu-graph")
    return b.save_as(tmp_path / f"{name}.json")


def test_compare_exit_codes(tmp_path):
    a, same, slow = _save(tmp_path, "a", 1.0), _save(tmp_path, "b", 1.01), _save(tmp_path, "c", 1.5)
    r = runner.invoke(cli.app, ["compare", str(a), str(same)])
    assert r.exit_code == 0 and "no regressions" in r.output
    r = runner.invoke(cli.app, ["compare", str(a), str(slow)])
    assert r.exit_code == 1 and "REGRESSION" in r.output
    assert runner.invoke(cli.app, ["compare", str(a), str(slow), "--threshold", "0.6"]).exit_code == 0
    assert runner.invoke(cli.app, ["compare", str(a), str(tmp_path / "missing.json")]).exit_code == 2


def test_env_prints_json():
    r = runner.invoke(cli.app, ["env"])
    assert r.exit_code == 0 and "torch" in json.loads(r.output)


def test_publish_copies_and_relinks(tmp_path):
    from test_harness import _bundle

    from k3lab import report

    run = tmp_path / "runs" / "r1"
    b = _bundle()
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


def test_defaults_table_is_the_one_the_committed_sweeps_give(tmp_path):
    """data/kda_defaults.json is exactly what `k3lab defaults kda` makes from the bundles its _source names:
    the auto table follows the measured sweep and cannot drift from it by hand."""
    root = Path(__file__).resolve().parent.parent
    committed = json.loads((root / "data" / "kda_defaults.json").read_text())
    cmd = committed["_source"].split("`")[1].split()
    assert cmd[:3] == ["k3lab", "defaults", "kda"]
    bundles = [str(root / a) for a in cmd[3:] if a.endswith(".json")]
    assert bundles
    out = tmp_path / "t.json"
    r = runner.invoke(cli.app, ["defaults", "kda", *bundles, "--write", str(out)])
    assert r.exit_code == 0, r.output
    made = json.loads(out.read_text())
    assert {k: v for k, v in made.items() if k != "_source"} == {k: v for k, v in committed.items() if k != "_source"}


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
    got = cli.check_params(nb, {"bundle": "profiles/h200/kda_sweep.json", "reps": 3})
    assert Path(got["bundle"]).is_absolute() and got["reps"] == 3
