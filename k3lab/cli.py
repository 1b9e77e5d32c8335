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
import re
import shutil
import time
from pathlib import Path
from typing import Any

import typer

from k3lab.report import PROFILES_DIR

app = typer.Typer(add_completion=False, no_args_is_help=True,
                  help="k3lab: run, sweep and compare K3 decode-path notebooks.")


class RunFailed(Exception):
    def __init__(self, message: str, run_dir: Path):
        super().__init__(message)
        self.run_dir = run_dir


def parse_value(s: str) -> Any:
    try:
        return json.loads(s)
    except (json.JSONDecodeError, ValueError):
        return s


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


def execute(notebook: Path, params: dict[str, Any], out: Path | None = None, *, quiet: bool = False,
            kernel_name: str | None = None) -> Path:
    """Run `notebook` headless with papermill into a run directory; export the HTML report.
    Returns the run directory; raises RunFailed naming the failing cell."""
    import papermill as pm

    from k3lab.harness.bundle import BundleError, find_bundles, load
    from k3lab.report import export_html

    notebook = Path(notebook).resolve()
    if not notebook.exists():
        raise RunFailed(f"notebook {notebook} does not exist", Path.cwd())
    params = check_params(notebook, params)
    run_dir = Path(out).resolve() if out else (PROFILES_DIR / "runs" / run_id(notebook, params))
    run_dir.mkdir(parents=True, exist_ok=True)
    params = {**params, "out_dir": str(run_dir)}
    out_nb = run_dir / notebook.name
    html = run_dir / f"{notebook.stem}.html"
    meta: dict[str, Any] = {"notebook": str(notebook), "params": params, "started": time.time()}
    _kernel_can_import_k3lab()
    t0 = time.time()
    error: str | None = None
    try:
        pm.execute_notebook(str(notebook), str(out_nb), parameters=params, cwd=str(notebook.parent),
                            progress_bar=not quiet, log_output=not quiet, kernel_name=kernel_name,
                            stdout_file=None)
    except pm.PapermillExecutionError as e:
        error = _failure_message(e, notebook)
    except Exception as e:  # noqa: BLE001 - kernel died, bad parameters, ...
        error = f"notebook {notebook.name} could not run: {type(e).__name__}: {e}"
    meta["seconds"] = round(time.time() - t0, 2)
    if out_nb.exists():
        try:
            shown = {k: v for k, v in params.items() if k != "out_dir"}
            export_html(out_nb, html, title=f"{notebook.stem} {json.dumps(shown)}")
            meta["html"] = html.name
        except Exception as e:  # noqa: BLE001
            meta["html_error"] = f"{type(e).__name__}: {e}"
    bundles = []
    for p in find_bundles(run_dir):
        try:
            load(p)
            bundles.append(str(p.relative_to(run_dir)))
        except BundleError as e:
            error = error or f"bundle {p} is invalid: {e}"
    meta["bundles"] = bundles
    meta["status"] = "failed" if error else "ok"
    meta["error"] = error
    (run_dir / "run.json").write_text(json.dumps(meta, indent=1, default=str) + "\n")
    if error:
        raise RunFailed(error, run_dir)
    return run_dir


PATH_PARAMS = ("bundle",)  # parameters that name a file: resolved against the caller's directory


def check_params(notebook: Path, params: dict[str, Any]) -> dict[str, Any]:
    """Refuse a parameter the notebook's parameters cell does not define (naming the valid ones), and a
    value whose type differs from the default's (a number where a number is expected); resolve file
    parameters against the caller's directory (the notebook runs in its own folder)."""
    import papermill as pm

    known = pm.inspect_notebook(str(notebook))
    unknown = sorted(set(params) - set(known) - {"out_dir"})
    if unknown:
        raise RunFailed(f"notebook {notebook.name} has no parameter {unknown}; its parameters: "
                        f"{sorted(k for k in known if k != 'out_dir')}", Path.cwd())
    out = dict(params)
    for k, v in params.items():
        default = (known.get(k) or {}).get("default")
        try:
            dv = parse_value(default) if isinstance(default, str) else default
        except Exception:  # noqa: BLE001
            dv = None
        if isinstance(dv, (int, float)) and not isinstance(dv, bool) and not (
                isinstance(v, (int, float)) and not isinstance(v, bool)):
            raise RunFailed(f"parameter {k!r} expects a number (default {dv!r}), got {v!r}", Path.cwd())
        if k in PATH_PARAMS and isinstance(v, str) and v and not Path(v).is_absolute():
            out[k] = str(Path(v).resolve())
    return out


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
            out[args[i + 1]] = parse_value(args[i + 2])
            i += 3
        else:
            raise typer.BadParameter(f"unexpected argument {a!r}; {PARAM_HELP}")
    return out


