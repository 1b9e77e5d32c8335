"""`k3lab` command line: run / sweep / compare / env / publish.

    k3lab run NOTEBOOK -p NAME VALUE ... [--out DIR]
    k3lab sweep NOTEBOOK --grid NAME=v1,v2 ... [-p NAME VALUE ...]
    k3lab compare A B [--threshold 0.05]
    k3lab env
    k3lab publish RUN_DIR --gpu h200
    k3lab bench COMPONENT [--grid heads=12 --grid batch=1,64 --grid T=1,4 --grid tile_v=16,128] [--hot] [--out DIR]
    k3lab check COMPONENT [--grid ...] [--backends cute] [--seeds 0,1]
    k3lab defaults COMPONENT BUNDLE... [--heads 12] [--write data/<component>_defaults.json]
    k3lab digest [REV]

Parameter values are parsed as JSON when they parse (1, true, [1,2], "x") and kept as strings
otherwise. A run lands in `profiles/runs/<timestamp>-<notebook stem>-<param hash>/` with the executed
notebook, its HTML report (plotly.js loaded from the one shared copy under profiles/assets/), the
bundle the notebook wrote (the notebook receives `out_dir`), and run.json.
"""
from __future__ import annotations

import datetime as _dt
import hashlib
import itertools
import json
import math
import re
import shutil
import sys
import time
from pathlib import Path
from typing import Any

import typer

from k3lab.report import PROFILES_DIR, parse_value
from k3lab.report import split_values as _split_values

# JupyterLab's dependencies bring rfc3987-syntax, which jsonschema imports when present (for a URI format
# check nbformat never asks for) and which builds a grammar at import: ~3 s on every `k3lab` command that
# touches nbformat or papermill. Marked absent here, jsonschema goes without that one format check.
sys.modules.setdefault("rfc3987_syntax", None)  # type: ignore[arg-type]

app = typer.Typer(add_completion=False, no_args_is_help=True,
                  help="k3lab: run, sweep and compare K3 decode-path notebooks.")


class RunFailed(Exception):
    """A run that failed; `run_dir` is None when it failed before a run directory was made (a missing
    notebook, a refused parameter)."""

    def __init__(self, message: str, run_dir: Path | None = None):
        super().__init__(message)
        self.run_dir = run_dir


def param_hash(params: dict[str, Any]) -> str:
    return hashlib.sha256(json.dumps(params, sort_keys=True, default=str).encode()).hexdigest()[:8]


def run_id(notebook: Path, params: dict[str, Any]) -> str:
    ts = _dt.datetime.now().strftime("%Y%m%d-%H%M%S")
    return f"{ts}-{notebook.stem}-{param_hash(params)}"


_ANSI = re.compile(r"\x1b\[[0-9;]*m")


def _failure_message(e: Exception, nb_path: Path) -> str:
    """Name the failing cell (index in the source notebook, execution count, first line, the line
    that raised) from papermill's execution error."""
    idx = getattr(e, "cell_index", None)
    count = getattr(e, "exec_count", None)
    ename, evalue = getattr(e, "ename", type(e).__name__), getattr(e, "evalue", str(e))
    src = (getattr(e, "source", "") or "").strip().splitlines()
    where = "a cell"
    if idx is not None:
        where = f"cell {idx - 1 if idx > 1 else idx} of the notebook (executed cell {idx}, papermill adds one)"
    if count is not None:
        where += f", execution count {count}"
    lines = [f"notebook {nb_path.name} failed in {where}: {ename}: {evalue}"]
    if src:
        lines.append(f"  cell starts: {src[0][:120]}")
    tb = [_ANSI.sub("", t) for t in (getattr(e, "traceback", None) or [])]
    raised = [ln.strip() for t in tb for ln in t.splitlines() if ln.lstrip().startswith("---->")]
    if raised:
        lines.append(f"  raised at: {raised[-1][:160]}")
    return "\n".join(lines)


def _kernel_can_import_k3lab() -> None:
    """The kernel runs in the notebook's folder: when k3lab is not installed (a GPU machine without a
    package index), put the repo root on its PYTHONPATH so `import k3lab` works there too."""
    import os

    root = str(PROFILES_DIR.parent)
    parts = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    if root not in parts:
        os.environ["PYTHONPATH"] = os.pathsep.join([root] + parts)


class _Progress:
    """`k3lab run`'s progress: one line per code cell (cell n of m, elapsed seconds, its first line) on
    stderr, and the cells' stdout / stderr streamed as they come. Quiet: nothing."""

    def __init__(self, total: int, quiet: bool):
        import sys

        self.total, self.quiet, self.t0, self.n = total, quiet, time.time(), 0
        self.out, self.err = sys.stdout, sys.stderr

    def start(self, cell: Any) -> None:
        if cell.get("cell_type") != "code":
            return
        self.n += 1
        if not self.quiet:
            first = next((ln for ln in cell.get("source", "").splitlines() if ln.strip()), "")[:70]
            self.err.write(f"[k3lab] cell {self.n} of {self.total}  {time.time() - self.t0:6.1f} s  {first}\n")
            self.err.flush()

    def stream(self, to_err: bool):
        prog = self

        class _W:
            def write(self, text: str) -> int:
                if not prog.quiet:
                    (prog.err if to_err else prog.out).write(text)
                return len(text)

            def flush(self) -> None:
                (prog.err if to_err else prog.out).flush()

        return _W()


_ENGINE = "k3lab"


def _register_engine() -> None:
    """A papermill engine that reports progress through `_Progress`, streams cell output to it, and starts
    the kernel with its process stdout / stderr in the run's kernel.log (the kernel's own start-up
    warnings, e.g. jupyter's notice about TCP transport, stay out of the terminal and the sweep's bar)."""
    from papermill.engines import NBClientEngine, papermill_engines
    from papermill.exceptions import PapermillException

    try:
        papermill_engines.get_engine(_ENGINE)
        return
    except PapermillException:
        pass

    class Engine(NBClientEngine):
        @classmethod
        def execute_managed_notebook(cls, nb_man, kernel_name, log_output=False, stdout_file=None,
                                     stderr_file=None, start_timeout=60, execution_timeout=None,
                                     k3_progress=None, k3_kernel_log=None, **kwargs):
            from papermill.clientwrap import PapermillNotebookClient
            from papermill.log import logger
            from papermill.utils import merge_kwargs, remove_args

            if k3_progress is not None:
                start = nb_man.cell_start

                def cell_start(cell, cell_index=None, **kw):
                    k3_progress.start(cell)
                    return start(cell, cell_index, **kw)

                nb_man.cell_start = cell_start
            kwargs = remove_args(["input_path"], **kwargs)
            safe = remove_args(["timeout", "startup_timeout"], **kwargs)
            final = merge_kwargs(safe, timeout=execution_timeout or kwargs.get("timeout"),
                                 startup_timeout=start_timeout, kernel_name=kernel_name, log=logger,
                                 log_output=False, stdout_file=stdout_file, stderr_file=stderr_file)
            launch = {"stdout": k3_kernel_log, "stderr": k3_kernel_log} if k3_kernel_log is not None else {}
            return PapermillNotebookClient(nb_man, **final).execute(**launch)

    papermill_engines.register(_ENGINE, Engine)


