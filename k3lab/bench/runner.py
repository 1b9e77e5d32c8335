"""`k3lab bench COMPONENT`: every registered op of a component, our backends beside the torch reference,
torch.compile and the public peers, per shape; a results bundle.

For each case of the grid: fresh input sets (as many as k3lab.harness.timing.rotation_count says, so the
sets not in use exceed L2; one set with hot=True), then per implementation
  1. the one checker against fp64 on a copy of the first set (outputs poisoned; state, caches and
     histories compared; untouched entries and unchanged inputs required),
  2. the one timer: CUDA-graph replay over the sets ("rotated") or one set ("hot"), recorded per row,
  3. the floor: bytes over the bandwidth the op declares (read or copy, measured in this run) or the
     launch floor, recorded per row.
On a CPU the timings are cpu-smoke (logic only; Triton under TRITON_INTERPRET=1).
"""
from __future__ import annotations

import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

import torch

from k3lab import policy, registry
from k3lab.harness import checker, roofline, timing
from k3lab.harness.bundle import Bundle, Row
from k3lab.registry import Case, Op
from k3lab.switches import BACKENDS, Switches, backend_status


@dataclass
class Impl:
    name: str  # the row's label: a backend, "<backend>_<variant>" or a peer's name
    make: Callable[[dict], Callable[[], Any]]  # input set -> zero-argument callable
    check: Callable[[dict], checker.Result] | None = None  # first input set -> checker result
    options: dict[str, Any] = field(default_factory=dict)
    note: str = ""
    min_sets: int = 1


def _shown(op: Op, key: str, value) -> bool:
    """Whether an option value names its row: not None (the kernel's own choice), and not False unless the option
    also takes None, so that an explicit False (e.g. proj's f16) is told apart from the default."""
    if value is None:
        return False
    if value is False:
        return any(None in vals and False in vals for vals in op.option_axes.get(key, {}).values())
    return True


def _ours(op: Op, case: Case, be: str, opts: dict, name: str | None = None, note: str = "") -> Impl:
    def make(s):
        return lambda: op.call(s, case, be, opts, None)

    def check(s):
        return checker.check(op, case, backend=be, options=opts, inputs=s)

    pdl = bool(opts.get("pdl"))
    return Impl(name or be, make, check, dict(opts), note, min_sets=2 if pdl else 1)


def implementations(op: Op, case: Case, backends: Iterable[str], *, peers: bool, only: dict[str, Iterable],
                    variants: dict[str, tuple[str, dict]] | None = None, gpu: bool) -> tuple[list[Impl], dict]:
    """Our backends (every option combination `only` leaves) and, with peers, the reference, torch.compile
    and the op's public peers. `variants` {name: (backend, extra options)} are timed at the options the
    auto policy picks for the case (e.g. "cute_pdl": ("cute", {"pdl": True})), or, where the auto rule runs
    another backend (a switch of the decode step can still choose this one: the projections' `proj_cute`), at the
    backend's own choices."""
    impls, skipped = [], {}
    for be in backends:
        ok, why = backend_status(be)
        if not ok or be not in op.backends:
            skipped[be] = why if not ok else f"no {op.name} kernel"
            continue
        no = op.supports(be, case)
        if no:  # the backend does not take this case (e.g. cute's bf16-only projection at fp8)
            skipped[be] = no
            continue
        combos = op.options(be, only, case)
        if not combos:  # the grid's options leave none that fits (op.option_valid): said, not dropped in silence
            skipped[be] = f"no combination of the grid's options {only} fits this case ({op.name}'s option_valid)"
            continue
        for opts in combos:
            impls.append(_ours(op, case, be, opts))
    for vname, (be, extra) in (variants or {}).items():
        if not gpu or not any(i.name == be for i in impls):
            continue
        r = policy.rule(op.component, op.policy_key, case.get("batch", 1), case.get("T", 1), op.rule_facts(case))
        if r is None or r.get("backend") != be:
            if any(i.name == be and not any(v is not None for v in i.options.values()) for i in impls):
                impls.append(_ours(op, case, be, dict(extra), name=vname,
                                   note=f"{extra} at the kernel's own choices (auto runs "
                                        f"{r.get('backend') if r else 'no rule'} here)"))
            continue
        opts = {**policy.options_of(r), **extra}
        if all(k not in only or v in set(only[k]) for k, v in policy.options_of(r).items()):
            impls.append(_ours(op, case, be, opts, name=vname, note=f"{extra} at the auto rule's options"))
    if peers:
        for be in ("reference", "torch_compile"):
            if be in op.backends and not any(i.name == be for i in impls):
                impls.append(_ours(op, case, be, {}))
        for p in op.peers(case):
            chk = (lambda s, p=p: p.check(case, s)) if p.check is not None else None
            impls.append(Impl(p.name, p.make, chk, {}, p.note))
    return impls, skipped


