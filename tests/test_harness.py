"""Harness: timing, roofline, numerics, env, bundles, reports, switches mapping."""
from __future__ import annotations

import json

import pytest
import torch

from k3lab.harness import bundle as bmod
from k3lab.harness import env, numerics, roofline, timing
from k3lab.harness.bundle import Bundle, BundleError, Row
from k3lab.switches import SwitchError, Switches

HAS_CUDA = torch.cuda.is_available()
gpu = [pytest.mark.gpu, pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU")]


# ---- timing ---------------------------------------------------------------------------------------

def test_percentile_and_from_samples():
    t = timing.Timing.from_samples("cpu-smoke", [1, 2, 3, 4, 5, 6, 7, 8, 9, 10])
    assert t.median_us == 5.5 and t.min_us == 1
    assert t.p10_us == pytest.approx(1.9) and t.p90_us == pytest.approx(9.1)
    with pytest.raises(ValueError):
        timing.Timing.from_samples("gpu-fast", [1.0])
    with pytest.raises(ValueError):
        timing.Timing.from_samples("cpu-smoke", [])


def test_bench_cpu_is_labelled_smoke_and_rotates_sets():
    a = torch.randn(64, 64)
    seen = []
    t = timing.bench_cpu(lambda x: seen.append(x) or x @ x, input_sets=[(a,), (a + 1,)], warmup=1, reps=6)
    assert t.kind == "cpu-smoke" and len(t.samples_us) == 6 and t.input_sets == 2
    assert t.bytes_per_call == a.numel() * 4 and "not a GPU figure" in t.note
    assert seen[1] is not seen[2]
    with pytest.raises(ValueError):
        timing.bench_cpu(lambda x: x, input_sets=[(a,)], make_inputs=lambda: (a,))


def test_bench_dispatch_and_no_cuda_refusal():
    t = timing.bench(lambda: torch.ones(8).sum(), device="cpu", reps=3, graph=True)
    assert t.kind == "cpu-smoke"
    if not HAS_CUDA:
        with pytest.raises(RuntimeError, match="bench_cpu"):
            timing.bench_gpu(lambda: None)


def test_rotation_count_from_bytes_vs_l2():
    l2 = 60 * 2**20
    assert timing.rotation_count(1 << 10, l2) == 64  # tiny calls: capped
    assert timing.rotation_count(112 * 10**6, l2) == 3  # a TP8 KDA layer's weights
    assert timing.rotation_count(10 * l2, l2) == 1  # far past L2 by itself
    assert timing.rotation_count(1000, 0) == 1  # no L2 known (CPU)


def test_tensor_bytes_counts_each_tensor_once():
    a = torch.zeros(10, dtype=torch.bfloat16)
    assert timing.tensor_bytes((a, [a, {"x": torch.zeros(4)}], 3)) == 20 + 16


def test_cpu_floors_and_kernel_list():
    assert timing.measure_copy_bandwidth(nbytes=32 * 2**20, reps=3, device="cpu") > 0
    assert timing.launch_floor_us(launches=50, reps=3, device="cpu") > 0
    assert timing.measure_read_bandwidth(nbytes=32 * 2**20, reps=3, device="cpu") > 0
    pr = timing.probes("cpu")
    assert pr["kind"] == "cpu-smoke" and set(pr) == {"copy_tbps", "read_tbps", "launch_us", "kind"}
    assert timing.probes("cpu") == pr  # measured once per process
    t = timing.bench_cpu(lambda a: a + 1, input_sets=[(torch.ones(4),)] * 3, reps=3)
    assert t.mode == "hot" and t.kind == "cpu-smoke"
    with pytest.raises(ValueError, match="mode"):
        timing.Timing.from_samples("cpu-smoke", [1.0], mode="warm")
    x = torch.randn(16, 16)
    kl = timing.kernel_list(lambda: torch.relu(x @ x), calls=2)
    names = [k["name"] for k in kl]
    if not HAS_CUDA:
        assert "aten::matmul" in names or "aten::mm" in names
        assert all(k["count"] == 1 for k in kl) and timing.launches_per_call(kl) is None
    # durations over rotated input sets: one time a launch, every call of the rotation counted
    ys = [torch.randn(16, 16) for _ in range(3)]
    kd = timing.kernel_list(lambda y: torch.relu(y @ y), calls=4, input_sets=[(y,) for y in ys], durations=True)
    assert kd and all(len(k["us"]) == round(k["count"] * 4) and all(u >= 0 for u in k["us"]) for k in kd)
    assert "us" not in kl[0]
    with pytest.raises(ValueError, match="input_sets"):
        timing.kernel_list(lambda y: y, input_sets=[])


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU")
def test_gpu_graph_timing_and_floors():
    w = [torch.randn(4096, 4096, device="cuda", dtype=torch.bfloat16) for _ in range(3)]
    x = torch.randn(1, 4096, device="cuda", dtype=torch.bfloat16)
    t = timing.bench_gpu(lambda wi: x @ wi, input_sets=[(wi,) for wi in w], reps=10)
    assert t.kind == "gpu-graph" and t.calls_per_sample >= 20 and t.input_sets == 3 and t.mode == "rotated"
    th = timing.bench_gpu(lambda wi: x @ wi, input_sets=[(wi,) for wi in w], reps=10, rotate=False)
    assert th.mode == "hot" and th.input_sets == 1
    rb = timing.measure_read_bandwidth(nbytes=2**30, reps=5)
    assert 0.1 < rb < 20
    assert 0 < t.p10_us <= t.median_us <= t.p90_us
    bw = timing.measure_copy_bandwidth(nbytes=2**30, reps=5)
    assert 0.1 < bw < 20
    assert 0.2 < timing.launch_floor_us() < 50
    kl = timing.kernel_list(lambda: x @ w[0])
    assert kl and timing.launches_per_call(kl) >= 1
    # a callable that syncs cannot be captured: falls back to eager, says why
    t2 = timing.bench_gpu(lambda: (x @ w[0]).sum().item(), reps=5)
    assert t2.kind == "gpu-eager" and "capture failed" in t2.note


# ---- roofline / numerics --------------------------------------------------------------------------

def test_floor_bytes_vs_launch():
    f = roofline.floor(4_275_000, bw_tbps=4.275, launch_us=2.0)
    assert f.bytes_us == pytest.approx(1.0) and f.floor_us == 2.0 and f.bound == "launch"
    g = roofline.floor(112 * 10**6, 10**9, bw_tbps=4.275, launch_us=2.0, bw_kind="copy")
    assert g.bound == "copy" and g.floor_us == pytest.approx(112e6 / 4.275e12 * 1e6)
    a = roofline.assess(2 * g.floor_us, g)
    assert a["distance"] == pytest.approx(2.0) and a["pct_of_bw"] == pytest.approx(50.0) and a["floor_bw"] == "copy"
    assert roofline.floor(0, 10**12, bw_tbps=4, launch_us=1, peak_tflops=100).bound == "flops"
    with pytest.raises(ValueError):
        roofline.floor(-1, bw_tbps=1, launch_us=1)
    with pytest.raises(ValueError, match="bw_kind"):
        roofline.floor(1, bw_tbps=1, launch_us=1, bw_kind="write")
    pr = dict(copy_tbps=4.2, read_tbps=4.6, launch_us=2.0)
    r = roofline.floor_from_probes(46 * 10**6, 0, pr, "read")
    assert r.bound == "read" and r.floor_us == pytest.approx(10.0)
    assert roofline.floor_from_probes(42 * 10**6, 0, pr, "copy").floor_us == pytest.approx(10.0)


def test_numerics_errors_and_nan_never_passes():
    ref = torch.randn(100, dtype=torch.float64)
    e = numerics.error_stats(ref.to(torch.bfloat16), ref, tol=1e-2)
    assert 0 < e.rel_norm < 1e-2 and e.ok and e.max_abs > 0
    assert numerics.error_stats(ref.clone(), ref).rel_norm == 0.0
    bad = ref.clone()
    bad[3] = float("nan")
    e = numerics.error_stats(bad, ref)  # no tolerance given: NaN still fails
    assert not e.ok and e.nonfinite == 1 and e.to_dict()["rel_norm"] is None
    json.dumps(e.to_dict(), allow_nan=False)
    assert not numerics.error_stats(torch.full((3,), float("inf")), torch.ones(3, dtype=torch.float64)).ok
    e = numerics.error_stats((ref, {"s": ref * 2}), (ref, {"s": ref * 2 + 1}))
    assert e.max_abs == pytest.approx(1.0)
    with pytest.raises(ValueError):
        numerics.error_stats(torch.zeros(3), torch.zeros(4))
    with pytest.raises(AssertionError):
        numerics.check(ref * 1.1, ref, tol=1e-3)


def test_env_fingerprint():
    fp = env.fingerprint()
    for k in ("gpu", "sm_count", "driver", "cuda", "torch", "triton", "cutlass_dsl", "fla", "python",
              "hostname", "commit", "dirty", "time", "source_digest"):
        assert k in fp
    json.dumps(fp)
    assert env.gpu_slug("NVIDIA H200") == "h200" and env.gpu_slug(None) == "cpu"
    assert env.gpu_slug("NVIDIA GeForce RTX 4090") == "rtx-4090"


def test_source_digest_follows_the_files(tmp_path):
    (tmp_path / "k3lab").mkdir()
    (tmp_path / "k3lab" / "a.py").write_text("x = 1\n")
    (tmp_path / "data").mkdir()
    (tmp_path / "data" / "t.json").write_text("{}")
    d0 = env.source_digest(tmp_path)
    assert d0 and len(d0) == 16 and env.source_digest(tmp_path) == d0
    (tmp_path / "notes.md").write_text("not source")
    assert env.source_digest(tmp_path) == d0
    (tmp_path / "k3lab" / "a.py").write_text("x = 2\n")
    assert env.source_digest(tmp_path) != d0
    assert env.source_digest(tmp_path / "empty") is None


def test_source_digest_of_head_matches_a_clean_tree():
    """What a bundle records (the files) and what `k3lab digest HEAD` computes (the commit) agree when the
    source files are committed, so a bundle can be matched to its commit even when its .git was stale."""
    root = env.REPO_ROOT
    status = env._run(["git", "status", "--porcelain", "--untracked-files=all", "--", "k3lab", "kernels", "data",
                       "pyproject.toml"], root)
    if status is None:
        pytest.skip("not a git checkout")
    if any(line.endswith(".py") or line.endswith(".json") or line.endswith(".toml") for line in status.splitlines()):
        pytest.skip("source files differ from HEAD in this checkout")
    assert env.source_digest() == env.source_digest_of("HEAD")
    with pytest.raises(ValueError, match="git archive"):
        env.source_digest_of("no-such-revision")


# ---- bundles --------------------------------------------------------------------------------------

def _bundle(scale: float = 1.0, err_ok: bool = True, kind: str = "cpu-smoke") -> Bundle:
    from k3lab.config import preset

    b = Bundle.new("t-bundle", view=preset("tiny"), switches=Switches(kda_tile_v=32),
                   env={"gpu": None, "gpu_slug": "cpu"}, backends_ran={"reference": "torch"},
                   backends_skipped={"cute": "not installed"}, copy_tbps=0.05, launch_floor_us=1.0)
    for i, name in enumerate(["kda.in_proj", "kda.recurrence"]):
        t = timing.Timing.from_samples(kind, [scale * (10 + i + j) for j in range(5)])
        fl = roofline.floor(1000, 10, bw_tbps=0.05, launch_us=1.0, bw_kind="read")
        err = numerics.ErrorStats(1e-3 if err_ok else float("nan"), 1e-3, 10, 0 if err_ok else 1, 1e-2)
        b.add(Row.from_timing(name, "reference", t, floor=fl, error=err, layer="kda"))
    return b


def test_bundle_round_trip(tmp_path):
    b = _bundle()
    p = b.save(tmp_path)
    assert p == tmp_path / "cpu" / "t-bundle.json"
    b2 = bmod.load(p)
    assert b2.to_dict() == b.to_dict()
    d = json.loads(p.read_text())
    assert d["schema_version"] == bmod.SCHEMA_VERSION and d["switches"]["kda_tile_v"] == 32
    assert d["config"]["view"]["heads"] == 4 and d["config"]["model"]["hidden_size"] == 64
    r = d["rows"][0]
    for k in ("name", "backend", "median_us", "p10_us", "p90_us", "samples_us", "floor_us", "bytes", "flops",
              "achieved_tbps", "pct_of_bw", "floor_bw", "mode", "launches", "kernels", "error", "extra"):
        assert k in r
    assert bmod.load(tmp_path / "cpu").name == "t-bundle"  # a directory with one bundle
    assert len(b.table()) == 2


def test_bundle_validation_names_the_problem(tmp_path):
    d = _bundle().to_dict()
    d["rows"][0]["kind"] = "gpu-ish"
    with pytest.raises(BundleError, match="timing kind"):
        bmod.validate(d)
    d = _bundle().to_dict()
    del d["rows"][1]["median_us"]
    with pytest.raises(BundleError, match="median_us"):
        bmod.validate(d)
    d = _bundle().to_dict()
    d["rows"].append(dict(d["rows"][0]))
    with pytest.raises(BundleError, match="duplicate"):
        bmod.validate(d)
    (tmp_path / "x.json").write_text("{nope")
    with pytest.raises(BundleError, match="not JSON"):
        bmod.load(tmp_path / "x.json")
    d = _bundle().to_dict()
    d["schema_version"] = 99
    with pytest.raises(BundleError, match="newer"):
        bmod.validate(d)


def test_compare_regressions():
    g = "gpu-graph"
    a = _bundle(kind=g)
    same = bmod.compare(a, _bundle(1.02, kind=g), 0.05)
    assert not same.has_regressions and all(r["ratio"] == pytest.approx(1.02) for r in same.rows)
    slow = bmod.compare(a, _bundle(1.2, kind=g), 0.05)
    assert slow.has_regressions and len(slow.regressions) == 2
    assert bmod.compare(a, _bundle(1.2, kind=g), 0.25).has_regressions is False
    nan = bmod.compare(a, _bundle(err_ok=False, kind=g))
    assert nan.has_regressions and "error check" in nan.regressions[0]["why"]
    mixed = bmod.compare(_bundle(), _bundle(5.0, kind=g))
    assert not mixed.has_regressions and mixed.rows[0]["ratio"] is None
    # two CPU runs of the same code: wall clock on a shared CPU is shown, never gated
    cpu = bmod.compare(_bundle(), _bundle(3.0))
    assert not cpu.has_regressions and "never gated" in cpu.rows[0]["why"] and cpu.rows[0]["ratio"] == 3.0
    assert bmod.compare(_bundle(), _bundle(err_ok=False)).has_regressions  # a failing check still counts


# ---- switches mapping -----------------------------------------------------------------------------

def test_switches_from_notebook_params():
    params = dict(preset="tiny", batch=1, draft_depth=3, kv_dtype="fp8", kda_tile_v=4, mla_partitions=16,
                  backend_kda="triton", out_dir="/tmp/x", seed=0)
    s = Switches.from_params(params)
    assert s.kda_tile_v == 4 and s.mla_partitions == 16  # draft_depth and kv_dtype are the view's
    assert s.backend["kda"] == "triton" and s.backend["mla"] == "reference"
    assert Switches.from_dict(json.loads(s.to_json())) == s
    with pytest.raises(SwitchError, match="kda_tile_v"):
        Switches.from_params({"kda_tile_v": 5})


# ---- reports --------------------------------------------------------------------------------------

def test_bundle_report_uses_the_shared_plotly(tmp_path):
    from k3lab import report

    js = report.shared_plotly_js()
    assert js.parent == report.PROFILES_DIR / "assets"
    copies = [p for p in (report.PROFILES_DIR / "assets").glob("plotly*.js")]
    assert len(copies) == 1, f"exactly one shared plotly.js, found {copies}"
    html = report.bundle_report(_bundle(), tmp_path / "deep" / "r.html")
    text = html.read_text()
    src = text.split('data-k3lab-plotly')[0].rsplit('src="', 1)[1].split('"')[0]
    assert (html.parent / src).resolve() == js.resolve()
    assert "Plotly.newPlot" in text and "cdn.plot.ly" not in text and len(text) < 200_000
    assert "kda.recurrence" in text and "rel err vs fp64" in text
    moved = tmp_path / "r2.html"
    moved.write_text(text)
    new = report.relink_plotly(moved)
    assert (moved.parent / new).resolve() == js.resolve()


def test_strip_bulky_outputs():
    import nbformat
    from nbformat.v4 import new_code_cell, new_notebook, new_output

    from k3lab import report

    fig = {"data": [{"type": "bar", "x": [1], "y": [2]}], "layout": {}}
    nb = new_notebook(cells=[new_code_cell("x", outputs=[
        new_output("display_data", data={"text/html": "<script>/** plotly.js v4 */" + "x" * 10}),
        new_output("display_data", data={report.PLOTLY_MIME: fig, "text/plain": "fig"}),
        new_output("stream", name="stdout", text="y" * 300_000)])])
    assert report.strip_bulky_outputs(nb) == 3
    outs = nb.cells[0].outputs
    assert len(outs) == 2 and "Plotly.newPlot" in outs[0]["data"]["text/html"]
    assert "removed" in outs[1]["text"]
    nbformat.validate(nb)


def test_nothing_to_compare_never_passes():
    with pytest.raises(ValueError, match="nothing to compare"):
        numerics.error_stats(None, None)


def test_render_cells_fallback():
    from nbformat.v4 import new_code_cell, new_markdown_cell, new_notebook, new_output

    from k3lab import report

    nb = new_notebook(cells=[new_markdown_cell("# T"), new_code_cell("1/0", outputs=[
        new_output("error", ename="ZeroDivisionError", evalue="x", traceback=["\x1b[31mZeroDivisionError\x1b[0m"]),
        new_output("display_data", data={"text/html": "<b>hi</b>"})])])
    body = report.render_cells(nb)
    assert "ZeroDivisionError" in body and "\x1b" not in body and "<b>hi</b>" in body and "1/0" in body


def test_gzipped_bundle_round_trip(tmp_path):
    from k3lab.harness import bundle as bmod

    from k3lab.config import preset

    b = bmod.Bundle.new("t-gz", view=preset("tiny"), switches=Switches())
    p = b.save_as(tmp_path / "h" / "t-gz.json.gz")
    assert p.read_bytes()[:2] == b"\x1f\x8b" and bmod.load(p).name == "t-gz"
    assert bmod.find_bundles(tmp_path) == [p] and bmod.stem_path(p).name == "t-gz"
    with pytest.raises(bmod.BundleError, match="t-gz.json.gz is there"):
        bmod.load(tmp_path / "h" / "t-gz.json")
