"""HTML reports that open offline and share ONE copy of plotly.js.

The repo keeps a single plotly.js under `profiles/assets/` (the basic partial bundle when present: scatter, bar
and pie traces, 1.2 MB, so figures keep to lines, markers and bars; otherwise a copy of the installed plotly
package's `plotly.min.js`).
Every report loads it with `<script src="RELATIVE/PATH" data-k3lab-plotly>` computed from where the
HTML lives, so reports stay a few tens of KB; `relink_plotly` fixes the path when a report moves.

How figures get into a report: in the notebook, `k3lab.report.show(fig)` publishes the figure as
`application/vnd.plotly.v1+json` (JupyterLab renders it live) plus a `text/html` div that draws with
a global `Plotly` and carries no plotly.js. nbconvert's HTML exporter picks the `text/html`. Outputs
of a plain `fig.show()` are handled too: any output with the plotly JSON mimetype gets the same div,
and the bulky outputs of the 'notebook' renderers (plotly.js inlined, or fetched from a CDN through
require.js) are removed. Only scatter, bar and pie traces draw with the partial bundle: tables are HTML,
not plotly tables, and no heatmap, box or histogram.

Imports of plotly / nbconvert / nbformat happen inside the functions.
"""
from __future__ import annotations

import html as _html
import json
import os
import re
import shutil
from pathlib import Path
from typing import Any

REPO_ROOT = Path(__file__).resolve().parent.parent
PROFILES_DIR = REPO_ROOT / "profiles"
ASSETS = "assets"
JS_NAMES = ("plotly-basic.min.js", "plotly.min.js")  # the first that exists is THE shared copy
PLOTLY_MIME = "application/vnd.plotly.v1+json"
MAX_OUTPUT_BYTES = 200_000

CSS = """
body{font-family:system-ui,-apple-system,Segoe UI,Roboto,sans-serif;max-width:1200px;margin:1.5em auto;
padding:0 1em;color:#222;line-height:1.45}
pre{background:#f6f8fa;padding:.6em .8em;overflow-x:auto;font-size:.85em;border-radius:4px}
.input_area pre,.highlight pre{border-left:3px solid #9ab}
.prompt{display:none}
table{border-collapse:collapse;font-size:.85em;margin:.5em 0}
th,td{border:1px solid #ccc;padding:.25em .55em;text-align:right}
th{background:#eef2f5}td:first-child,th:first-child{text-align:left}
.output_stderr pre{background:#fff3f3}
.k3-bad{color:#b00;font-weight:bold}.k3-ok{color:#070}
.k3-meta{font-size:.85em;color:#555}
.k3-head td,.k3-head th{text-align:left}.k3-head h3{margin:.3em 0}
"""


def shared_plotly_js(profiles: str | Path | None = None, *, create: bool = True) -> Path:
    """The one plotly.js of the repo (`profiles/assets/...`); copies the installed package's
    plotly.min.js there when none exists and `create` is set."""
    assets = Path(profiles or PROFILES_DIR) / ASSETS
    for name in JS_NAMES:
        if (assets / name).exists():
            return assets / name
    if not create:
        raise FileNotFoundError(f"no plotly.js in {assets}")
    import plotly

    src = Path(plotly.__file__).parent / "package_data" / "plotly.min.js"
    assets.mkdir(parents=True, exist_ok=True)
    shutil.copyfile(src, assets / "plotly.min.js")
    return assets / "plotly.min.js"


def plotly_src(html_path: str | Path, js: str | Path | None = None) -> str:
    """Relative URL from the HTML file's folder to the shared plotly.js."""
    js = Path(js) if js is not None else shared_plotly_js()
    return Path(os.path.relpath(js.resolve(), Path(html_path).resolve().parent)).as_posix()


def _script_tag(src: str) -> str:
    return f'<script src="{_html.escape(src)}" charset="utf-8" data-k3lab-plotly></script>'