class _Captured:
    """Papermill's log messages and Python warnings while a notebook is checked or run: kept (for run.json),
    not printed, so they never break into the progress output."""

    def __enter__(self):
        import logging
        import warnings

        self.messages: list[str] = []
        outer = self

        class H(logging.Handler):
            def emit(self, record):
                if record.levelno >= logging.WARNING:
                    outer.messages.append(f"{record.name}: {record.getMessage()}")

        self._log = logging.getLogger("papermill")
        self._h, self._prop = H(), self._log.propagate
        self._log.addHandler(self._h)
        self._log.propagate = False
        self._w = warnings.catch_warnings(record=True)
        self._rec = self._w.__enter__()
        warnings.simplefilter("always")
        return self

    def __exit__(self, *exc):
        self._w.__exit__(*exc)
        self.messages += [f"{w.category.__name__}: {w.message}" for w in self._rec]
        self._log.removeHandler(self._h)
        self._log.propagate = self._prop
        return False


def notebook_parameters(notebook: Path) -> dict[str, Any]:
    """The names and default values of the notebook's parameters cell (the cell tagged 'parameters'), read with
    Python's own parser: every top-level assignment to a name, whatever its comment says (papermill's line
    parser gives up on a line with a second '=', e.g. in a comment, and then calls that parameter unknown).
    A default that is not a literal is kept as its source text."""
    import ast

    import nbformat

    try:
        with _Captured():  # nbformat's notes on old notebooks (cells without ids) are not the user's business
            nb = nbformat.read(str(notebook), as_version=4)
    except Exception as e:  # noqa: BLE001 - not JSON, not a notebook, unreadable: said by name, no traceback
        raise RunFailed(f"{notebook} is not a Jupyter notebook nbformat can read ({type(e).__name__}: "
                        f"{str(e).splitlines()[0][:200] if str(e) else ''})") from None
    cells = [c for c in nb.cells if "parameters" in c.get("metadata", {}).get("tags", [])]
    if not cells:
        return {}
    src = cells[0].source
    try:
        tree = ast.parse(src)
    except SyntaxError as e:
        raise RunFailed(f"notebook {Path(notebook).name}: its parameters cell does not parse: {e}") from None
    out: dict[str, Any] = {}
    for node in tree.body:
        if isinstance(node, ast.Assign):
            targets = node.targets
        elif isinstance(node, ast.AnnAssign) and node.value is not None:
            targets = [node.target]
        else:
            continue
        for t in targets:
            if isinstance(t, ast.Name):
                try:
                    out[t.id] = ast.literal_eval(node.value)
                except ValueError:
                    out[t.id] = ast.get_source_segment(src, node.value)
    return out


def measured_nothing(bd: Any) -> bool:
    """A bundle without rows that was meant to hold some (a study of notes alone says rows_expected False)."""
    return not bd.rows and bd.config.get("rows_expected", True)


def _refuse_threshold(threshold: float | None) -> None:
    if threshold is not None and not threshold >= 0:
        _echo_err(f"error: --threshold must be a relative slowdown >= 0 (0.05 = 5 %), got {threshold}")
        raise typer.Exit(2)


def portable_js(run_dir: Path, js_dir: Path | None = None) -> Path | None:
    """Where a report written under `run_dir` loads plotly.js from: None (the repository's one shared copy, by a
    relative path) when run_dir lies inside the repository; else a copy of it in `js_dir` (a sweep's folder: one copy
    for all its runs) or in run_dir, so the folder opens anywhere once moved or copied (a link back into this checkout
    would not)."""
    from k3lab.report import REPO_ROOT, shared_plotly_js

    run_dir = Path(run_dir).resolve()
    if run_dir.is_relative_to(REPO_ROOT.resolve()):
        return None
    js = shared_plotly_js()
    dest = Path(js_dir or run_dir).resolve() / js.name
    if not dest.exists():
        dest.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(js, dest)
    return dest


def execute(notebook: Path, params: dict[str, Any], out: Path | None = None, *, quiet: bool = False,
            kernel_name: str | None = None, code: bool = False, js_dir: Path | None = None) -> Path:
    """Run `notebook` headless with papermill into a run directory; export the HTML report (report mode:
    code hidden, parameters and environment as tables; `code=True` keeps the code). Progress (cell n of m,
    elapsed) and the cells' output go to the terminal unless `quiet`; the kernel process's own output goes
    to the run's kernel.log; papermill's warnings to run.json. Returns the run directory; raises RunFailed
    naming the failing cell."""
    import nbformat
    import papermill as pm

    from k3lab.harness.bundle import BundleError, find_bundles, load
    from k3lab.report import export_html

    notebook = Path(notebook).resolve()
    if not notebook.exists():
        raise RunFailed(f"notebook {notebook} does not exist")
    params = check_params(notebook, params)
    run_dir = Path(out).resolve() if out else (PROFILES_DIR / "runs" / run_id(notebook, params))
    run_dir.mkdir(parents=True, exist_ok=True)
    before = {p: p.stat().st_mtime_ns for p in find_bundles(run_dir)}  # a reused folder's older bundles
    params = {**params, "out_dir": str(run_dir)}
    out_nb = run_dir / notebook.name
    html = run_dir / f"{notebook.stem}.html"
    meta: dict[str, Any] = {"notebook": str(notebook), "params": params, "started": time.time()}
    _kernel_can_import_k3lab()
    _register_engine()
    with _Captured():
        n_code = sum(c.get("cell_type") == "code" for c in nbformat.read(str(notebook), as_version=4).cells) + 1
    progress = _Progress(n_code, quiet)  # + 1: the cell papermill injects
    t0 = time.time()
    error: str | None = None
    with open(run_dir / "kernel.log", "w") as klog, _Captured() as cap:
        try:
            pm.execute_notebook(str(notebook), str(out_nb), parameters=params, cwd=str(notebook.parent),
                                progress_bar=False, log_output=False, kernel_name=kernel_name,
                                engine_name=_ENGINE, k3_progress=progress, k3_kernel_log=klog,
                                stdout_file=progress.stream(False), stderr_file=progress.stream(True))
        except pm.PapermillExecutionError as e:
            error = _failure_message(e, notebook)
        except Exception as e:  # noqa: BLE001 - kernel died, bad parameters, ...
            error = f"notebook {notebook.name} could not run: {type(e).__name__}: {e}"
    meta["seconds"] = round(time.time() - t0, 2)
    if cap.messages:
        meta["warnings"] = cap.messages
    bundles, envs = [], []
    found = find_bundles(run_dir)
    stale = [p for p in found if before.get(p) == p.stat().st_mtime_ns]
    if stale:  # left by an earlier run into the same folder: not this run's results
        meta["stale_bundles"] = [str(p.relative_to(run_dir)) for p in stale]
    for p in found:
        if p in stale:
            continue
        try:
            bd = load(p)
        except BundleError as e:
            error = error or f"bundle {p} is invalid: {e}"
            continue
        envs.append(bd.env)
        bundles.append(str(p.relative_to(run_dir)))
        if measured_nothing(bd) and not error:  # every case skipped or refused
            why = "; ".join([f"{k}: {v}" for k, v in bd.backends_skipped.items()][:3]
                            or [n.splitlines()[0] for n in bd.notes[-1:]])
            error = (f"notebook {notebook.name} measured nothing: its bundle {p.name} holds no rows"
                     + (f" ({why[:600]})" if why else ""))
    if out_nb.exists():
        try:
            shown = {k: v for k, v in params.items() if k != "out_dir"}
            export_html(out_nb, html, title=f"{notebook.stem} {json.dumps(shown)}", code=code, params=shown,
                        defaults={k: v for k, v in notebook_parameters(notebook).items() if k != "out_dir"},
                        env=envs[0] if envs else None, js=portable_js(run_dir, js_dir))
            meta["html"] = html.name
        except Exception as e:  # noqa: BLE001
            meta["html_error"] = f"{type(e).__name__}: {e}"
    meta["bundles"] = bundles
    meta["status"] = "failed" if error else "ok"
    meta["error"] = error
    (run_dir / "run.json").write_text(json.dumps(meta, indent=1, default=str) + "\n")
    if error:
        raise RunFailed(error, run_dir)
    return run_dir


