"""Reports in a real headless browser: Debian's chromium driven by Playwright (`.ci/run` installs both; Playwright's
own browser download needs the internet, so chromium is launched from its path). Every page the tests make here
(the CPU plan's notebook reports and index, a bundle report) and every committed report under profiles/ loads
offline (the browser context is offline: a request off the machine fails with a console error), draws every
plotly figure (a `.js-plotly-plot` holding an svg) and logs no console error and no page error. Each report
loads the ONE shared plotly.js (a report written outside the repository: a byte-identical copy beside it). A
deliberately broken page proves the check catches what it claims to.
Skipped cleanly where chromium or Playwright is missing."""
from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from test_report_sweep import plan_run

ROOT = Path(__file__).resolve().parent.parent
PROFILES = ROOT / "profiles"
CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
try:
    from playwright.sync_api import sync_playwright
except ImportError:  # pragma: no cover - the `browser` extra is not installed
    sync_playwright = None

pytestmark = [pytest.mark.browser,
              pytest.mark.skipif(CHROMIUM is None, reason="no chromium on PATH (apt-get install chromium)"),
              pytest.mark.skipif(sync_playwright is None, reason="playwright not installed (pip install "
                                 "-e '.[browser]')")]


def _pages(tmp_path_factory) -> list[tuple[Path, bool]]:
    """(page, whether it must hold figures): the plan's reports and index, a bundle report, the committed ones."""
    import json

    from k3lab.harness.bundle import load
    from k3lab.report import bundle_report

    run = plan_run(tmp_path_factory)
    assert run["proc"].returncode == 0, run["proc"].stdout + run["proc"].stderr
    meta = json.loads((run["dir"] / "sweep.json").read_text())
    pages = [(Path(r["report"]), True) for r in meta["runs"]] + [(run["dir"] / "index.html", False)]
    bundle = next(Path(b) for r in meta["runs"] for b in r["bundles"] if Path(b).name == "mla_sweep-cpu.json")
    pages.append((bundle_report(load(bundle), run["dir"] / "bundle_report.html"), True))
    # every committed report, folders below a GPU's included (profiles/h200/ses31/...); profiles/runs/ is local
    pages += [(p, True) for p in sorted(PROFILES.rglob("*.html")) if p.relative_to(PROFILES).parts[0] != "runs"]
    return pages


def _broken_page(folder: Path, js: Path) -> Path:
    """A report that must fail the check: a figure that cannot draw and a script error."""
    from k3lab.report import page

    path = folder / "broken.html"
    body = ("<div id='f' class='plotly-graph-div'></div>"  # a figure whose drawing never runs
            "<script>undefined_function_of_a_broken_report(); Plotly.newPlot('f', [], {});</script>")
    path.write_text(page("broken", body, path, js))
    return path


def test_every_report_renders_offline_in_chromium(tmp_path_factory, tmp_path):
    from k3lab.report import shared_plotly_js

    js = shared_plotly_js().resolve()
    js_bytes = js.read_bytes()
    pages = _pages(tmp_path_factory) + [(_broken_page(tmp_path, js), True)]
    problems: list[str] = []
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, args=["--no-sandbox", "--disable-gpu"])
        try:
            ctx = browser.new_context(offline=True)  # a request off this machine fails and logs a console error
            page = ctx.new_page()  # one page for all: chromium keeps the compiled plotly.js between loads
            errors: list[str] = []
            page.on("console", lambda m: errors.append(f"console {m.type}: {m.text}") if m.type == "error" else None)
            page.on("pageerror", lambda exc: errors.append(f"page error: {exc}"))
            for path, has_figures in pages:
                errors.clear()
                page.goto(path.resolve().as_uri(), wait_until="load")
                divs = page.locator("div.plotly-graph-div").count()
                if divs:
                    try:
                        page.wait_for_function(
                            "n => document.querySelectorAll('.js-plotly-plot .main-svg').length >= n", arg=divs,
                            timeout=10_000)
                    except Exception:  # noqa: BLE001 - counted below
                        pass
                drawn = page.evaluate("[...document.querySelectorAll('div.plotly-graph-div')]"
                                      ".filter(d => d.classList.contains('js-plotly-plot') && d.querySelector('svg'))"
                                      ".length")
                scripts = page.evaluate("[...document.scripts].filter(s => s.src).map(s => s.src)")
                if has_figures and not divs:
                    errors.append("no plotly figure in a report that should have some")
                if drawn != divs:
                    errors.append(f"{divs - drawn} of {divs} figures not drawn")
                loaded = [Path(u[len('file://'):]).resolve() for u in scripts]
                # the one shared copy; outside the repository (the tests' runs) a byte-identical copy of it
                if divs and not (len(loaded) == 1 and (loaded[0] == js or (
                        not loaded[0].is_relative_to(ROOT) and loaded[0].read_bytes() == js_bytes))):
                    errors.append(f"plotly.js not the one shared copy: {scripts}")
                problems.extend(f"{path}: {e}" for e in errors)
        finally:
            browser.close()
    assert len(pages) >= 6
    caught = [x for x in problems if "broken.html" in x]
    assert any("page error" in x for x in caught) and any("not drawn" in x for x in caught), \
        f"the check misses a broken report: {caught}"
    rest = [x for x in problems if "broken.html" not in x]
    assert not rest, "\n".join(rest)
