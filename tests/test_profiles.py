"""Committed evidence under profiles/ stays loadable: every results bundle validates, every report
loads plotly.js from the one shared copy by a relative path that resolves."""
import shutil
import subprocess
from pathlib import Path

import pytest

from k3lab.harness.bundle import BUNDLE_GLOBS, is_bundle_file, load

PROFILES = Path(__file__).resolve().parent.parent / "profiles"
BUNDLES = sorted(p for g in BUNDLE_GLOBS for p in PROFILES.glob(f"*/{g}") if is_bundle_file(p))
REPORTS = list(PROFILES.glob("*/*.html"))


@pytest.mark.parametrize("path", BUNDLES, ids=lambda p: f"{p.parent.name}/{p.name}")
def test_bundle_validates(path):
    b = load(path)
    assert b.env and b.name
    for r in b.rows:
        # a numerics row (the decode step's error per layer) carries an error and no timing
        assert r.median_us > 0 or (r.name.startswith("numerics:") and r.error and r.error.get("ok") is not None)


@pytest.mark.parametrize("path", REPORTS, ids=lambda p: f"{p.parent.name}/{p.name}")
def test_report_uses_the_shared_plotly(path):
    text = path.read_text()
    srcs = [s.split('"')[0] for s in text.split('src="')[1:] if "plotly" in s.split('"')[0]]
    assert srcs, "no plotly script tag"
    for s in srcs:
        assert not s.startswith("http")
        assert (path.parent / s).resolve() == (PROFILES / "assets" / "plotly-basic.min.js").resolve()
    assert len(text) < 1_000_000


def test_one_plotly_copy_and_small_tree():
    assert len(list((PROFILES / "assets").glob("plotly*.js"))) == 1


def test_tracked_tree_under_5_mib():
    """The repository stays small (large bundles are committed gzipped: k3lab.harness.bundle)."""
    root = PROFILES.parent
    if shutil.which("git") is None or not (root / ".git").exists():
        pytest.skip("not a git checkout")
    files = subprocess.run(["git", "ls-files", "-z"], cwd=root, capture_output=True, check=True).stdout.split(b"\0")
    total = sum((root / f.decode()).stat().st_size for f in files if f and (root / f.decode()).is_file())
    assert total < 5 * 2**20, f"tracked files hold {total / 2**20:.2f} MiB"


def test_evidence_cited_by_code_and_data_exists():
    """Every profiles/ or experiments/ bundle path that code (k3lab, kernels, experiments, scripts) or data/*.json names
    is in the tree (a retired file is cited with where it lives in git history, not by its old path). A target's
    alternatives "a|b" need their last one here: the ones before it may await the run that makes them."""
    import re

    root = PROFILES.parent
    pat = re.compile(r"(?:profiles|experiments/[a-z_]+)/h200/[A-Za-z0-9_./-]+?\.(?:json\.gz|json|log|txt\.gz|html)")
    missing = []
    files = [p for d in ("k3lab", "kernels", "experiments", "scripts") for p in (root / d).rglob("*.py")]
    files += list((root / "data").glob("*.json"))
    for f in files:
        text = f.read_text()
        for m in pat.finditer(text):
            around = text[m.end():m.end() + 40]
            if "git history" in around or "{" in m.group(0) or around.startswith("|"):
                continue
            if not (root / m.group(0)).exists():
                missing.append(f"{f.relative_to(root)}: {m.group(0)}")
    assert not missing, "\n".join(missing)