def _kind(v: Any) -> str:
    """The JSON kind of a grid value: bool, int, float, str or null (a bool is not an int here)."""
    if v is None:
        return "null"
    if isinstance(v, bool):
        return "bool"
    if isinstance(v, int):
        return "int"
    return "float" if isinstance(v, float) else type(v).__name__


def grid_cases(what: str, op_list: list[Op], grid: dict[str, tuple], backends: Iterable[str]) -> dict[str, list[Case]]:
    """Each op's cases of `grid` (axis values) after refusing, by name, what would otherwise run nothing silently:
    an unknown backend, an axis value of another kind than the op's own values (batch=abc), and an axis value that
    gives no valid case of any op (batch=0: each op's `valid` rule leaves such points out)."""
    for be in backends:
        if be not in BACKENDS:
            raise registry.RegistryError(f"{what}: unknown backend {be!r} in --backends; allowed: {BACKENDS}")
    for k, vals in grid.items():  # an option value no backend takes would silently run nothing: refuse it
        allowed = {v for o in op_list for per_be in [o.option_axes.get(k, {})] for vs in per_be.values() for v in vs}
        if allowed and (wrong := [v for v in vals if v not in allowed]):
            raise registry.RegistryError(
                f"{what}: grid {k}={wrong!r} is not a value any backend takes; allowed: "
                f"{sorted(allowed, key=repr)} (values parse as JSON: true/false, null, numbers)")
    for k, vals in grid.items():
        kinds = {_kind(v) for o in op_list if k in o.axes for v in o.axes[k]}
        kinds |= {x for o in op_list if k in o.axes for x in o.axis_kinds.get(k, ())}
        if not kinds:
            continue
        ok = kinds | ({"int"} if "float" in kinds else set())
        wrong = [v for v in vals if _kind(v) not in ok]
        if wrong:
            ex = sorted({v for o in op_list if k in o.axes for v in o.axes[k]}, key=repr)
            raise registry.RegistryError(f"{what}: grid {k}={wrong!r}: expected {' or '.join(sorted(kinds))} values "
                                         f"(the ops' own values: {ex})")
    out, seen = {}, {k: [] for k in grid}
    for op in op_list:
        out[op.name] = op.cases({k: v for k, v in grid.items() if k in op.axes})
        for c in out[op.name]:
            for k in seen:
                if k in op.axes:
                    seen[k].append(c[k])
    missing = {k: [v for v in vals if v not in seen[k]] for k, vals in grid.items()
               if any(k in o.axes for o in op_list)}
    if any(missing.values()):
        # blame the values that no op takes even with every other axis at its default; only where each value is
        # fine alone is it the combination
        alone = {k: [v for v in none if not any(o.cases({k: (v,)}) for o in op_list if k in o.axes)]
                 for k, none in missing.items() if none}
        k, none = next(((k, vs) for k, vs in alone.items() if vs), (None, None))
        rule = f"each op's `valid` rule is in k3lab/ops/{op_list[0].component}.py"
        if k is not None:
            size = (f"{k} is a size: at least 1 (k3lab.registry.POSITIVE_AXES); " if k in registry.POSITIVE_AXES
                    and any(isinstance(v, int) and v < 1 for v in none) else "")
            raise registry.RegistryError(f"{what}: grid {k}={none!r} gives no valid case of "
                                         f"{[o.name for o in op_list if k in o.axes]}, whatever the other axes: "
                                         f"{size}{rule}")
        combo = {k: vs for k, vs in missing.items() if vs}
        raise registry.RegistryError(f"{what}: the grid's combination gives no valid case for {combo} (each value is "
                                     f"valid with the other axes at their defaults): {rule}")
    return out


