"""`k3lab targets`: every committed target evaluates off its bundle, and the evaluator's metrics on a made-up one."""
from __future__ import annotations

import gzip
import json
import math

import pytest
from typer.testing import CliRunner

from k3lab import targets as tg
from k3lab.cli import app


def test_every_committed_target_evaluates():
    res = tg.evaluate_all()
    assert {r.issue for r in res} >= {11, 12, 13, 14, 15, 16}
    assert all(math.isfinite(r.measured) for r in res)
    md = tg.markdown(res)
    assert md.count("\n| #") == len(res) and f"of {len(res)} targets met" in md


def _row(backend, case, median, *, floor=1.0, pct=None, bw="read", ok=True, **extra):
    return {"name": case, "backend": backend, "median_us": median, "floor_us": floor, "pct_of_bw": pct,
            "floor_bw": bw, "bytes": extra.pop("bytes", 1000), "error": {"ok": ok, "outputs": {"state": {
                "rel_norm": extra.pop("state_err", 0.0)}}},
            "extra": {"case": case, "op": "toy", **extra}}


@pytest.fixture
def toy(tmp_path):
    rows = [_row("ours", "toy[b=1]", 4.0, pct=50.0, batch=1, parts="auto"),
            _row("ours", "toy[b=1]", 3.0, pct=60.0, batch=1, parts=8),  # an option variant: the best counts
            _row("peer", "toy[b=1]", 3.5, ok=False, batch=1),  # a peer's time counts though its check failed
            _row("ours", "toy[b=8]", 9.0, pct=90.0, batch=8, parts="auto", state_err=2e-6),
            _row("ours", "toy[b=8]", 1.0, pct=99.0, batch=8, parts=4, ok=False),  # ours failed: never counted
            _row("peer", "toy[b=8]", 10.0, batch=8),
            _row("copy", "toy[b=8]", 5.0, pct=70.0, bw="copy", batch=8)]
    (tmp_path / "b.json.gz").write_bytes(gzip.compress(json.dumps({"rows": rows}).encode()))
    return tmp_path


def _e(**kw):
    return {"issue": 1, "case": "toy", "target": "t", "bundle": "b.json.gz", "where": {"op": "toy"},
            "ours": ["ours"], **kw}


def test_metrics_and_the_worst_case(toy):
    r = tg.evaluate(_e(metric="us", op="<=", value=5.0), toy)
    assert r.measured == 9.0 and not r.met and "b=8" in r.where and "worst of 2" in r.where
    r = tg.evaluate(_e(metric="us", op="<=", value=10.0), toy)
    assert r.met and r.measured == 9.0
    r = tg.evaluate(_e(metric="pct_read", op=">=", value=80.0), toy)
    assert r.measured == 60.0 and not r.met
    with pytest.raises(tg.TargetError, match="'copy'"):
        tg.evaluate(_e(metric="pct_copy", op=">=", value=80.0), toy)
    r = tg.evaluate(_e(metric="x_peer", op="<", value=1.0, peer="peer"), toy)
    assert math.isclose(r.measured, 9.0 / 10.0) and r.met and "b=8" in r.where  # all met: the closest to failing
    r = tg.evaluate(_e(metric="speedup", op=">=", value=1.2, peer="peer"), toy)
    assert math.isclose(r.measured, 10.0 / 9.0) and not r.met  # both fail: the farthest
    r = tg.evaluate(_e(metric="ratio", op="<=", value=2.0, where={"batch": 8}, over={"batch": 1}), toy)
    assert r.measured == 3.0 and not r.met
    r = tg.evaluate(_e(metric="auto_gap", op="<=", value=1.1, group_by=["batch"], auto={"parts": "auto"}), toy)
    assert math.isclose(r.measured, 4.0 / 3.0) and not r.met and "batch=1" in r.where
    r = tg.evaluate(_e(metric="field", op="<=", value=1e-6, field="error.outputs.state.rel_norm", worst_row=True),
                    toy)
    assert r.measured == 2e-6 and not r.met
    r = tg.evaluate(_e(metric="x_floor_sum", op="<=", value=10.0, names=["toy[b=1]", "toy[b=8]"], where={}), toy)
    assert r.measured == (4.0 + 9.0) / 2.0  # the first row of each name, ours