PATH_PARAMS = ("bundle", "allreduce_bundle")  # parameters that name a file: resolved against the caller's directory
BOOL_OR_NAMES = ("toggles",)  # true / false, or a comma-separated list of names (checked by the notebook's code)


def check_params(notebook: Path, params: dict[str, Any]) -> dict[str, Any]:
    """Refuse a parameter the notebook's parameters cell does not define (naming the valid ones), and a
    value whose type differs from the default's (a number where a number is expected); resolve file
    parameters against the caller's directory (the notebook runs in its own folder)."""
    known = notebook_parameters(notebook)
    unknown = sorted(set(params) - set(known) - {"out_dir"})
    if unknown:
        raise RunFailed(f"notebook {notebook.name} has no parameter {unknown}; its parameters: "
                        f"{sorted(k for k in known if k != 'out_dir')}")
    out = dict(params)
    for k, v in params.items():
        dv = known.get(k)
        if isinstance(dv, (int, float)) and not isinstance(dv, bool) and not (
                isinstance(v, (int, float)) and not isinstance(v, bool)):
            raise RunFailed(f"parameter {k!r} expects a number (default {dv!r}), got {v!r}")
        if isinstance(dv, bool) and not isinstance(v, bool):
            # a bool parameter: true/false (JSON) or Python's True/False; any other value would be truthy
            if isinstance(v, str) and v.lower() in ("true", "false"):
                out[k] = v.lower() == "true"
            elif k in BOOL_OR_NAMES and isinstance(v, (str, list)) and v:
                pass  # names: the notebook's code checks them (k3lab.step.TOGGLE_NAMES for toggles)
            else:
                raise RunFailed(f"parameter {k!r} expects true or false (default {dv!r}), got {v!r}")
        if k in PATH_PARAMS and isinstance(v, str) and v and not Path(v).is_absolute():
            out[k] = str(Path(v).resolve())
        if isinstance(dv, str) and _INT_LIST.fullmatch(dv) and not all(
                (isinstance(x, int) and not isinstance(x, bool)) or (isinstance(x, str) and _INT_LIST.fullmatch(x))
                for x in (v if isinstance(v, list) and v else [v])):
            raise RunFailed(f"parameter {k!r} expects a comma-separated list of ints like {dv!r}, got {v!r}")
    check_values(known, out)
    return out


# parameters whose value is one of a few names (the notebooks' comments say which)
CHOICES = {"numerics_preset": ("tiny", "same")}
_INT_LIST = re.compile(r"\s*\d+\s*(,\s*\d+\s*)*")


def check_values(known: dict[str, Any], params: dict[str, Any]) -> None:
    """The values of the parameters the view notebooks (those with a `preset`: the layer, step and draft-depth
    notebooks) share, checked before anything runs: the GPU view's (preset, batch, context, draft_depth, kv_dtype,
    dcp, expert_dtype: k3lab.config.preset validates them) and the switches' (k3lab.switches.Switches), each with
    the notebook's defaults for the ones not given. A bad value raises RunFailed naming the parameter, so `k3lab
    sweep` refuses a grid before its first run."""
    from k3lab.config import ConfigError, preset
    from k3lab.dashboards import BACKEND_PARAMS, SWITCH_PARAMS, VIEW_PARAMS
    from k3lab.switches import COMPONENTS, SwitchError, Switches

    merged = {**{k: v for k, v in known.items() if k != "out_dir"}, **params}
    given = ", ".join(f"{k}={params[k]!r}" for k in params)
    for k, allowed in CHOICES.items():
        if k in known and merged.get(k) not in allowed:
            raise RunFailed(f"parameter {k!r} must be one of {allowed}, got {merged.get(k)!r}")
    if "preset" not in known:  # a benchmark notebook: its lists (pad_heads "0,16") are grids, not switches
        return
    kw = {k: merged[k] for k in VIEW_PARAMS[1:] + ("dcp",) if k in merged}
    try:
        preset(merged["preset"], **kw)
    except (ConfigError, TypeError, ValueError) as e:
        raise RunFailed(f"bad parameter value ({given}): {e}") from None
    sw = {k: merged[k] for k in SWITCH_PARAMS if k in merged}
    backends = {k: merged[k] for k in ("backend",) + BACKEND_PARAMS if k in merged and merged[k] != ""}
    if sw or backends:
        be = backends.get("backend", "auto")
        try:
            Switches(backend={c: backends.get(f"backend_{c}", be) for c in COMPONENTS}, **sw)
        except SwitchError as e:
            raise RunFailed(f"bad parameter value ({given}): {e}") from None


def _echo_err(msg: str) -> None:
    typer.echo(msg, err=True)


PARAM_HELP = "parameters: -p NAME VALUE (repeatable; VALUE parsed as JSON when it parses)"
_EXTRA = {"allow_extra_args": True, "ignore_unknown_options": True}


def _params_from_args(args: list[str]) -> dict[str, Any]:
    """Parse `-p NAME VALUE` / `--param NAME VALUE` pairs out of the extra arguments."""
    out: dict[str, Any] = {}
    i = 0
    while i < len(args):
        a = args[i]
        if a in ("-p", "--param"):
            if i + 2 >= len(args):
                raise typer.BadParameter(f"{a} needs NAME VALUE")
            if args[i + 1] in out:
                raise typer.BadParameter(f"parameter {args[i + 1]!r} given twice (-p {args[i + 1]} ... -p "
                                         f"{args[i + 1]} ...): give it once")
            out[args[i + 1]] = parse_value(args[i + 2])
            i += 3
        else:
            raise typer.BadParameter(f"unexpected argument {a!r}; {PARAM_HELP}")
    return out


@app.command(context_settings=_EXTRA, help="Run a notebook headless into a run directory with an HTML report. "
             + PARAM_HELP)
def run(ctx: typer.Context, notebook: Path = typer.Argument(..., help="notebook to run"),
        out: Path | None = typer.Option(None, "--out", help="run directory (default profiles/runs/<id>)"),
        quiet: bool = typer.Option(False, "--quiet", "-q", help="no progress lines, no cell output"),
        code: bool = typer.Option(False, "--code", help="keep the code cells in the HTML report")) -> None:
    try:
        run_dir = execute(notebook, _params_from_args(ctx.args), out, quiet=quiet, code=code)
    except RunFailed as e:
        _echo_err(f"FAILED: {e}" + (f"\n  run directory: {e.run_dir}" if e.run_dir else ""))
        raise typer.Exit(1) from None
    meta = json.loads((run_dir / "run.json").read_text())
    typer.echo(f"ok in {meta['seconds']} s: {run_dir}")
    if meta.get("html"):
        typer.echo(f"  report: {run_dir / meta['html']}")
    for b in meta["bundles"]:
        typer.echo(f"  bundle: {run_dir / b}")
    if not meta["bundles"]:
        typer.echo("  (the notebook wrote no results bundle)")


PLAN_KEYS = {"name", "baselines", "threshold", "runs"}
PLAN_RUN_KEYS = {"notebook", "params", "grid"}


class PlanError(ValueError):
    """A sweep plan that cannot run, named by its key."""