def run(component: str, *, grid: dict[str, Iterable] | None = None, ops: Iterable[str] | None = None,
        backends: Iterable[str] = ("triton", "cute"), peers: bool = True, reps: int = 50, hot: bool = False,
        device: str | None = None, deadline_s: float | None = None, kernels: bool = True,
        variants: dict[str, tuple[str, dict]] | None = None, name: str | None = None,
        skip: Iterable[str] = (), log: Callable[[str], None] = print) -> Bundle:
    """The sweep of `component` (every registered op, or `ops`) over `grid` (axis or option name ->
    values; axes not given take each op's defaults). `skip`: peer names left out (e.g. "torch_compile", whose
    builds cost tens of seconds a case). Returns the bundle (not yet saved)."""
    if isinstance(reps, bool) or not isinstance(reps, int) or reps < 1:
        raise registry.RegistryError(f"bench {component}: reps must be an int >= 1 (timed samples a case), got "
                                     f"{reps!r}")
    if deadline_s is not None and (isinstance(deadline_s, bool) or not deadline_s >= 0):
        raise registry.RegistryError(f"bench {component}: deadline must be None or >= 0 seconds (0: none), got "
                                     f"{deadline_s!r}")
    skip = set(skip)
    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    gpu = torch.device(device).type == "cuda"
    grid = {k: tuple(v) for k, v in (grid or {}).items()}
    op_list = registry.ops_of(component)
    if ops is not None:
        want = set(ops)
        unknown = want - {o.name for o in op_list}
        if unknown:
            raise registry.RegistryError(f"bench {component}: unknown ops {sorted(unknown)}; "
                                         f"{component} has {[o.name for o in op_list]}")
        op_list = [o for o in op_list if o.name in want]
    else:
        op_list = [o for o in op_list if o.in_sweep]
    known = set().union(*(set(o.axes) | set(o.option_axes) for o in op_list))
    bad = sorted(set(grid) - known)
    if bad:
        raise registry.RegistryError(f"bench {component}: unknown grid names {bad}; axes and options: {sorted(known)}")
    cases = grid_cases(f"bench {component}", op_list, grid, backends)
    pr = timing.probes(device)
    log(f"copy {pr['copy_tbps']:.3f} TB/s, read {pr['read_tbps']:.3f} TB/s, launch floor {pr['launch_us']:.2f} us"
        + ("" if gpu else " (cpu-smoke)"))
    bd = Bundle.new(name or f"{component}_sweep", switches=Switches(), copy_tbps=pr["copy_tbps"],
                    read_tbps=pr["read_tbps"], launch_floor_us=pr["launch_us"])
    bd.config = {"bench": component, "ops": [o.name for o in op_list], "grid": {k: list(v) for k, v in grid.items()},
                 "backends": list(backends), "peers": peers, "skip": sorted(skip), "mode": "hot" if hot else "rotated",
                 "reps": reps, "probes": pr}
    if not gpu:
        bd.notes.append("CPU run: cpu-smoke timings and host bandwidths; logic only, not GPU figures")
    t_end = time.time() + deadline_s if deadline_s else None
    not_run: list[str] = []
    for op in op_list:
        only = {k: v for k, v in grid.items() if k in op.option_axes}
        for case in cases[op.name]:
            impls, skipped = implementations(op, case, backends, peers=peers, only=only, variants=variants, gpu=gpu)
            impls = [i for i in impls if i.name not in skip]
            for be, why in skipped.items():
                if be not in bd.backends_skipped:
                    log(f"{op.name}: {be} skipped ({why})")
            bd.backends_skipped.update(skipped)
            if not impls:
                continue
            if t_end is not None and time.time() > t_end:
                not_run.append(case.key())
                continue
            nbytes, flops = op.nbytes(case), op.flops(case)
            n_sets = 1 if hot else (max(2, timing.rotation_count(nbytes, timing.l2_bytes())) if gpu else 2)
            n_sets = max(n_sets, max(i.min_sets for i in impls))
            sets = [op.make_inputs(case, 1000 + i, device) for i in range(n_sets)]
            fl, moved = _floor(op, case, sets, flops, pr)
            pristine = _pristine(op, sets[0])
            for im in impls:
                row = _row(op, case, im, sets, fl, reps=reps, hot=hot, gpu=gpu, kernels=kernels, log=log,
                           check_inputs=pristine, extra=moved)
                if isinstance(row, str):
                    bd.notes.append(row)
                    continue
                bd.add(row)
                bd.backends_ran.setdefault(im.name, im.note or im.name)
            del sets
            if gpu:
                torch.cuda.empty_cache()
    if not_run:
        bd.notes.append(f"deadline reached; cases not run: {not_run}")
        log(f"deadline reached: {len(not_run)} cases not run")
    ours = tuple(b for b in backends)
    bd.notes.append("winners: " + str(policy.winners([r.__dict__ | {"error": r.error} for r in bd.rows], ours)))
    return bd