_TAG_RE = re.compile(r'<script src="[^"]*" charset="utf-8" data-k3lab-plotly></script>')


def relink_plotly(html_path: str | Path, js: str | Path | None = None) -> str:
    """Point a moved report at the shared plotly.js again; returns the new relative path."""
    p = Path(html_path)
    src = plotly_src(p, js)
    text = p.read_text()
    if not _TAG_RE.search(text):
        raise ValueError(f"{p} has no k3lab plotly script tag")
    p.write_text(_TAG_RE.sub(lambda _: _script_tag(src), text, count=1))
    return src


def page(title: str, body: str, html_path: str | Path, js: str | Path | None = None, extra_css: str = "") -> str:
    return (f"<!DOCTYPE html>\n<html><head><meta charset=\"utf-8\">\n<title>{_html.escape(title)}</title>\n"
            f"{_script_tag(plotly_src(html_path, js))}\n<style>{CSS}{extra_css}</style>\n</head>\n"
            f"<body>\n{body}\n</body></html>\n")


# ---- figures ----------------------------------------------------------------------------------

def figure_div(fig: Any, height: int | None = None) -> str:
    """A figure (plotly Figure or its dict) as a div that draws with the page's global Plotly."""
    import plotly.io as pio

    if isinstance(fig, dict):
        h = (fig.get("layout") or {}).get("height")
    else:
        fig = lean(fig)
        h = fig.layout.height
    return pio.to_html(fig, include_plotlyjs=False, full_html=False, validate=False,
                       default_height=f"{height or h or 420}px", config={"displaylogo": False})


def show(fig: Any) -> None:
    """Display a figure in a notebook so it renders live in JupyterLab and in exported reports,
    without embedding plotly.js in the notebook."""
    import plotly.io as pio
    from IPython.display import display

    fig = lean(fig)
    spec = json.loads(pio.to_json(fig, validate=False))
    display({PLOTLY_MIME: spec, "text/html": figure_div(fig), "text/plain": "<plotly figure>"}, raw=True)


def lean(fig: Any) -> Any:
    """A copy of a plotly Figure without its template's per-trace-type defaults (`template.data`: ~4.3 KB of
    styles for every trace type plotly knows, embedded in each figure of a page); the template's layout (fonts,
    grid, background: the look) stays. Our figures set their colours and markers themselves. Dicts pass as they are."""
    if isinstance(fig, dict):
        return fig
    import plotly.graph_objects as go

    t = fig.layout.template
    if t is None or not t.data.to_plotly_json():
        return fig
    out = go.Figure(fig)
    out.layout.template = go.layout.Template(layout=t.layout)
    return out


def _is_plotly_bloat(html: str) -> bool:
    """Outputs of plotly's 'notebook' / 'notebook_connected' renderers that carry or fetch plotly.js."""
    return ("plotly.js v" in html[:5000] or "cdn.plot.ly" in html or
            ("require.config" in html and "plotly" in html) or "window.PlotlyConfig" in html)


def strip_bulky_outputs(nb: Any, max_bytes: int = MAX_OUTPUT_BYTES) -> int:
    """In place: give every plotly JSON output a light div, drop plotly.js payloads, and replace any
    other output over `max_bytes` with a note. Returns how many outputs were changed."""
    changed = 0
    for cell in nb.cells:
        if cell.get("cell_type") != "code":
            continue
        outs = []
        for out in cell.get("outputs", []):
            data = out.get("data") if isinstance(out, dict) else None
            if data is not None:
                if PLOTLY_MIME in data:
                    data["text/html"] = figure_div(data[PLOTLY_MIME])
                    changed += 1
                elif isinstance(data.get("text/html"), (str, list)):
                    h = data["text/html"]
                    h = "".join(h) if isinstance(h, list) else h
                    if _is_plotly_bloat(h) and "Plotly.newPlot" not in h:
                        changed += 1
                        continue  # the init payload of plotly's notebook renderer
            size = len(json.dumps(out))
            if size > max_bytes:
                changed += 1
                out = {"output_type": "stream", "name": "stdout",
                       "text": f"[k3lab: an output of {size} bytes was removed from this report]\n"}
            outs.append(out)
        cell["outputs"] = outs
    return changed