def load_plan(path: Path) -> dict[str, Any]:
    """Read and check a sweep plan (YAML):

        name: cpu_smoke                 # optional (default: the file's stem)
        baselines: ../profiles          # optional: where the baselines live (default: the repo's profiles/)
        threshold: 0.05                 # optional: a fixed relative slowdown that counts (default: per row,
                                        #   from the samples' spread; see gate)
        runs:
          - notebook: ../notebooks/03_mla.ipynb
            params: {heads: "2", reps: 2}          # fixed parameters
            grid: {contexts: ["40", "72"]}        # one run per combination (a scalar is one value)

    Paths (notebooks, baselines, file parameters such as `bundle`) resolve against the plan's folder.
    Returns {name, baselines, threshold, runs: [(notebook, fixed, axes)]}; every notebook must exist
    (PlanError otherwise)."""
    import yaml

    path = Path(path)
    try:
        d = yaml.safe_load(path.read_text())
    except (OSError, yaml.YAMLError) as e:
        raise PlanError(f"cannot read plan {path}: {e}") from None
    if not isinstance(d, dict):
        raise PlanError(f"plan {path}: expected a mapping with 'runs', got {type(d).__name__}")
    bad = sorted(set(d) - PLAN_KEYS)
    if bad:
        raise PlanError(f"plan {path}: unknown keys {bad}; a plan has {sorted(PLAN_KEYS)}")
    runs = d.get("runs")
    if not isinstance(runs, list) or not runs:
        raise PlanError(f"plan {path}: 'runs' must be a non-empty list of {{notebook, params, grid}}")
    base = path.resolve().parent
    thr = d.get("threshold")
    if thr is not None and (not isinstance(thr, (int, float)) or isinstance(thr, bool) or thr < 0):
        raise PlanError(f"plan {path}: 'threshold' must be a number >= 0, got {thr!r}")
    out = []
    for i, r in enumerate(runs):
        where = f"plan {path}, runs[{i}]"
        if not isinstance(r, dict) or "notebook" not in r:
            raise PlanError(f"{where}: expected a mapping with 'notebook'")
        bad = sorted(set(r) - PLAN_RUN_KEYS)
        if bad:
            raise PlanError(f"{where}: unknown keys {bad}; a run has {sorted(PLAN_RUN_KEYS)}")
        nb = (base / str(r["notebook"])).resolve()
        if not nb.is_file():
            raise PlanError(f"{where}: notebook {nb} does not exist")
        fixed, grid = r.get("params") or {}, r.get("grid") or {}
        if not isinstance(fixed, dict) or not isinstance(grid, dict):
            raise PlanError(f"{where}: 'params' and 'grid' must be mappings")
        both = sorted(set(fixed) & set(grid))
        if both:
            raise PlanError(f"{where}: {both} both fixed and on the grid")
        axes = {}
        for k, v in grid.items():
            vals = list(v) if isinstance(v, list) else [v]
            if not vals:
                raise PlanError(f"{where}: grid {k!r} has no values")
            axes[str(k)] = vals
        def here(k: str, v: Any) -> Any:  # file parameters in a plan are relative to the plan
            return str((base / v).resolve()) if k in PATH_PARAMS and isinstance(v, str) and v else v

        fixed = {str(k): here(str(k), v) for k, v in fixed.items()}
        axes = {k: [here(k, v) for v in vals] for k, vals in axes.items()}
        out.append((nb, fixed, axes))
    baselines = (base / str(d["baselines"])).resolve() if d.get("baselines") else PROFILES_DIR
    return {"name": str(d.get("name") or path.stem), "baselines": baselines, "threshold": thr, "runs": out}


# ---- regression gate ------------------------------------------------------------------------------

MIN_THRESHOLD = 0.05  # run-to-run drift of one device that the samples of one run do not show
Z_SPREAD = 4.0


def spread_threshold(ra: Any, rb: Any) -> float:
    """The relative slowdown that counts for one row pair, from its samples' spread: Z_SPREAD standard errors
    of the difference of the two medians, relative to the baseline's median, and at least MIN_THRESHOLD.
    Each median's standard error is 1.2533 sigma / sqrt(samples), sigma taken from the p10..p90 span
    (2.563 sigma for a normal spread), so a noisy row needs a bigger change before it counts."""
    def se(r: Any) -> float:
        n = max(len(r.samples_us or []), 1)
        return 1.2533 * max(r.p90_us - r.p10_us, 0.0) / 2.563 / math.sqrt(n)

    if ra.median_us <= 0:
        return MIN_THRESHOLD
    return max(MIN_THRESHOLD, Z_SPREAD * math.sqrt(se(ra) ** 2 + se(rb) ** 2) / ra.median_us)


def gate(a: Any, b: Any, threshold: float | None = None) -> Any:
    """k3lab.harness.bundle.compare of baseline `a` and new `b`, with the time threshold per row: `threshold`
    when given, else spread_threshold. cpu-smoke rows are shown and never gated on time; rows of different
    timing kinds or modes are not compared; an error check that went from passing to failing always counts.
    Each row dict gains 'threshold' (None where the row is not gated on time)."""
    from k3lab.harness.bundle import compare as cmp

    if threshold is not None and threshold < 0:
        raise ValueError("threshold must be >= 0")
    c = cmp(a, b, math.inf)  # every time gate below, per row; error-check regressions come from compare
    ia = {(r.name, r.backend): r for r in a.rows}
    ib = {(r.name, r.backend): r for r in b.rows}
    for rec in c.rows:
        rec["threshold"] = None
        if rec["ratio"] is None or rec["kind"] == "cpu-smoke":
            continue
        key = (rec["name"], rec["backend"])
        thr = threshold if threshold is not None else spread_threshold(ia[key], ib[key])
        rec["threshold"] = thr
        if rec["ratio"] > 1.0 + thr:
            slow = f"slower by {100 * (rec['ratio'] - 1):.1f}% (threshold {100 * thr:.1f}%)"
            rec["regression"] = True
            rec["why"] = slow + ("; " + rec["why"] if rec["why"] else "")
    c.threshold = threshold
    return c


def find_baseline(bundle: Any, root: Path) -> Path | None:
    """The baseline of a bundle under `root` (profiles/): a bundle one folder down (profiles/<gpu>/*.json or
    *.json.gz, not runs/) with the same name measured on the same kind of device (env.gpu_slug)."""
    root = Path(root)
    if not root.is_dir():
        return None
    from k3lab.harness.bundle import BUNDLE_GLOBS, read_json

    for p in sorted({q for g in BUNDLE_GLOBS for q in root.glob(f"*/{g}")}):
        if p.parent.name == "runs":
            continue
        try:
            d = read_json(p)
        except (OSError, ValueError, EOFError):
            continue
        if (isinstance(d, dict) and "schema_version" in d and d.get("name") == bundle.name
                and (d.get("env") or {}).get("gpu_slug", "cpu") == bundle.gpu_slug):
            return p
    return None


@app.command(context_settings=_EXTRA, help="Run notebooks over parameter grids: a plan (PLAN.yaml; see "
             "k3lab.cli.load_plan) or one notebook with --grid. Writes an index page linking every run, "
             "compares every bundle with its baseline under profiles/ and exits 1 on a failed run or a "
             "regression. Fixed " + PARAM_HELP)