def _floor(op: Op, case: Case, sets: list[dict], flops: int, pr: dict) -> tuple[roofline.Floor, dict]:
    """The floor of a case's rows from the bytes its timed input sets make the op move: op.set_bytes' mean over the
    sets where the op has it (what the inputs' values decide, e.g. the MoE's distinct experts), else the formula;
    with the formula's value (the expectation) and each set's bytes for the row's record."""
    if op.set_bytes is None:
        return roofline.floor_from_probes(op.nbytes(case), flops, pr, op.floor_bw), {}
    each = [int(op.set_bytes(s, case)) for s in sets]
    moved = dict(bytes_formula=int(op.nbytes(case)), bytes_by_set=each)
    return roofline.floor_from_probes(int(round(sum(each) / len(each))), flops, pr, op.floor_bw), moved


def _pristine(op: Op, inputs: dict) -> dict | None:
    """A copy of the first input set as made, for every row's check, when the op updates inputs in place (an
    earlier row's timing moves them on: see `_row`); None otherwise (no copy of large read-only inputs)."""
    return checker.clone_inputs(inputs) if op.updated else None


def _row(op: Op, case: Case, im: Impl, sets: list[dict], fl: roofline.Floor, *, reps: int, hot: bool, gpu: bool,
         kernels: bool, log: Callable[[str], None], check_inputs: dict | None = None,
         extra: dict | None = None) -> Row | str:
    """The row of one implementation at one case, or a note saying why it has none. The check runs on
    `check_inputs` (the first set as made, before any row's timing) when given: an op that updates its inputs in
    place and whose other inputs were derived from them (the commit: state_hist from the start state) would
    otherwise check a later row against inputs an earlier row's timing moved on. `extra`: more of the row's record
    (the floor's bytes by input set: `_floor`)."""
    x = dict(case.asdict(), **im.options, op=op.name, component=op.name, case=case.key(), options=im.options,
             note=im.note, **(extra or {}))
    err: dict | None = None
    try:
        if im.check is not None:
            res = im.check(sets[0] if check_inputs is None else check_inputs)
            err = dict(ok=res.ok, failures=res.failures, outputs=res.errors,
                       rel_norm=max((e.get("rel_norm") or 0.0) for e in res.errors.values()) if res.errors else None)
            if res.ran:  # what the dispatcher ran for this row (the rest of the record is the row itself)
                x["ran"] = dict(kernel=res.ran[-1].kernel, why=res.ran[-1].why, notes=res.ran[-1].notes)
        fns = [im.make(s) for s in sets]
        kl = timing.kernel_list(fns[0]) if (kernels and gpu) else []
        bench = timing.bench_gpu if gpu else timing.bench_cpu
        kw = dict(rotate=not hot) if gpu else {}
        tm = bench(lambda f: f(), input_sets=[(f,) for f in fns], reps=reps, bytes_per_call=fl.bytes, **kw)
        label = case.key() + "".join(f"[{k}={v}]" for k, v in im.options.items() if _shown(op, k, v))
        row = Row.from_timing(label, im.name, tm, floor=fl, kernels=kl, error=err, **x)
        row.extra["x_floor"] = row.distance
        ok = "" if err is None else ("" if err["ok"] else "  FAIL " + "; ".join(err["failures"])[:160])
        short = ",".join(f"{k}={v}" for k, v in {**case.asdict(), **im.options}.items()
                         if (len(op.axes.get(k, ())) != 1 or v != op.axes[k][0]) and _shown(op, k, v))
        log(f"{op.name:<12} {short:<40} {im.name:<15} {tm.median_us:9.2f} us  floor {fl.floor_us:7.2f} ({fl.bound})"
            f"  x{row.distance:5.2f}{ok}")
        return row
    except Exception as e:  # noqa: BLE001 - the row records what failed
        msg = f"{type(e).__name__}: {e}"[:400]
        log(f"{case.key():<60} {im.name:<16} ERROR {msg[:160]}")
        return f"{op.name} {case.key()} {im.name}: {msg}" + (f" (check: {err})" if err else "")