def test_context_peer_is_named_and_never_decides(toy):
    """context_peer: the named backend's value in the worst case's line, beside ours; the verdict is ours alone."""
    r = tg.evaluate(_e(metric="over_floor", op="<=", value=1.0, context_peer="copy"), toy)
    assert r.measured == 8.0 and not r.met and "b=8" in r.where and "copy 4" in r.where
    r = tg.evaluate(_e(metric="over_floor", op="<=", value=2.5, context_peer="copy"), toy)
    assert r.measured == 8.0 and not r.met  # the peer's 4 over does not change the verdict
    r = tg.evaluate(_e(metric="over_floor", op="<=", value=1.0, context_peer=["absent", "copy"]), toy)
    assert r.measured == 8.0 and "copy 4" in r.where  # a list: the fastest of those in the case, named
    r = tg.evaluate(_e(metric="over_floor", op="<=", value=9.0, context_peer="copy", where={"batch": 1}), toy)
    assert r.met and "copy" not in r.where  # no row of it in that case
    with pytest.raises(tg.TargetError, match="'copy' bandwidth"):  # a peer on another floor is no context
        tg.evaluate(_e(metric="pct_read", op=">=", value=80.0, context_peer="copy"), toy)


def test_bad_entries_are_named(toy, tmp_path):
    with pytest.raises(tg.TargetError, match="does not exist"):
        tg.evaluate(_e(bundle="none.json.gz", metric="us", op="<=", value=1.0), toy)
    with pytest.raises(tg.TargetError, match="no row"):
        tg.evaluate(_e(metric="us", op="<=", value=1.0, where={"op": "other"}), toy)
    spec = tmp_path / "spec.json"
    spec.write_text(json.dumps({"targets": [_e(metric="speed", op="<=", value=1.0)]}))
    with pytest.raises(tg.TargetError, match="metric must be one of"):
        tg.load_spec(spec)
    spec.write_text(json.dumps({"targets": [{"issue": 1, "case": "x"}]}))
    with pytest.raises(tg.TargetError, match="lacks 'target'"):
        tg.load_spec(spec)
    with pytest.raises(tg.TargetError, match="no such file"):
        tg.load_spec(tmp_path / "missing.json")


def test_cli_targets():
    out = CliRunner().invoke(app, ["targets", "--issue", "15"])
    assert out.exit_code == 0, out.output
    assert "| #15 |" in out.output and "| #12 |" not in out.output
    out = CliRunner().invoke(app, ["targets", "--spec", "/nonexistent.json"])
    assert out.exit_code == 2 and "no such file" in out.output


def test_status_page_matches_the_bundles():
    """docs/STATUS.md is `k3lab targets --write docs/STATUS.md` of the committed bundles: remake it when a bundle or
    a target changes."""
    assert tg.STATUS.read_text() == tg.status_page(), \
        "docs/STATUS.md is stale: run `k3lab targets --write docs/STATUS.md`"


def test_profiles_reads_another_directory_by_name(toy, tmp_path):
    """--profiles: the entries' bundles (by name, wherever the entry's path points) read from another directory; a
    bundle that is not there gives a not-measured line, never an error, and the summary counts the measured only."""
    other = tmp_path / "gpu2"
    other.mkdir()
    (other / "b.json.gz").write_bytes((toy / "b.json.gz").read_bytes())
    e = _e(bundle="profiles/h200/b.json.gz", metric="us", op="<=", value=10.0)
    r = tg.evaluate(e, tmp_path, profiles="gpu2")
    assert r.measured_here and r.met and r.measured == 9.0 and r.bundle == "b.json.gz"
    gone = tg.evaluate(_e(bundle=["profiles/h200/b.json.gz", "profiles/h200/c.json.gz"], metric="us", op="<=",
                          value=1.0), tmp_path, profiles="gpu2")
    assert not gone.measured_here and "no c.json.gz there" in gone.where
    md = tg.markdown([r, gone], "gpu2/")
    assert "| - | not measured |" in md and "bundle (gpu2/)" in md and "1 of 1 targets met (1 not measured there)" in md
    with pytest.raises(tg.TargetError, match="no such directory"):
        tg.evaluate_all([e], tmp_path, profiles="gpu2x")
    # a bundle there without the rows a target reads (a peer not carried to that GPU): not measured, with why; the
    # same entry on the committed bundles stays an error
    nopeer = _e(bundle="profiles/h200/b.json.gz", metric="x_peer", op="<", value=1.0, peer="fa3")
    r = tg.evaluate(nopeer, tmp_path, profiles="gpu2")
    assert not r.measured_here and "not measurable there" in r.where and "fa3" in r.where
    with pytest.raises(tg.TargetError, match="no row of peer"):
        tg.evaluate(dict(nopeer, bundle="b.json.gz"), toy)