def sweep(ctx: typer.Context, target: Path = typer.Argument(..., help="a plan (.yaml) or a notebook"),
          grid: list[str] = typer.Option([], "--grid", "-g", help="NAME=v1,v2,... (with a notebook; repeatable)"),
          out: Path | None = typer.Option(None, "--out", help="the sweep's folder (default "
                                          "profiles/runs/sweep-<time>-<name>): one run folder each, index.html"),
          baselines: Path | None = typer.Option(None, "--baselines", help="baselines root (default: the plan's, "
                                                "else profiles/)"),
          threshold: float | None = typer.Option(None, "--threshold", "-t", help="a fixed relative slowdown "
                                                 "that counts (default: per row, from the samples' spread)"),
          code: bool = typer.Option(False, "--code", help="keep the code cells in the HTML reports"),
          quiet: bool = typer.Option(True, "--quiet/--verbose")) -> None:
    from rich.console import Console
    from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn
    from rich.table import Table

    from k3lab.harness.bundle import BundleError, load
    from k3lab.report import sweep_index

    try:
        if target.suffix in (".yaml", ".yml"):
            if grid or ctx.args:
                raise PlanError("a plan holds its own grids and parameters: no --grid or -p with a plan")
            plan = load_plan(target)
        else:
            if not target.is_file():
                raise PlanError(f"notebook {target} does not exist")
            if not grid:
                raise PlanError("a notebook sweep needs --grid NAME=v1,v2 (or pass a plan)")
            axes: dict[str, list[Any]] = {}
            for g in grid:
                if "=" not in g:
                    raise PlanError(f"--grid {g!r}: expected NAME=v1,v2,...")
                k, vals = g.split("=", 1)
                vs = [parse_value(v) for v in _split_values(vals) if v.strip()]
                if not vs:
                    raise PlanError(f"--grid {g!r}: no values (expected NAME=v1,v2,...)")
                if k.strip() in axes:
                    raise PlanError(f"--grid {k.strip()!r} given twice")
                axes[k.strip()] = vs
            fixed = _params_from_args(ctx.args)
            both = sorted(set(fixed) & set(axes))
            if both:
                raise PlanError(f"{both} both fixed (-p) and on the grid: give each parameter one way")
            plan = {"name": target.stem, "baselines": PROFILES_DIR, "threshold": None,
                    "runs": [(target.resolve(), fixed, axes)]}
    except (PlanError, typer.BadParameter) as e:
        _echo_err(f"error: {e}")
        raise typer.Exit(2) from None
    if baselines is not None:
        plan["baselines"] = baselines.resolve()
    _refuse_threshold(threshold)
    if threshold is not None:
        plan["threshold"] = threshold
    jobs = []
    try:  # every combination's parameters checked before the first run
        for nb, fixed, axes in plan["runs"]:
            for vs in itertools.product(*axes.values()):
                c = dict(zip(axes, vs))
                jobs.append((nb, {**fixed, **c}, c, check_params(nb, {**fixed, **c})))
    except RunFailed as e:
        _echo_err(f"error: {e}")
        raise typer.Exit(2) from None
    stamp = _dt.datetime.now().strftime("%Y%m%d-%H%M%S")
    root = Path(out).resolve() if out else PROFILES_DIR / "runs" / f"sweep-{stamp}-{plan['name']}"
    root.mkdir(parents=True, exist_ok=True)
    console = Console(stderr=True)
    runs: list[dict[str, Any]] = []
    with Progress(TextColumn("{task.description}"), BarColumn(), TextColumn("{task.completed}/{task.total}"),
                  TimeElapsedColumn(), console=console) as prog:
        task = prog.add_task(f"sweep {plan['name']}", total=len(jobs))
        for nb, params, c, _ in jobs:
            prog.update(task, description=f"{nb.stem} {json.dumps(c)}")
            rec: dict[str, Any] = {"notebook": str(nb), "params": params, "grid": c, "bundles": []}
            try:
                rd = execute(nb, params, root / run_id(nb, params), quiet=quiet, code=code, js_dir=root)
                rec["status"] = "ok"
            except RunFailed as e:
                rd = e.run_dir
                rec["status"], rec["error"] = "failed", str(e)
            if rd is not None:
                meta = json.loads((rd / "run.json").read_text()) if (rd / "run.json").exists() else {}
                rec.update(run_dir=str(rd), seconds=meta.get("seconds"),
                           report=str(rd / meta["html"]) if meta.get("html") else None,
                           executed=str(rd / nb.name) if (rd / nb.name).exists() else None,
                           bundles=[str(rd / x) for x in meta.get("bundles", [])])
            runs.append(rec)
            prog.advance(task)
    gates: list[dict[str, Any]] = []
    smoke = 0
    for rec in runs:
        for bp in rec["bundles"]:
            g: dict[str, Any] = {"bundle": bp, "regressions": [], "compared": 0, "gated": 0, "cpu_smoke": 0}
            try:
                bd = load(bp)
            except BundleError as e:
                g["note"] = f"unreadable: {e}"
                gates.append(g)
                continue
            base = find_baseline(bd, plan["baselines"])
            if base is None:
                g["note"] = f"no baseline named {bd.name} ({bd.gpu_slug}) under {plan['baselines']}"
            else:
                c = gate(load(base), bd, plan["threshold"])
                g["baseline"] = str(base)
                g["compared"] = sum(r["ratio"] is not None for r in c.rows)
                g["gated"] = sum(r["threshold"] is not None for r in c.rows)
                g["cpu_smoke"] = sum(r["kind"] == "cpu-smoke" for r in c.rows)
                g["regressions"] = [{k: r[k] for k in ("name", "backend", "ratio", "threshold", "why")}
                                    for r in c.regressions]
                if not c.rows and bd.config.get("rows_expected", True):  # nothing was checked: no pass
                    g["regressions"] = [{"name": "(every row)", "backend": "-", "ratio": None, "threshold": None,
                                         "why": f"no row in common with the baseline ({len(c.only_a)} rows there)"}]
                smoke += g["cpu_smoke"]
                if g["cpu_smoke"]:
                    g["note"] = f"{g['cpu_smoke']} cpu-smoke rows shown, never gated on time"
            gates.append(g)
    n_reg = sum(len(g["regressions"]) for g in gates)
    failed = [r for r in runs if r["status"] != "ok"]
    thr_note = (f"threshold {plan['threshold']:.1%} for every row" if plan["threshold"] is not None else
                f"threshold per row from the samples' spread ({Z_SPREAD:g} standard errors of the median "
                f"difference, at least {MIN_THRESHOLD:.0%})")
    notes = [thr_note, "cpu-smoke rows (CPU wall clock) are shown and never gated on time; only a failing "
             "error check counts for them"]
    index = sweep_index(root / "index.html", f"sweep {plan['name']}", runs, gates, notes)
    (root / "sweep.json").write_text(json.dumps({"plan": plan["name"], "runs": runs, "gates": gates},
                                                indent=1, default=str) + "\n")
    out_c = Console(width=200)
    table = Table(title=f"sweep {plan['name']}: {len(runs)} runs")
    for col in ("notebook", "grid", "status", "s", "run / error"):
        table.add_column(col, overflow="fold")
    for r in runs:
        table.add_row(Path(r["notebook"]).stem, json.dumps(r["grid"]), r["status"], str(r.get("seconds", "")),
                      r.get("run_dir") or "" if r["status"] == "ok" else (r.get("error") or "").splitlines()[0])
    out_c.print(table)
    for g in gates:
        what = (f"{len(g['regressions'])} regression(s) of {g['gated']} gated rows" if g.get("baseline")
                else g.get("note", ""))
        typer.echo(f"{Path(g['bundle']).name}: {what}" + (f" against {g['baseline']}" if g.get("baseline") else ""))
        for x in g["regressions"]:
            typer.echo(f"  REGRESSION {x['name']} [{x['backend']}]: {x['why']}")
    if smoke:
        typer.echo(f"cpu-smoke: {smoke} rows compared and never gated on time (CPU wall clock says nothing "
                   "about a kernel)")
    typer.echo(thr_note)
    typer.echo(f"index: {index}")
    if failed or n_reg:
        typer.echo(f"{len(failed)} failed run(s), {n_reg} regression(s)")
        raise typer.Exit(1)