def export_html(notebook: str | Path | Any, html_path: str | Path, *, title: str | None = None,
                js: str | Path | None = None, max_output_bytes: int = MAX_OUTPUT_BYTES, code: bool = False,
                params: dict[str, Any] | None = None, defaults: dict[str, Any] | None = None,
                env: dict[str, Any] | None = None) -> Path:
    """Executed notebook (path or NotebookNode) -> a small offline HTML report at `html_path`.

    Report mode (the default, `code=False`): code cells show their outputs only, the cell papermill injects
    is left out, and the page opens with two tables: the parameters (`params`, else the ones papermill
    recorded in the notebook; `defaults` marks which were left at the notebook's value) and the environment
    (`env`, e.g. the run's bundle's fingerprint; else this machine's). `code=True` keeps every cell's source.
    The notebook file itself is never changed."""
    import nbformat
    from nbconvert import HTMLExporter

    nb = nbformat.read(str(notebook), as_version=4) if isinstance(notebook, (str, Path)) else notebook
    nb = nbformat.from_dict(json.loads(json.dumps(nb)))  # work on a copy
    strip_bulky_outputs(nb, max_output_bytes)
    if not code:
        if params is None:
            params = dict((nb.metadata.get("papermill") or {}).get("parameters") or {})
        if env is None:
            from k3lab.harness.env import fingerprint

            env = fingerprint()
        nb.cells = [c for c in nb.cells if "injected-parameters" not in c.get("metadata", {}).get("tags", [])]
        # the tables as the output of a cell of their own, after the notebook's title cell
        tables = nbformat.v4.new_code_cell("", outputs=[nbformat.v4.new_output(
            "display_data", data={"text/html": report_header_html(params, env, defaults=defaults)})])
        tables["id"] = "k3lab-report-tables"
        at = 1 if nb.cells and nb.cells[0].get("cell_type") == "markdown" else 0
        nb.cells.insert(at, tables)
    try:
        exporter = HTMLExporter(template_name="basic")
        exporter.exclude_input_prompt = True
        exporter.exclude_output_prompt = True
        exporter.exclude_input = not code
        body, _ = exporter.from_notebook_node(nb)
    except Exception:  # noqa: BLE001 - nbconvert's templates are data files a wheel-only site may lack
        body = render_cells(nb, code=code)
    html_path = Path(html_path)
    html_path.parent.mkdir(parents=True, exist_ok=True)
    if title is None:
        title = Path(str(notebook)).stem if isinstance(notebook, (str, Path)) else "k3lab report"
    html_path.write_text(page(title, body, html_path, js, _pygments_css()))
    return html_path


ENV_KEYS = ("gpu", "sm_count", "driver", "cuda", "hip", "torch", "triton", "cutlass_dsl", "fla", "python",
            "platform", "hostname", "commit", "dirty", "source_digest", "time")


def parse_value(s: str) -> Any:
    """A command-line or parameter value: JSON when it parses ("3", "true", "null", "[1, 2]"), else the string."""
    try:
        return json.loads(s)
    except (json.JSONDecodeError, ValueError):
        return s


def split_values(s: str) -> list[str]:
    """Split on commas outside brackets/quotes, so NAME=[1,2],[3] works."""
    out, depth, cur, quote = [], 0, "", False
    for ch in s:
        if ch == '"':
            quote = not quote
        if not quote and ch in "[{":
            depth += 1
        elif not quote and ch in "]}":
            depth -= 1
        if ch == "," and depth == 0 and not quote:
            out.append(cur)
            cur = ""
        else:
            cur += ch
    out.append(cur)
    return [v.strip() for v in out if v.strip()]