@app.command(context_settings=_EXTRA, help="Run a notebook headless into a run directory with an HTML report. "
             + PARAM_HELP)
def run(ctx: typer.Context, notebook: Path = typer.Argument(..., help="notebook to run"),
        out: Path | None = typer.Option(None, "--out", help="run directory (default profiles/runs/<id>)"),
        quiet: bool = typer.Option(False, "--quiet", "-q", help="do not stream cell output")) -> None:
    try:
        run_dir = execute(notebook, _params_from_args(ctx.args), out, quiet=quiet)
    except RunFailed as e:
        _echo_err(f"FAILED: {e}\n  run directory: {e.run_dir}")
        raise typer.Exit(1) from None
    meta = json.loads((run_dir / "run.json").read_text())
    typer.echo(f"ok in {meta['seconds']} s: {run_dir}")
    if meta.get("html"):
        typer.echo(f"  report: {run_dir / meta['html']}")
    for b in meta["bundles"]:
        typer.echo(f"  bundle: {run_dir / b}")
    if not meta["bundles"]:
        typer.echo("  (the notebook wrote no results bundle)")


@app.command(context_settings=_EXTRA, help="Run a notebook over the product of parameter grids. "
             "Fixed " + PARAM_HELP)
def sweep(ctx: typer.Context, notebook: Path = typer.Argument(...),
          grid: list[str] = typer.Option(..., "--grid", "-g", help="NAME=v1,v2,... (repeatable)"),
          out: Path | None = typer.Option(None, "--out", help="parent folder of the runs"),
          quiet: bool = typer.Option(True, "--quiet/--verbose")) -> None:
    from rich.console import Console
    from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn
    from rich.table import Table

    axes: dict[str, list[Any]] = {}
    for g in grid:
        if "=" not in g:
            _echo_err(f"--grid {g!r}: expected NAME=v1,v2,...")
            raise typer.Exit(2)
        k, vals = g.split("=", 1)
        axes[k.strip()] = [parse_value(v) for v in _split_values(vals)]
    fixed = _params_from_args(ctx.args)
    combos = [dict(zip(axes, vs)) for vs in itertools.product(*axes.values())]
    if not Path(notebook).exists():
        _echo_err(f"error: notebook {notebook} does not exist")
        raise typer.Exit(2)
    try:  # every combination's parameters checked before the first run
        for c in combos:
            check_params(Path(notebook).resolve(), {**fixed, **c})
    except RunFailed as e:
        _echo_err(f"error: {e}")
        raise typer.Exit(2) from None
    console = Console(stderr=True)
    results = []
    with Progress(TextColumn("{task.description}"), BarColumn(), TextColumn("{task.completed}/{task.total}"),
                  TimeElapsedColumn(), console=console) as prog:
        task = prog.add_task(f"sweep {notebook.name}", total=len(combos))
        for c in combos:
            params = {**fixed, **c}
            prog.update(task, description=f"{notebook.stem} {json.dumps(c)}")
            dest = (Path(out) / run_id(Path(notebook), params)) if out else None
            try:
                rd = execute(notebook, params, dest, quiet=quiet)
                results.append((c, "ok", str(rd)))
            except RunFailed as e:
                results.append((c, "FAILED", str(e).splitlines()[0]))
            prog.advance(task)
    table = Table(title=f"sweep of {notebook.name}")
    for k in axes:
        table.add_column(k)
    table.add_column("status")
    table.add_column("run / error")
    for c, st, where in results:
        table.add_row(*[json.dumps(c[k]) for k in axes], st, where)
    Console().print(table)
    if any(st != "ok" for _, st, _ in results):
        raise typer.Exit(1)


def _split_values(s: str) -> list[str]:
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