@app.command()
def compare(a: Path = typer.Argument(..., help="baseline bundle (JSON or run directory)"),
            b: Path = typer.Argument(..., help="new bundle (JSON or run directory)"),
            threshold: float | None = typer.Option(None, "--threshold", "-t", help="a fixed relative slowdown "
                                                   "that counts (default: per row, from the samples' spread)")
            ) -> None:
    """Ratios new/baseline per component; exit 1 on regressions (slower than the row's threshold, or an error
    check that now fails). cpu-smoke rows are shown and never gated on time."""
    from rich.console import Console
    from rich.table import Table

    from k3lab.harness.bundle import BundleError, load

    _refuse_threshold(threshold)
    try:
        ba, bb = load(a), load(b)
    except BundleError as e:
        _echo_err(f"error: {e}")
        raise typer.Exit(2) from None
    c = gate(ba, bb, threshold)
    how = f"threshold {threshold:.0%}" if threshold is not None else "threshold per row from the samples' spread"
    t = Table(title=f"{bb.name} vs {ba.name} ({how})")
    for col in ("component", "backend", "kind", "A us", "B us", "B/A", "thr", ""):
        t.add_column(col)
    for r in c.rows:
        ratio = "-" if r["ratio"] is None else f"{r['ratio']:.3f}"
        thr = "-" if r["threshold"] is None else f"{r['threshold']:.1%}"
        t.add_row(r["name"], r["backend"], r["kind"], f"{r['a_us']:.2f}", f"{r['b_us']:.2f}", ratio, thr,
                  ("[red]REGRESSION " + r["why"] + "[/red]") if r["regression"] else r["why"])
    Console(width=180).print(t)
    for k in c.only_a:
        typer.echo(f"only in A: {k[0]} [{k[1]}]")
    for k in c.only_b:
        typer.echo(f"only in B: {k[0]} [{k[1]}]")
    if ba.env.get("gpu_slug") != bb.env.get("gpu_slug"):
        typer.echo(f"note: different devices ({ba.env.get('gpu')} vs {bb.env.get('gpu')})")
    smoke = sum(r["kind"] == "cpu-smoke" for r in c.rows)
    if smoke:
        typer.echo(f"cpu-smoke: {smoke} rows shown, never gated on time")
    if not c.rows and bb.config.get("rows_expected", True):  # e.g. a new bundle that measured nothing: no pass
        typer.echo(f"nothing compared: B shares no row with A ({len(c.only_a)} rows only in A, {len(c.only_b)} only "
                   f"in B)")
        raise typer.Exit(1)
    if c.only_a:
        typer.echo(f"note: {len(c.only_a)} of A's rows are missing from B (not compared)")
    if c.has_regressions:
        typer.echo(f"{len(c.regressions)} regression(s)")
        raise typer.Exit(1)
    typer.echo("no regressions")


@app.command()
def env() -> None:
    """Print the environment fingerprint (JSON)."""
    from k3lab.harness.env import fingerprint

    typer.echo(json.dumps(fingerprint(), indent=1))


def _error_gist(error: str) -> str:
    """What a failed run's error says, without the cell-locating preamble: the exception line when there is one."""
    first = error.splitlines()[0]
    m = re.search(r"execution count \d+: (.*)$", first)
    return (m.group(1) if m else first)[:200]


@app.command()
def runs(prune: bool = typer.Option(False, "--prune-failed", help="delete the failed runs"),
         root: Path = typer.Option(PROFILES_DIR / "runs", help="where `k3lab run` puts its runs")) -> None:
    """List the runs under profiles/runs (status, seconds, notebook, error), and optionally delete the failed."""
    if not root.is_dir():
        typer.echo(f"no runs under {root}")
        return
    failed = []
    for d in sorted(p for p in root.iterdir() if p.is_dir()):
        meta_p = d / "run.json"
        if not meta_p.exists():
            continue
        meta = json.loads(meta_p.read_text())
        st = meta.get("status", "?")
        typer.echo(f"{st:7s} {meta.get('seconds', '?'):>8} s  {d.name}  {Path(meta.get('notebook') or '?').name}"
                   + (f"\n        {_error_gist(meta['error'])}" if meta.get("error") else ""))
        if st == "failed":
            failed.append(d)
    if prune:
        for d in failed:
            shutil.rmtree(d)
        typer.echo(f"deleted {len(failed)} failed run(s)")


@app.command()
def probes() -> None:
    """Measure and print this device's copy bandwidth, read-only bandwidth (per probe tile) and launch floor."""
    from k3lab.harness.timing import probes as measure

    typer.echo(json.dumps(measure(), indent=1))


@app.command()
def publish(run_dir: Path = typer.Argument(..., help="a run directory from `k3lab run`, a bench output directory "
                                            "or one bundle file"),
            gpu: str | None = typer.Option(None, "--gpu", help="profiles/<gpu>/ (default: the bundle's GPU)"),
            profiles: Path = typer.Option(PROFILES_DIR, "--profiles", help="profiles root"),
            gz: bool = typer.Option(False, "--gzip", help="store NAME.json.gz (gzip -9, no timestamp)"),
            report: bool = typer.Option(True, help="also copy the HTML report beside the bundle (--no-report: the "
                                        "bundle alone; `k3lab report` remakes the page)"),
            made_by: str = typer.Option("", "--made-by", help="the README row's command (default: the `k3lab bench` "
                                        "command the bundle's config gives, or the run record's notebook and "
                                        "parameters)"),
            what: str = typer.Option("", "--what", help="the README row's last cell: what the bundle shows")) -> None:
    """Copy a run's bundle(s) and HTML report into profiles/<gpu>/ (relinking plotly.js), and give each file a row
    in profiles/<gpu>/README.md naming the command that made it (where no row names it yet)."""
    from k3lab.harness.bundle import BundleError, find_bundles, load, safe_name, stem_path
    from k3lab.report import relink_plotly, shared_plotly_js

    run_dir = Path(run_dir)
    bundles = [run_dir] if run_dir.is_file() else find_bundles(run_dir) if run_dir.is_dir() else []
    if run_dir.is_file():
        run_dir = run_dir.parent
    if not bundles:
        _echo_err(f"error: no results bundle in {run_dir}")
        raise typer.Exit(2)
    htmls = sorted(run_dir.glob("*.html"))
    js = shared_plotly_js(profiles)
    for p in bundles:
        try:
            bd = load(p)
        except BundleError as e:
            _echo_err(f"error: {e}")
            raise typer.Exit(2) from None
        if measured_nothing(bd):
            _echo_err(f"error: {p.name} holds no rows (its run measured nothing): nothing to publish")
            raise typer.Exit(2)
        if gpu is not None and gpu != bd.gpu_slug:
            _echo_err(f"error: {p.name} was measured on {bd.gpu_slug!r} ({bd.env.get('gpu')}), not {gpu!r}: evidence "
                      f"goes under the device that made it (leave --gpu out)")
            raise typer.Exit(2)
        dest = Path(profiles) / (gpu or bd.gpu_slug)
        dest.mkdir(parents=True, exist_ok=True)
        stem = safe_name(bd.name)
        ext = ".json.gz" if gz or p.name.endswith(".gz") else ".json"
        if gz and not p.name.endswith(".gz"):
            bd.save_as(dest / f"{stem}{ext}")  # the bundle module's own writer (gzip -9, no timestamp)
        else:
            shutil.copyfile(p, dest / f"{stem}{ext}")
        typer.echo(f"bundle -> {dest / f'{stem}{ext}'}")
        files = [f"{stem}{ext}"]
        beside = stem_path(p).with_suffix(".html")  # `k3lab bench` writes its report next to its bundle
        html = beside if beside.is_file() else (htmls[0] if htmls else None)
        if html is not None and report:
            files.append(f"{stem}.html")
            shutil.copyfile(html, dest / f"{stem}.html")
            relink_plotly(dest / f"{stem}.html", js)
            typer.echo(f"report -> {dest / f'{stem}.html'}")
        row = _readme_row(dest, files, made_by or _made_by_default(bd, stem, run_dir), what)
        if row:
            typer.echo(f"README row -> {dest / 'README.md'}")