def option_grid(value: Any, name: str) -> dict[str, tuple]:
    """A notebook's grid of kernel options (what `k3lab bench --grid NAME=v1,v2` takes) as a dict: "" (none), a dict
    given as JSON (`-p options '{"path": [null, "mma"]}'`) or "NAME=v1,v2; NAME2=v3" (values parsed as JSON when
    they parse: null, true, 8). Anything else is a ValueError naming the parameter."""
    if isinstance(value, dict):
        return {str(k): tuple(v) if isinstance(v, (list, tuple)) else (v,) for k, v in value.items()}
    if not isinstance(value, str):
        raise ValueError(f"parameter {name!r}: expected 'NAME=v1,v2; NAME2=v3' or a dict, got {value!r}")
    out: dict[str, tuple] = {}
    for item in (i.strip() for i in value.split(";")):
        if not item:
            continue
        if "=" not in item or not item.split("=", 1)[0].strip():
            raise ValueError(f"parameter {name!r}: expected 'NAME=v1,v2; NAME2=v3', got {item!r}")
        k, vals = item.split("=", 1)
        out[k.strip()] = tuple(parse_value(v) for v in split_values(vals))
    return out


def param_values(value: Any, name: str, *, ints: bool | str = False) -> list:
    """A notebook's list parameter as a list: a comma-separated string ("1,8,64", the parameters cells' form), a list
    given as JSON (`-p batches '[1, 8]'`) or one value (`-p batches 8`). ints=True: every value an integer (a digit
    string counts), else a ValueError naming the parameter; ints="auto": digit strings become ints, the rest stay."""
    items = list(value) if isinstance(value, (list, tuple)) else [value]
    out: list = []
    for v in items:
        parts = [p.strip() for p in v.split(",")] if isinstance(v, str) else [v]
        for p in parts:
            if isinstance(p, str) and not p:
                continue
            if ints and isinstance(p, str) and p.lstrip("-").isdigit():
                p = int(p)
            if ints is True and (isinstance(p, bool) or not isinstance(p, int)):
                raise ValueError(f"parameter {name!r}: expected integers (a list or comma-separated), got {value!r}")
            out.append(p if ints or not isinstance(p, (int, float)) else str(p))
    return out


def _cell(v: Any) -> str:
    if isinstance(v, (dict, list)):
        v = json.dumps(v)
    return _html.escape("" if v is None else str(v))


def params_table_html(params: dict[str, Any], defaults: dict[str, Any] | None = None) -> str:
    """The run's parameters as a table (name, value, and whether the run set it or left the notebook's
    default when `defaults` is given); `out_dir` is left out."""
    shown = {k: v for k, v in params.items() if k != "out_dir"}
    names = list(shown) + [k for k in (defaults or {}) if k not in shown and k != "out_dir"]
    rows = []
    for k in names:
        if defaults is None:
            rows.append(f"<tr><td>{_html.escape(k)}</td><td>{_cell(shown[k])}</td></tr>")
        else:
            how = "set" if k in shown else "default"
            v = shown[k] if k in shown else defaults[k]
            rows.append(f"<tr><td>{_html.escape(k)}</td><td>{_cell(v)}</td><td>{how}</td></tr>")
    hdr = "<tr><th>parameter</th><th>value</th>" + ("" if defaults is None else "<th></th>") + "</tr>"
    return f"<table class='k3-params'>{hdr}{''.join(rows)}</table>"


def env_table_html(env: dict[str, Any]) -> str:
    """The environment fingerprint as a table (GPU, driver, CUDA, library versions, commit, source digest)."""
    keys = [k for k in ENV_KEYS if k in env] + [k for k in env if k not in ENV_KEYS and k != "gpu_slug"]
    keys = [k for k in keys if k == "gpu" or env[k] is not None]
    rows = "".join(f"<tr><td>{_html.escape(k)}</td><td>{_cell(env[k] if k != 'gpu' else env[k] or 'none (CPU)')}"
                   "</td></tr>" for k in keys)
    return f"<table class='k3-env'><tr><th>environment</th><th></th></tr>{rows}</table>"


