"""Committed evidence under profiles/ stays loadable: every results bundle validates, every report
loads plotly.js from the one shared copy by a relative path that resolves."""
import json
from pathlib import Path

import pytest

from k3lab.harness.bundle import load

PROFILES = Path(__file__).resolve().parent.parent / "profiles"
BUNDLES = [p for p in PROFILES.glob("*/*.json") if "schema_version" in json.loads(p.read_text())]
REPORTS = list(PROFILES.glob("*/*.html"))


@pytest.mark.parametrize("path", BUNDLES, ids=lambda p: f"{p.parent.name}/{p.name}")
def test_bundle_validates(path):
    b = load(path)
    assert b.env and b.name
    for r in b.rows:
        assert r.median_us > 0


@pytest.mark.parametrize("path", REPORTS, ids=lambda p: f"{p.parent.name}/{p.name}")
def test_report_uses_the_shared_plotly(path):
    text = path.read_text()
    srcs = [s.split('"')[0] for s in text.split('src="')[1:] if "plotly" in s.split('"')[0]]
    assert srcs, "no plotly script tag"
    for s in srcs:
        assert not s.startswith("http")
        assert (path.parent / s).resolve() == (PROFILES / "assets" / "plotly-cartesian.min.js").resolve()
    assert len(text) < 1_000_000


def test_one_plotly_copy_and_small_tree():
    assert len(list((PROFILES / "assets").glob("plotly*.js"))) == 1