def _made_by_default(bd: Any, stem: str, run_dir: Path) -> str:
    """The command a bundle records: its `k3lab bench` command, else its run record's notebook and parameters."""
    from k3lab import targets as tg

    code = f" (code of `{str(bd.env.get('commit') or '?')[:7]}`{' + changes' if bd.env.get('dirty') else ''})"
    if "bench" in (bd.config or {}):
        return f"`{tg.bench_command(bd.to_dict(), stem, 'OUT')}`{code}"
    rec = run_dir / "run.json"
    if rec.is_file():
        r = json.loads(rec.read_text())
        params = " ".join(f"-p {k} {json.dumps(v)}" for k, v in (r.get("params") or {}).items())
        return f"`k3lab run notebooks/{Path(r.get('notebook', '?')).name} {params}`{code}"
    return f"not recorded: give --made-by{code}"


def _readme_row(dest: Path, files: list[str], made_by: str, what: str) -> bool:
    """A row for these files at the top of dest/README.md's first table (the README made with its header if there is
    none) unless a row already names the first; True where one was written."""
    from k3lab import targets as tg

    readme = dest / "README.md"
    if readme.is_file() and tg.made_by(dest / files[0], root=dest.parent) is not None:
        return False
    text = readme.read_text() if readme.is_file() else (
        f"# {dest.name} evidence\n\nEach file's command; figures: the bundles and docs/NOTES_*.md.\n\n"
        "| file | made by | what |\n|---|---|---|\n")
    row = "| " + ", ".join(f"`{f}`" for f in files) + f" | {made_by.replace('|', '/')} | {what.replace('|', '/')} |"
    lines = text.splitlines()
    at = next((i + 1 for i, ln in enumerate(lines) if ln.startswith("|---")), None)
    if at is None:
        lines += ["", "| file | made by | what |", "|---|---|---|"]
        at = len(lines)
    lines.insert(at, row)
    readme.write_text("\n".join(lines) + "\n")
    return True


def _grid(items: list[str]) -> dict[str, tuple]:
    """--grid NAME=v1,v2 (repeatable) -> {NAME: (v1, v2)}, values parsed as JSON when they parse."""
    out: dict[str, tuple] = {}
    for g in items:
        if "=" not in g:
            raise typer.BadParameter(f"--grid {g!r}: expected NAME=v1,v2,...")
        k, vals = g.split("=", 1)
        out[k.strip()] = tuple(parse_value(v) for v in _split_values(vals))
    return out


def _component(component: str) -> None:
    from k3lab import registry

    if component not in registry.components():
        _echo_err(f"error: unknown component {component!r}; registered: {registry.components()}")
        raise typer.Exit(2)


@app.command()
def bench(component: str = typer.Argument(..., help="a registered component (k3lab.registry), e.g. kda"),
          grid: list[str] = typer.Option([], "--grid", "-g",
                                         help="NAME=v1,v2: an axis (heads, batch, T, ...) or option (tile_v, ...)"),
          ops: str = typer.Option("", help="ops to run (default: the component's sweep ops)"),
          backends: str = typer.Option("triton,cute", help="our backends to run where available"),
          peers: bool = typer.Option(True, help="also time the reference, torch.compile and the public peers"),
          variants: bool = typer.Option(True, help="also time each op's variants (e.g. cute_pdl) at the auto choice"),
          hot: bool = typer.Option(False, "--hot", help="replay one input set hot in L2 instead of rotating past it"),
          reps: int = typer.Option(50),
          out: Path = typer.Option(Path("profiles/runs/bench"), help="bundle + report land in OUT/<gpu>/"),
          name: str = typer.Option("", help="bundle name (default <component>_sweep)"),
          deadline: float = typer.Option(0, help="stop starting new cases after this many seconds (0: none)"),
          skip: str = typer.Option("", help="peers to leave out, e.g. torch_compile (its builds take tens of "
                                             "seconds a case)"),
          ) -> None:
    """Every op of a component, checked against fp64 then timed beside its peers; bundle + HTML report."""
    from k3lab import registry
    from k3lab.bench import runner
    from k3lab.report import bundle_report

    _component(component)
    try:
        g = _grid(grid)
        op_names = [o for o in ops.split(",") if o] or None
        var = {}
        if variants:
            for op in registry.ops_of(component):
                var.update(op.variants)
        bd = runner.run(component, grid=g, ops=op_names, backends=[b for b in backends.split(",") if b],
                        peers=peers, reps=reps, hot=hot, deadline_s=deadline or None, variants=var,
                        name=name or None, skip=[s for s in skip.split(",") if s])
    except (registry.RegistryError, typer.BadParameter) as e:
        _echo_err(f"error: {e}")
        raise typer.Exit(2) from None
    if not bd.rows:  # an empty bundle would read as a run: say why nothing ran instead
        why = "; ".join(f"{b}: {w}" for b, w in bd.backends_skipped.items()) or "no implementation took a case"
        _echo_err(f"error: bench {component}: no row ran, nothing saved ({why})")
        raise typer.Exit(1)
    path = bd.save(out)
    typer.echo(f"bundle -> {path}")
    try:
        typer.echo(f"report -> {bundle_report(bd, path.with_suffix('.html'))}")
    except ImportError as e:  # a GPU machine without plotly: the bundle is saved, `k3lab report` makes the page
        _echo_err(f"no report here ({e}); make it with `k3lab report {path}`")


@app.command()
def check(component: str = typer.Argument(..., help="a registered component, e.g. kda"),
          grid: list[str] = typer.Option([], "--grid", "-g", help="NAME=v1,v2: an axis or an option"),
          ops: str = typer.Option("", help="ops to check (default: the component's sweep ops)"),
          backends: str = typer.Option("triton,cute", help="backends to check where available"),
          seeds: str = typer.Option("0", help="comma-separated seeds: fresh random inputs each")) -> None:
    """Every case x backend x option of a component against fp64 with the one checker (no timing);
    exit 1 when any check fails."""
    from k3lab import registry
    from k3lab.bench import runner

    _component(component)
    try:
        res = runner.check_all(component, grid=_grid(grid), ops=[o for o in ops.split(",") if o] or None,
                               backends=[b for b in backends.split(",") if b],
                               seeds=[int(x) for x in seeds.split(",") if x.strip()])
    except (registry.RegistryError, typer.BadParameter, ValueError) as e:
        _echo_err(f"error: {e}")
        raise typer.Exit(2) from None
    if not res:  # every backend skipped (their reasons printed above): nothing was checked, which is no pass
        _echo_err(f"error: check {component}: no check ran")
        raise typer.Exit(1)
    bad = [r for r in res if not r.ok]
    typer.echo(f"{len(res) - len(bad)} of {len(res)} checks passed")
    if bad:
        raise typer.Exit(1)