def report_header_html(params: dict[str, Any], env: dict[str, Any], *, defaults: dict[str, Any] | None = None) -> str:
    """The opening of a report: the parameters and environment tables side by side."""
    return ("<div class='k3-head' style='display:flex;gap:2em;flex-wrap:wrap;align-items:flex-start'>"
            f"<div><h3>Parameters</h3>{params_table_html(params, defaults)}</div>"
            f"<div><h3>Environment</h3>{env_table_html(env)}</div></div>\n")


_ANSI = re.compile(r"\x1b\[[0-9;]*[A-Za-z]")


def _md(text: str) -> str:
    for mod in ("mistune", "markdown"):
        try:
            m = __import__(mod)
            return m.html(text) if mod == "mistune" else m.markdown(text)
        except Exception:  # noqa: BLE001
            continue
    return f"<pre>{_html.escape(text)}</pre>"


def render_cells(nb: Any, code: bool = True) -> str:
    """Minimal notebook -> HTML body without nbconvert templates (the fallback of export_html); `code=False`
    leaves the code cells' sources out."""
    parts = []
    for cell in nb.cells:
        src = cell.get("source", "")
        if cell.get("cell_type") == "markdown":
            parts.append(f"<div class='md'>{_md(src)}</div>")
            continue
        if cell.get("cell_type") != "code":
            continue
        if code:
            parts.append(f"<div class='input_area'><pre>{_html.escape(src)}</pre></div>")
        for out in cell.get("outputs", []):
            kind = out.get("output_type")
            if kind == "stream":
                cls = "output_stderr" if out.get("name") == "stderr" else "output_stdout"
                parts.append(f"<div class='{cls}'><pre>{_html.escape(_ANSI.sub('', out.get('text', '')))}</pre></div>")
            elif kind == "error":
                tb = _ANSI.sub("", "\n".join(out.get("traceback", [])))
                parts.append(f"<div class='output_stderr'><pre>{_html.escape(tb)}</pre></div>")
            else:
                data = out.get("data", {})
                if "text/html" in data:
                    h = data["text/html"]
                    parts.append("".join(h) if isinstance(h, list) else h)
                elif "image/png" in data:
                    parts.append(f"<img src='data:image/png;base64,{data['image/png']}'>")
                elif "text/plain" in data:
                    parts.append(f"<pre>{_html.escape(str(data['text/plain']))}</pre>")
    return "\n".join(parts)


def _pygments_css() -> str:
    try:
        from pygments.formatters import HtmlFormatter

        return HtmlFormatter(style="default").get_style_defs(".highlight")
    except Exception:  # noqa: BLE001
        return ""


# ---- a report straight from a bundle ---------------------------------------------------------

def bundle_figures(bundle: Any) -> list[Any]:
    """One bar figure per timing kind: median (error bars p10..p90) and floor per component and
    backend, log time axis."""
    import plotly.graph_objects as go

    figs = []
    kinds = []
    for r in bundle.rows:
        if r.kind not in kinds:
            kinds.append(r.kind)
    for kind in kinds:
        rows = [r for r in bundle.rows if r.kind == kind]
        fig = go.Figure()
        for be in dict.fromkeys(r.backend for r in rows):
            rs = [r for r in rows if r.backend == be]
            fig.add_bar(name=f"{be}", x=[r.name for r in rs], y=[r.median_us for r in rs],
                        error_y=dict(type="data", symmetric=False,
                                     array=[r.p90_us - r.median_us for r in rs],
                                     arrayminus=[r.median_us - r.p10_us for r in rs]),
                        hovertext=[f"{r.achieved_tbps or 0:.3f} TB/s, x{(r.distance or 0):.1f} floor" for r in rs])
        floors = {r.name: r.floor_us for r in rows if r.floor_us}
        if floors:
            fig.add_scatter(name="floor", x=list(floors), y=list(floors.values()), mode="markers",
                            marker=dict(symbol="line-ew-open", size=28, color="black", line=dict(width=3)))
        label = {"cpu-smoke": "CPU smoke timing (not a GPU figure)"}.get(kind, kind)
        fig.update_layout(title=f"median per component vs floor [{label}]", barmode="group",
                          yaxis=dict(title="us per call", type="log"), height=440, template="plotly_white",
                          margin=dict(l=60, r=20, t=50, b=80))
        figs.append(fig)
    return figs