def test_x_peer_compares_within_one_run(tmp_path):
    """Ours is held against the peer of the same run (bundle), the newest run that timed both: a faster peer row of
    another run does not count, and ours and a peer never timed together are an error naming the case."""
    def bundle(name, date, rows):
        (tmp_path / name).write_text(json.dumps({"created": date, "rows": rows}))

    def row(be, us):
        return {"name": "toy[b=1]", "backend": be, "median_us": us, "error": {"ok": True},
                "extra": {"op": "toy", "case": "toy[b=1]"}}

    bundle("old.json", "2026-12-01", [row("triton", 9.0), row("cublas", 6.0)])
    bundle("new.json", "2026-12-06", [row("triton", 8.0), row("cublas", 10.0)])
    e = _e(bundle=["old.json", "new.json"], metric="x_peer", op="<", value=1.0, peer="cublas", ours=["triton"])
    r = tg.evaluate(e, tmp_path)
    assert r.met and r.measured == pytest.approx(0.8)  # the newest run's pair, not 8.0 against the older 6.0
    bundle("peer_only.json", "2026-12-07", [row("cublas", 1.0)])
    r = tg.evaluate(dict(e, bundle=["old.json", "new.json", "peer_only.json"]), tmp_path)
    assert r.measured == pytest.approx(0.8)  # a run with the peer alone pairs with nothing
    bundle("ours_only.json", "2026-12-01", [row("triton", 1.0)])
    with pytest.raises(tg.TargetError, match="no run times ours and peer"):
        tg.evaluate(dict(e, bundle=["ours_only.json", "peer_only.json"]), tmp_path)


def test_cli_targets_profiles():
    out = CliRunner().invoke(app, ["targets", "--issue", "14", "--profiles", "profiles/h100-80gb-hbm3"])
    assert out.exit_code == 0, out.output
    assert "not measured" in out.output and "bundle (profiles/h100-80gb-hbm3/)" in out.output
    out = CliRunner().invoke(app, ["targets", "--issue", "14", "--profiles", "h100-80gb-hbm3"])  # a GPU's name
    assert out.exit_code == 0 and "bundle (profiles/h100-80gb-hbm3/)" in out.output, out.output
    out = CliRunner().invoke(app, ["targets", "--profiles", "profiles/h100-80gb-hbm3", "--write", "/tmp/x.md"])
    assert out.exit_code == 2 and "no --profiles" in out.output


def test_alternative_bundles_take_the_newest(toy, tmp_path):
    """"a|b": the newest of the alternatives that exist (a new run of either takes over); one alone is used; none
    is the first's missing-bundle error; --profiles moves each alternative by name."""
    rows = json.loads(gzip.decompress((toy / "b.json.gz").read_bytes()))["rows"]
    for name, created, scale in (("old.json.gz", "2026-12-01", 2.0), ("new.json.gz", "2026-12-03", 1.0)):
        rs = [dict(r, median_us=r["median_us"] * scale) for r in rows]
        (tmp_path / name).write_bytes(gzip.compress(json.dumps({"rows": rs, "created": created}).encode()))
    e = _e(metric="us", op="<=", value=10.0)
    for b in ("old.json.gz|new.json.gz", "new.json.gz|old.json.gz"):
        r = tg.evaluate(dict(e, bundle=b), tmp_path)
        assert r.measured == 9.0 and r.date == "2026-12-03" and r.bundle == "new.json.gz", b
    assert tg.evaluate(dict(e, bundle="gone.json.gz|old.json.gz"), tmp_path).measured == 18.0
    with pytest.raises(tg.TargetError, match="gone.json.gz"):
        tg.evaluate(dict(e, bundle="gone.json.gz|gone2.json.gz"), tmp_path)
    other = tmp_path / "gpu2"
    other.mkdir()
    (other / "old.json.gz").write_bytes((tmp_path / "old.json.gz").read_bytes())
    r = tg.evaluate(dict(e, bundle="profiles/h200/new.json.gz|profiles/h200/old.json.gz"), tmp_path, profiles="gpu2")
    assert r.measured_here and r.measured == 18.0 and r.bundle == "old.json.gz"
    # two entries that resolve to one newer bundle read it once; before it exists each reads its own older one
    assert tg._pick(["new.json.gz|old.json.gz", "new.json.gz|b.json.gz"], tmp_path) == ["new.json.gz"]
    assert tg._pick(["gone.json.gz|old.json.gz", "gone.json.gz|b.json.gz"], tmp_path) == ["old.json.gz", "b.json.gz"]