@app.command()
def report(bundle: Path = typer.Argument(..., help="a results bundle (JSON)"),
           out: Path | None = typer.Option(None, help="the HTML page (default: beside the bundle)")) -> None:
    """(Re)make the standalone HTML report of a results bundle; the bundle itself is not changed."""
    from k3lab.harness.bundle import BundleError, find_bundles, load, stem_path
    from k3lab.report import bundle_report

    try:
        bd = load(bundle)
    except BundleError as e:
        _echo_err(f"error: {e}")
        raise typer.Exit(2) from None
    src = find_bundles(bundle)[0] if Path(bundle).is_dir() else Path(bundle)  # a run folder's one bundle
    typer.echo(f"report -> {bundle_report(bd, out or stem_path(src).with_suffix('.html'))}")


@app.command()
def targets(issue: list[int] = typer.Option([], "--issue", "-i", help="only these issues (repeatable)"),
            spec: Path | None = typer.Option(None, help="the target list (default data/targets.json)"),
            failing: bool = typer.Option(False, "--failing", help="only the targets not met"),
            write: Path | None = typer.Option(None, help="write the whole page there (docs/STATUS.md)"),
            profiles: Path | None = typer.Option(None, help="read the bundles of these names from this directory "
                                                 "instead (another GPU's, e.g. profiles/h100-80gb-hbm3, or its "
                                                 "name alone); a target whose bundle is not there is listed as not "
                                                 "measured"),
            beside: list[Path] = typer.Option([], "--beside", help="also read the targets off this directory (another "
                                              "GPU's bundles, or its name alone), one column each (repeatable)"),
            commands: bool = typer.Option(False, "--commands", help="print, instead of the table, the commands that "
                                          "remake the selected targets' bundles under their names on this machine's "
                                          "GPU, then the --profiles line that reads them"),
            out: str = typer.Option("profiles/runs/targets", help="with --commands: where those bundles go")
            ) -> None:
    """Every issue target read off the committed bundles (data/targets.json): the worst case of each against
    its target, which rows decided it, and the bundle (a Markdown table; nothing typed by hand). With --commands:
    how to read the same targets on another GPU (each bundle's `k3lab bench` command from its recorded config)."""
    from k3lab import targets as tg

    def gpu_dir(p: Path) -> tuple[Path, Path]:
        """(the directory read, how the table names it): a GPU's name is its directory under profiles/."""
        if not p.is_dir() and (tg.ROOT / "profiles" / p).is_dir():
            return tg.ROOT / "profiles" / p, Path("profiles") / p
        return p.resolve(), p

    profiles_dir = None
    if profiles is not None:
        profiles_dir, profiles = gpu_dir(profiles)
    where = "profiles/h200/" if profiles is None else f"{profiles}/"
    try:
        entries = tg.load_spec(spec)
        res = tg.evaluate_all(entries, issues=issue or None, profiles=profiles_dir)
        others = []
        for b in beside:
            d, name = gpu_dir(b)
            others.append((name.name, tg.evaluate_all(entries, issues=issue or None, profiles=d)))
    except (tg.TargetError, OSError) as e:
        _echo_err(f"error: {e}")
        raise typer.Exit(2) from None
    if commands and (write is not None or beside):
        _echo_err("error: --commands prints commands (no --write / --beside)")
        raise typer.Exit(2)
    if write is not None and profiles is not None:
        _echo_err("error: --write writes the page of the committed H200 bundles (no --profiles)")
        raise typer.Exit(2)
    if write is not None:
        if issue or failing or beside:
            _echo_err("error: --write writes the whole page (no --issue / --failing / --beside)")
            raise typer.Exit(2)
        write.write_text(tg.status_page(res))
        typer.echo(f"wrote {write}")
        return
    if failing:
        keep = [i for i, r in enumerate(res) if not r.met]
        res = [res[i] for i in keep]
        others = [(n, [o[i] for i in keep]) for n, o in others]
    if commands:
        import torch

        from k3lab.harness.env import gpu_slug

        chosen = [e for e in entries if not issue or e["issue"] in issue]
        chosen = [e for e in chosen if (e["issue"], e["case"]) in {(r.issue, r.case) for r in res}]
        gpu = gpu_slug(torch.cuda.get_device_name()) if torch.cuda.is_available() else None
        typer.echo(tg.remake_commands(chosen, out=out, gpu=gpu), nl=False)
        return
    typer.echo(tg.markdown(res, where, beside=others))


@app.command()
def digest(rev: str | None = typer.Argument(None, help="a commit; none: the working tree")) -> None:
    """The source digest a results bundle records (env.source_digest), of the working tree or a commit."""
    from k3lab.harness.env import source_digest, source_digest_of

    if rev is None:
        typer.echo(source_digest())
        return
    try:
        typer.echo(source_digest_of(rev))
    except ValueError as e:
        _echo_err(f"error: {e}")
        raise typer.Exit(2) from None


@app.command()
def defaults(component: str = typer.Argument(..., help="a registered component, e.g. kda"),
             bundles: list[Path] = typer.Argument(..., help="sweep bundles (`k3lab bench`); later ones win"),
             heads: int = typer.Option(12, help="the head count the rules are taken at"),
             primary: str = typer.Option("cute", help="the backend whose rules come first"),
             fallback: str = typer.Option("triton", help="the backend used where the primary cannot run"),
             option: str = typer.Option("tile_v", help="the option the rules choose"),
             write: Path | None = typer.Option(None, help="write the table here (e.g. data/kda_defaults.json)")
             ) -> None:
    """The auto table (backend and option per op, batch and T) from measured sweeps: the fastest option whose
    fp64 check passed; the primary backend's rules first, the fallback's where the primary cannot run."""
    from k3lab import policy, registry
    from k3lab.harness.bundle import read_json

    _component(component)
    ops = {o.name: o.policy_key for o in registry.ops_of(component)}
    rows: list[dict] = []
    for i, p in enumerate(bundles):
        try:
            rows += [dict(r, _bundle=i) for r in read_json(p)["rows"]]
        except (OSError, ValueError, KeyError, EOFError) as e:
            _echo_err(f"error: cannot read the rows of bundle {p}: {e}")
            raise typer.Exit(2) from None

    def key_of(r: dict) -> str | None:
        """The policy key of a row, None for a row off the op's default case in any axis the rules do not key
        (a checkpoint study's c > 1, a bf16 state, another head dim: their winners are not the default's)."""
        x = r.get("extra") or {}
        name = x.get("op") or x.get("component")
        if name not in ops:
            return None
        axes = registry.get(name).axes
        if any(k in x and x[k] != v[0] for k, v in axes.items() if k not in ("batch", "T", "heads")):
            return None
        return ops[name]

    first = policy.default_rules(rows, primary, key_of=key_of, heads=heads, option=option)
    second = policy.default_rules(rows, fallback, key_of=key_of, heads=heads, option=option)
    keys = sorted(set(first) & set(second))
    if not keys:
        _echo_err(f"error: the bundles hold no passing {primary} and {fallback} rows of any {component} op at "
                  f"{heads} heads")
        raise typer.Exit(2)
    names = " ".join(str(p) for p in bundles)
    table = {
        "_what": (f"What backend='auto' runs for the {component} component, per op, batch and positions T: the "
                  "fastest correct implementation measured. The first rule with B <= max_batch and T <= max_T "
                  f"matches (null or absent: any). 'fallback' is used when {primary} cannot run."),
        "_source": (f"generated by `k3lab defaults {component} {names} --heads {heads} --write <this file>`: per "
                    f"measured (batch, T) at {heads} heads, the fastest {option} whose fp64 check passed."),
        **{k: first[k] for k in keys},
        "fallback": {k: second[k] for k in keys},
    }
    text = json.dumps(table, indent=1) + "\n"
    if write is None:
        typer.echo(text)
    else:
        Path(write).write_text(text)
        typer.echo(f"auto table -> {write}")


def main() -> None:
    app()


if __name__ == "__main__":
    main()