def sweep_frame(bundle: Any):
    """A bench bundle's rows as a DataFrame: the case axes and options (from each row's extra), impl, timing
    kind and mode, median, floor, floor bandwidth, % of it, the worst output error and whether the check passed."""
    import pandas as pd

    recs = []
    for r in bundle.rows:
        e = r.error or {}
        rec = {k: v for k, v in (r.extra or {}).items() if not isinstance(v, (dict, list))}
        rec.update(impl=r.backend, kind=r.kind, mode=r.mode, median_us=r.median_us, floor_us=r.floor_us,
                   floor_bw=r.floor_bw, pct_of_bw=r.pct_of_bw, x_floor=r.distance, launches=r.launches,
                   err=e.get("rel_norm"), ok=e.get("ok"))
        recs.append(rec)
    return pd.DataFrame(recs)


def sweep_figures(bundle: Any, x: str, *, facet: str | None = None, impls: Any = None,
                  split: tuple[str, ...] = ()) -> list[Any]:
    """Line plots of a bench bundle: median us and % of the floor's bandwidth against axis `x`, one line per
    implementation (its best option at each point), one panel per value of `facet`. `split`: case axes that get a
    line each where the bundle holds more than one value of them (e.g. an MLA sweep over page size, cache dtype,
    head padding and DCP: "triton page_size=16 kv_dtype=fp8"), so different cases never share a line's best."""
    import plotly.express as px

    df = sweep_frame(bundle)
    if df.empty or x not in df:
        return []
    if impls is not None:
        df = df[df.impl.isin(list(impls))]
    varied = [c for c in split if c in df and df[c].nunique(dropna=False) > 1]
    df = df.assign(line=df.impl.astype(str))
    for c in varied:
        df["line"] = df.line + f" {c}=" + df[c].astype(str)
    keys = [c for c in ("line", x, facet) if c]
    best = df.sort_values("median_us").groupby(keys, as_index=False).first()
    kw = dict(color="line", markers=True, facet_col=facet) if facet else dict(color="line", markers=True)
    figs = [px.line(best, x=x, y="median_us", log_x=True, log_y=True, title=f"{bundle.name}: median per call (us)",
                    **kw),
            px.line(best, x=x, y="pct_of_bw", log_x=True, title=f"{bundle.name}: bytes / time, % of the floor's "
                    "bandwidth (read or copy, measured in the run)", **kw)]
    for f in figs:
        f.update_layout(template="plotly_white", height=420)
    return figs