def test_beside_another_gpu(toy, tmp_path):
    """--beside: one more column per directory (its value and whether it meets the target there, `-` where its
    bundle is missing) and one more summary line; the lists must be the same targets."""
    other = tmp_path / "gpu2"
    other.mkdir()
    (other / "b.json.gz").write_bytes((toy / "b.json.gz").read_bytes())
    es = [_e(bundle="b.json.gz", metric="us", op="<=", value=5.0), _e(bundle="c.json.gz", metric="us", op="<=",
                                                                     value=5.0, case="toy2")]
    (toy / "c.json.gz").write_bytes((toy / "b.json.gz").read_bytes())
    mine = [tg.evaluate(e, toy) for e in es]
    there = [tg.evaluate(e, tmp_path, profiles="gpu2") for e in es]
    md = tg.markdown(mine, "x/", beside=[("gpu2", there)])
    assert "| on gpu2 |" in md and "| 9 (**no**) |" in md and md.splitlines()[3].endswith("| - |")
    assert "on gpu2: 0 of 1 targets met (1 not measured there)." in md
    with pytest.raises(tg.TargetError, match="not the same targets"):
        tg.markdown(mine, "x/", beside=[("gpu2", there[:1])])


def test_cli_targets_beside():
    out = CliRunner().invoke(app, ["targets", "--issue", "12", "--beside", "h100-80gb-hbm3"])
    assert out.exit_code == 0 and "| on h100-80gb-hbm3 |" in out.output and "on h100-80gb-hbm3: " in out.output, \
        out.output
    out = CliRunner().invoke(app, ["targets", "--beside", "h100-80gb-hbm3", "--write", "/tmp/x.md"])
    assert out.exit_code == 2 and "--beside" in out.output


def test_profiles_takes_a_plain_bundle_for_a_gzipped_name(toy, tmp_path):
    """A bench writes NAME.json where the committed bundle is NAME.json.gz: --profiles reads either form."""
    other = tmp_path / "gpu2"
    other.mkdir()
    (other / "b.json").write_bytes(gzip.decompress((toy / "b.json.gz").read_bytes()))
    r = tg.evaluate(_e(bundle="profiles/h200/b.json.gz", metric="us", op="<=", value=10.0), tmp_path,
                    profiles="gpu2")
    assert r.measured_here and r.measured == 9.0 and r.bundle == "b.json"


def test_remake_commands_rebuild_every_bench_bundle_as_it_is_read():
    """--commands: each target bundle a `k3lab bench` made comes back as a bench command under the same file name
    (the grid, ops and backends the current registry still takes: a removed option value is left out and said), the
    others name the README line that made them, and the last line reads the new directory."""
    import shlex

    from k3lab import registry
    from k3lab.bench import runner
    from k3lab.cli import _grid

    spec = tg.load_spec()
    text = tg.remake_commands(spec, gpu="h100-80gb-hbm3")
    lines = text.splitlines()
    assert lines[-1] == "python -m k3lab.cli targets --profiles profiles/runs/targets/h100-80gb-hbm3"
    names = set()
    for line in lines:
        if not line.startswith("python -m k3lab.cli bench "):
            continue
        a = shlex.split(line.split("  #")[0])
        comp, opt = a[4], {x: a[i + 1] for i, x in enumerate(a) if x.startswith("--") and i + 1 < len(a)}
        ops = [o for o in registry.ops_of(comp) if "--ops" not in opt or o.name in opt["--ops"].split(",")]
        grid = _grid([a[i + 1] for i, x in enumerate(a) if x == "--grid"])
        assert set(grid) <= set().union(*(set(o.axes) | set(o.option_axes) for o in ops)), line
        runner.grid_cases("remake", ops, grid, opt["--backends"].split(","))  # raises on what would run nothing
        names.add(opt["--name"])
    want = {b.split("/")[-1].split(".")[0] for e in spec for b in tg._bundles_of(e, tg.ROOT)}
    assert {"kda_decode_fi", "mla_rule_sweep", "proj_cute", "moe_mxfp4_trigger"} <= names <= want
    assert "left out, no backend takes it now: alpha=warp" in text  # attnres_twopass's removed alpha form
    head = next(ln for ln in lines if ln.startswith("# mla_rule_sweep.json.gz"))
    assert head.endswith("(its rows need CuTe DSL (.gpu/cute), FlashInfer (.gpu/fi; fa3 also .gpu/fijit))")
    assert "need" not in next(ln for ln in lines if ln.startswith("# mla_verify_def.json.gz"))  # Triton alone
    for other in want - names:  # the step bundles, run records and the explore sweeps: their README line
        assert f"# {other}" in text
    assert "not a `k3lab bench` bundle: made by (profiles/h200/README.md)" in text
    assert tg.made_by("profiles/h200/no_such_bundle.json") is None