@app.command()
def compare(a: Path = typer.Argument(..., help="baseline bundle (JSON or run directory)"),
            b: Path = typer.Argument(..., help="new bundle (JSON or run directory)"),
            threshold: float = typer.Option(0.05, "--threshold", "-t", help="relative slowdown that counts")) -> None:
    """Ratios new/baseline per component; exit 1 on regressions."""
    from rich.console import Console
    from rich.table import Table

    from k3lab.harness.bundle import BundleError, load
    from k3lab.harness.bundle import compare as cmp

    try:
        ba, bb = load(a), load(b)
    except BundleError as e:
        _echo_err(f"error: {e}")
        raise typer.Exit(2) from None
    c = cmp(ba, bb, threshold)
    t = Table(title=f"{bb.name} vs {ba.name} (threshold {threshold:.0%})")
    for col in ("component", "backend", "kind", "A us", "B us", "B/A", ""):
        t.add_column(col)
    for r in c.rows:
        ratio = "-" if r["ratio"] is None else f"{r['ratio']:.3f}"
        t.add_row(r["name"], r["backend"], r["kind"], f"{r['a_us']:.2f}", f"{r['b_us']:.2f}", ratio,
                  ("[red]REGRESSION " + r["why"] + "[/red]") if r["regression"] else r["why"])
    Console(width=160).print(t)
    for k in c.only_a:
        typer.echo(f"only in A: {k[0]} [{k[1]}]")
    for k in c.only_b:
        typer.echo(f"only in B: {k[0]} [{k[1]}]")
    if ba.env.get("gpu_slug") != bb.env.get("gpu_slug"):
        typer.echo(f"note: different devices ({ba.env.get('gpu')} vs {bb.env.get('gpu')})")
    if c.has_regressions:
        typer.echo(f"{len(c.regressions)} regression(s)")
        raise typer.Exit(1)
    typer.echo("no regressions")


@app.command()
def env() -> None:
    """Print the environment fingerprint (JSON)."""
    from k3lab.harness.env import fingerprint

    typer.echo(json.dumps(fingerprint(), indent=1))


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
        typer.echo(f"{st:7s} {meta.get('seconds', '?'):>8} s  {d.name}  {(meta.get('error') or '')[:100]}")
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
def publish(run_dir: Path = typer.Argument(..., help="a run directory from `k3lab run`"),
            gpu: str | None = typer.Option(None, "--gpu", help="profiles/<gpu>/ (default: the bundle's GPU)"),
            profiles: Path = typer.Option(PROFILES_DIR, "--profiles", help="profiles root")) -> None:
    """Copy a run's bundle(s) and HTML report into profiles/<gpu>/ (relinking plotly.js)."""
    from k3lab.harness.bundle import BundleError, find_bundles, load, safe_name
    from k3lab.report import relink_plotly, shared_plotly_js

    run_dir = Path(run_dir)
    bundles = find_bundles(run_dir) if run_dir.is_dir() else []
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
        dest = Path(profiles) / (gpu or bd.gpu_slug)
        dest.mkdir(parents=True, exist_ok=True)
        stem = safe_name(bd.name)
        shutil.copyfile(p, dest / f"{stem}.json")
        typer.echo(f"bundle -> {dest / f'{stem}.json'}")
        beside = p.with_suffix(".html")  # `k3lab bench` writes its report next to its bundle
        html = beside if beside.is_file() else (htmls[0] if htmls else None)
        if html is not None:
            shutil.copyfile(html, dest / f"{stem}.html")
            relink_plotly(dest / f"{stem}.html", js)
            typer.echo(f"report -> {dest / f'{stem}.html'}")


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
                        name=name or None)
    except (registry.RegistryError, typer.BadParameter) as e:
        _echo_err(f"error: {e}")
        raise typer.Exit(2) from None
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
    bad = [r for r in res if not r.ok]
    typer.echo(f"{len(res) - len(bad)} of {len(res)} checks passed")
    if bad:
        raise typer.Exit(1)


@app.command()
def report(bundle: Path = typer.Argument(..., help="a results bundle (JSON)"),
           out: Path | None = typer.Option(None, help="the HTML page (default: beside the bundle)")) -> None:
    """(Re)make the standalone HTML report of a results bundle; the bundle itself is not changed."""
    from k3lab.harness.bundle import BundleError, load
    from k3lab.report import bundle_report

    try:
        bd = load(bundle)
    except BundleError as e:
        _echo_err(f"error: {e}")
        raise typer.Exit(2) from None
    typer.echo(f"report -> {bundle_report(bd, out or Path(bundle).with_suffix('.html'))}")


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

    _component(component)
    ops = {o.name: o.policy_key for o in registry.ops_of(component)}
    rows: list[dict] = []
    for p in bundles:
        try:
            rows += json.loads(Path(p).read_text())["rows"]
        except (OSError, ValueError, KeyError) as e:
            _echo_err(f"error: cannot read the rows of bundle {p}: {e}")
            raise typer.Exit(2) from None

    def key_of(r: dict) -> str | None:
        x = r.get("extra") or {}
        return ops.get(x.get("op") or x.get("component"))

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