def error_table_html(bundle: Any) -> str:
    head = ("<tr><th>component</th><th>backend</th><th>kind</th><th>median us</th><th>p10</th><th>p90</th>"
            "<th>floor us</th><th>floor bw</th><th>x floor</th><th>TB/s</th><th>% of bw</th><th>timing</th>"
            "<th>launches</th>"
            "<th>rel err vs fp64</th><th>max abs</th><th>ok</th></tr>")
    body = []

    def f(v: Any, fmt: str = "{:.3g}") -> str:
        return "" if v is None else (fmt.format(v) if isinstance(v, (int, float)) else _html.escape(str(v)))

    for r in bundle.rows:
        e = r.error or {}
        ok = e.get("ok")
        cls = "k3-ok" if ok else ("k3-bad" if ok is False else "")
        body.append(
            f"<tr><td>{_html.escape(r.name)}</td><td>{_html.escape(r.backend)}</td><td>{r.kind}</td>"
            f"<td>{f(r.median_us, '{:.2f}')}</td><td>{f(r.p10_us, '{:.2f}')}</td><td>{f(r.p90_us, '{:.2f}')}</td>"
            f"<td>{f(r.floor_us, '{:.2f}')}</td><td>{f(r.floor_bw)}</td><td>{f(r.distance, '{:.1f}')}</td>"
            f"<td>{f(r.achieved_tbps)}</td><td>{f(r.pct_of_bw, '{:.1f}')}</td><td>{f(r.mode)}</td>"
            f"<td>{f(r.launches)}</td>"
            f"<td>{f(e.get('rel_norm'), '{:.2e}')}</td><td>{f(e.get('max_abs'), '{:.2e}')}</td>"
            f"<td class='{cls}'>{'' if ok is None else ('yes' if ok else 'NO')}"
            f"{' *' if e.get('note') else ''}</td></tr>")
    notes = "".join(f"<li>{_html.escape(r.name)} ({_html.escape(r.backend)}): {_html.escape(str(r.error['note']))}"
                    f"</li>" for r in bundle.rows if (r.error or {}).get("note"))
    # * a check that aligned a near-tie before comparing (k3lab.model.Layer.align_twin)
    return f"<table>{head}{''.join(body)}</table>" + (f"<p>* aligned before the comparison:</p><ul>{notes}</ul>"
                                                       if notes else "")


def bundle_report(bundle: Any, html_path: str | Path, *, js: str | Path | None = None) -> Path:
    """A standalone HTML page for a results bundle: env, bars of median vs floor, the error table."""
    html_path = Path(html_path)
    env = bundle.env
    meta = (f"<p class='k3-meta'>{_html.escape(str(env.get('gpu') or 'CPU only'))} · torch {env.get('torch')} · "
            f"CUDA {env.get('cuda')} · triton {env.get('triton')} · cutlass-dsl {env.get('cutlass_dsl')} · "
            f"commit {str(env.get('commit'))[:10]}{' (dirty)' if env.get('dirty') else ''} · "
            f"{_html.escape(str(env.get('time')))}<br>"
            f"copy {f'{bundle.copy_tbps:.3f}' if bundle.copy_tbps else '?'} TB/s"
            f" · read {f'{bundle.read_tbps:.3f}' if getattr(bundle, 'read_tbps', None) else '?'} TB/s"
            f" · launch floor {f'{bundle.launch_floor_us:.2f}' if bundle.launch_floor_us else '?'} us</p>")
    ran = "".join(f"<li><b>{_html.escape(k)}</b>: {_html.escape(v)}</li>" for k, v in bundle.backends_ran.items())
    skipped = "".join(f"<li><b>{_html.escape(k)}</b> skipped: {_html.escape(v)}</li>"
                      for k, v in bundle.backends_skipped.items())
    view = bundle.config.get("view", {})
    parts = [f"<h1>{_html.escape(bundle.name)}</h1>", meta, f"<ul>{ran}{skipped}</ul>",
             f"<p class='k3-meta'>view: {_html.escape(json.dumps(view))}</p>"]
    parts += [figure_div(fig) for fig in bundle_figures(bundle)]
    parts += ["<h2>Times, floors and errors</h2>", error_table_html(bundle)]
    if bundle.notes:
        parts.append("<ul>" + "".join(f"<li>{_html.escape(n)}</li>" for n in bundle.notes) + "</ul>")
    html_path.parent.mkdir(parents=True, exist_ok=True)
    html_path.write_text(page(bundle.name, "\n".join(parts), html_path, js))
    return html_path


# ---- the index page of a sweep ----------------------------------------------------------------