def check_all(component: str, *, grid: dict[str, Iterable] | None = None, ops: Iterable[str] | None = None,
              backends: Iterable[str] = ("triton", "cute"), seeds: Iterable[int] = (0,), device: str | None = None,
              log: Callable[[str], None] = print) -> list[checker.Result]:
    """The one checker over every case, backend and option combination of `component` (no timing):
    what `k3lab check` prints. Backends that cannot run here are named and skipped."""
    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    grid = {k: tuple(v) for k, v in (grid or {}).items()}
    op_list = [o for o in registry.ops_of(component) if (o.name in set(ops) if ops else o.in_sweep)]
    if ops and (unknown := sorted(set(ops) - {o.name for o in op_list})):
        raise registry.RegistryError(f"check {component}: unknown ops {unknown}; "
                                     f"{component} has {[o.name for o in registry.ops_of(component)]}")
    known = set().union(*(set(o.axes) | set(o.option_axes) for o in op_list))
    if bad := sorted(set(grid) - known):
        raise registry.RegistryError(f"check {component}: unknown grid names {bad}; axes and options: {sorted(known)}")
    cases = grid_cases(f"check {component}", op_list, grid, backends)
    results = []
    for op in op_list:
        only = {k: v for k, v in grid.items() if k in op.option_axes}
        for be in backends:
            ok, why = backend_status(be)
            if not ok or be not in op.backends:
                log(f"{op.name}: {be} skipped ({why if not ok else 'no kernel'})")
                continue
            for case in cases[op.name]:
                combos = op.options(be, only, case)
                if not combos:
                    log(f"{op.name}: {be} skipped at {case.key()} (no combination of the grid's options {only} fits "
                        f"it: {op.name}'s option_valid)")
                for opts in combos:
                    for seed in seeds:
                        try:
                            res = checker.check(op, case, backend=be, options=opts, seed=seed, device=device)
                        except Exception as e:  # noqa: BLE001 - a refusal or a crash is a failed check, named
                            name = be + ("[" + ",".join(f"{k}={v}" for k, v in opts.items()) + "]" if opts else "")
                            res = checker.Result(op.name, case.key(), name,
                                                 failures=[f"{type(e).__name__}: {e}"[:300]])
                        results.append(res)
                        log(str(res))
    return results


def explore(out: str, entries, impls: Callable[[Op, Case, tuple, tuple, bool], list[Impl]], *, reps: int,
            deadline_s: float = 0.0, name: str, device: str = "cuda", log: Callable[[str], None] = print) -> str | None:
    """Named variant sweeps (the H200 explorations behind the kernels' rules, `k3lab.ops.<component>.h200_*`):
    each entry (op name, case dict, variants, peer names) gets its implementations from `impls(op, case, variants,
    peers, gpu)`; every one is checked against fp64 and timed on the same input sets, rotated past L2 (`_row`,
    as `run` does). One bundle `name` under `out`, saved after every case (a run cut short keeps what it
    measured). Returns its path (None if no case ran)."""
    t_end = time.time() + deadline_s if deadline_s else None
    gpu = device == "cuda"
    pr = timing.probes(device)
    log(f"copy {pr['copy_tbps']:.3f} TB/s, read {pr['read_tbps']:.3f} TB/s, launch floor {pr['launch_us']:.2f} us")
    bd = Bundle.new(name, switches=Switches(), copy_tbps=pr["copy_tbps"], read_tbps=pr["read_tbps"],
                    launch_floor_us=pr["launch_us"])
    bd.config = {"entries": [dict(op=o, case=c, variants=list(v), peers=list(p)) for o, c, v, p in entries],
                 "reps": reps, "mode": "rotated", "probes": pr}
    path = None
    for op_name, shape, variants, peers in entries:
        if t_end is not None and time.time() > t_end:
            bd.notes.append(f"deadline reached before {op_name} {shape}")
            continue
        op = registry.get(op_name)
        case = op.case(**shape)
        ims = impls(op, case, tuple(variants), tuple(peers), gpu)
        nbytes = op.nbytes(case)
        n_sets = max(2, timing.rotation_count(nbytes, timing.l2_bytes())) if gpu else 2
        n_sets = max([n_sets] + [i.min_sets for i in ims])
        sets = [op.make_inputs(case, 1000 + i, device) for i in range(n_sets)]
        fl, moved = _floor(op, case, sets, op.flops(case), pr)
        pristine = _pristine(op, sets[0])
        for im in ims:
            row = _row(op, case, im, sets, fl, reps=reps, hot=False, gpu=gpu, kernels=False, log=log,
                       check_inputs=pristine, extra=moved)
            if isinstance(row, str):
                bd.notes.append(row)
            else:
                bd.add(row)
                bd.backends_ran.setdefault(im.name, im.note or im.name)
        del sets
        if gpu:
            torch.cuda.empty_cache()
        path = bd.save(out)
    log(f"bundle -> {path}")
    return path


def named_peers(op: Op, case: Case, names: Iterable[str], gpu: bool) -> list[Impl]:
    """The op's peers (and the reference / torch_compile) whose names are listed, for `explore`."""
    names = tuple(names)
    return [p for p in implementations(op, case, (), peers=True, only={}, gpu=gpu)[0] if p.name in names]