def test_cli_targets_commands():
    out = CliRunner().invoke(app, ["targets", "--commands", "--issue", "16", "--out", "/tmp/remake"])
    assert out.exit_code == 0, out.output
    assert "--name kda_decode_fi --out /tmp/remake" in out.output
    assert out.output.rstrip().splitlines()[-1].startswith("python -m k3lab.cli targets --profiles /tmp/remake/")
    out = CliRunner().invoke(app, ["targets", "--commands", "--write", "/tmp/x.md"])
    assert out.exit_code == 2 and "--commands prints commands" in out.output


def test_cases_a_deadline_left_out_are_not_met(toy):
    """A bench stopped by --deadline notes the cases it never ran: a target that reads one of them is not met (its
    line says so), whatever the cases that ran give; cases the target does not read change nothing."""
    d = json.loads(gzip.decompress((toy / "b.json.gz").read_bytes()))
    d["notes"] = ["deadline reached; cases not run: ['toy[batch=64,parts=auto]', 'other[batch=1]']"]
    (toy / "b.json.gz").write_bytes(gzip.compress(json.dumps(d).encode()))
    r = tg.evaluate(_e(metric="us", op="<=", value=10.0), toy)
    assert not r.met and r.measured == 9.0 and "1 of its cases not run (bench deadline), e.g. toy[batch=64" in r.where
    assert tg.evaluate(_e(metric="us", op="<=", value=10.0, where={"op": "toy", "max_batch": 8}), toy).met
    assert tg.evaluate(_e(metric="us", op="<=", value=10.0, where={"op": "toy", "batch": [1, 8]}), toy).met


def test_another_gpus_bundle_with_fewer_cases_is_not_met(toy):
    """--profiles: a bundle of the same name that holds fewer of a target's cases than the committed one (a smaller
    grid) cannot meet an "every case" target: not met, with how many cases it had."""
    other = toy / "gpu2"
    other.mkdir()
    d = json.loads(gzip.decompress((toy / "b.json.gz").read_bytes()))
    d["rows"] = [r for r in d["rows"] if r["extra"].get("batch") == 1]
    (other / "b.json").write_text(json.dumps(d))
    e = _e(metric="us", op="<=", value=10.0)
    assert tg.evaluate(e, toy).met and tg.evaluate(e, toy).cases == 2
    r = tg.evaluate(e, toy, profiles="gpu2")
    assert r.measured_here and not r.met and "only 1 of the 2 cases the committed bundles hold" in r.where


def test_every_evidence_file_says_what_made_it():
    """Every file under profiles/<gpu>/ (bundles, reports, logs) has a row in the README above it naming the command
    that made it (`made_by`, what `k3lab targets --commands` prints for a bundle no bench made)."""

    root = tg.ROOT / "profiles"
    files = [f for f in root.rglob("*") if f.is_file() and f.name != "README.md"
             and f.relative_to(root).parts[0] not in ("assets", "runs")]
    assert len(files) > 50
    missing = [str(f.relative_to(tg.ROOT)) for f in files if tg.made_by(f.relative_to(tg.ROOT)) is None]
    assert not missing, f"evidence without a README row naming what made it: {missing}"