def _link(target: str | Path | None, base: Path, text: str) -> str:
    if not target:
        return ""
    rel = Path(os.path.relpath(Path(target).resolve(), base.resolve())).as_posix()
    return f"<a href='{_html.escape(rel)}'>{_html.escape(text)}</a>"


def _short(p: str | Path) -> str:
    p = Path(p)
    return f"{p.parent.name}/{p.name}"


def sweep_index(html_path: str | Path, title: str, runs: list[dict[str, Any]], gates: list[dict[str, Any]],
                notes: list[str] = ()) -> Path:
    """One page linking every run of a sweep (its executed notebook, report, bundles and run.json) and every
    bundle's comparison with its baseline. `runs`: {notebook, params, status, seconds, run_dir, report,
    executed, bundles: [path], error}; `gates`: {bundle, baseline, compared, gated, cpu_smoke, regressions:
    [{name, backend, ratio, threshold, why}], note}. Plain HTML (no figures, no script)."""
    html_path = Path(html_path)
    base = html_path.parent
    base.mkdir(parents=True, exist_ok=True)
    rows = []
    for r in runs:
        st = r.get("status", "?")
        cls = "k3-ok" if st == "ok" else "k3-bad"
        links = " · ".join(x for x in (
            _link(r.get("report"), base, "report"), _link(r.get("executed"), base, "notebook"),
            *(_link(b, base, Path(b).name) for b in r.get("bundles", [])),
            _link(Path(r["run_dir"]) / "run.json" if r.get("run_dir") else None, base, "run.json")) if x)
        params = ", ".join(f"{k}={json.dumps(v)}" for k, v in (r.get("params") or {}).items())
        rows.append(f"<tr><td>{_html.escape(Path(r['notebook']).name)}</td><td>{_html.escape(params)}</td>"
                    f"<td class='{cls}'>{_html.escape(st)}</td><td>{_cell(r.get('seconds'))}</td><td>{links}</td>"
                    f"<td>{_html.escape((r.get('error') or '')[:300])}</td></tr>")
    run_table = ("<table><tr><th>notebook</th><th>parameters</th><th>status</th><th>s</th><th>links</th>"
                 f"<th>error</th></tr>{''.join(rows)}</table>")
    grows = []
    for g in gates:
        regs = g.get("regressions") or []
        cls = "k3-bad" if regs else "k3-ok"
        what = "; ".join(f"{x['name']} [{x['backend']}] {x['why']}" for x in regs)
        grows.append(
            f"<tr><td>{_link(g['bundle'], base, Path(g['bundle']).name)}</td>"
            f"<td>{_link(g['baseline'], base, _short(g['baseline'])) if g.get('baseline') else 'none'}</td>"
            f"<td>{g.get('compared', 0)}</td><td>{g.get('gated', 0)}</td><td>{g.get('cpu_smoke', 0)}</td>"
            f"<td class='{cls}'>{len(regs)}</td><td>{_html.escape(what or g.get('note') or '')}</td></tr>")
    gate_table = ("<table><tr><th>bundle</th><th>baseline</th><th>rows compared</th><th>gated</th>"
                  "<th>cpu-smoke (never gated)</th><th>regressions</th><th>what</th></tr>"
                  f"{''.join(grows)}</table>")
    note_html = "".join(f"<li>{_html.escape(n)}</li>" for n in notes)
    body = (f"<h1>{_html.escape(title)}</h1><h2>Runs</h2>{run_table}<h2>Against the baselines</h2>{gate_table}"
            + (f"<ul class='k3-meta'>{note_html}</ul>" if note_html else ""))
    css = CSS + ".k3-index td,.k3-index th{text-align:left}"
    html_path.write_text(f"<!DOCTYPE html>\n<html><head><meta charset=\"utf-8\">\n<title>{_html.escape(title)}"
                         f"</title>\n<style>{css}</style>\n</head>\n<body class='k3-index'>\n{body}\n</body></html>\n")
    return html_path
