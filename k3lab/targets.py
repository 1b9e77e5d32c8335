"""The issues' H200 targets read off the committed bundles: `k3lab targets` (one table, every figure from a bundle
under profiles/, nothing typed by hand).

Each target is one entry of `data/targets.json`:

    {"issue": 12, "case": "decode, batch 1, 8K", "target": "<= 5 us",
     "bundle": "profiles/h200/mla_rule_sweep.json.gz",          (or a list: their rows together; a run.json of
                                                                  `k3lab run` is one row, name and backend "run";
                                                                  "a|b": the newest of a, b that exist, so a new
                                                                  run of either takes over when it lands)
     "where": {"op": "mla_decode", "batch": 1, "context": 8192}, (row fields, then the row's `extra`; a list = any of)
     "ours": ["triton", "cute"],                                 (the backends whose best row a case counts)
     "metric": "us", "op": "<=", "value": 5.0}

Metrics, per case (rows grouped by `group_by`, default the row's case name; the best of `ours` in each):
  us          the median (us)
  pct_read    achieved / the read bandwidth of the same run (the row's pct_of_bw; its floor must be "read")
  pct_copy    the same against the copy bandwidth
  x_floor     the median over the row's floor
  over_floor  the median less the row's floor (us)
  x_peer      ours over the fastest of `peer` (a backend or a list) in the same case and the same run (bundle): below 1
              = ahead; a case timed in several runs takes the newest run that timed both
  ratio       ours over the best of `ours` among the rows `over` selects (a `where` of its own)
  field       a value of the best row (`field`: a dotted path, e.g. "extra.launches_per_layer",
              "error.outputs.state.rel_norm"; with "worst_row": true the worst value over every row of `ours`)
  speedup     the fastest of `peer` over ours: above 1 = ours faster
  x_floor_sum the sum of the medians of the rows `names` lists over the sum of their floors
  auto_gap    the row `auto` selects over the fastest row of its group (1.0 = the automatic choice is the best)
With "context_peer" (a backend, e.g. "stream": one kernel reading the same bytes; or a list: the fastest of them in
the case) a pct_read, pct_copy, x_floor or over_floor case also names that peer's value in the same case, for
context only (it never decides the target).
Every case must pass `op value`: the table shows the worst case (and which), so "every batch" targets read as one
line. With `profiles` (`k3lab targets --profiles DIR`) the same targets are read off another directory of bundles of
the same names (another GPU's: `k3lab bench ... --name NAME`, NAME.json or NAME.json.gz); a target whose bundle is not
there is listed as not measured, not an error; `k3lab targets --commands` (`remake_commands`) prints the bench commands
that remake the bundles under their names from each one's recorded config. The targets are the issues' H200
figures: on another GPU the ratios (% of its own read bandwidth, ours over a peer of the same run) carry over, the
absolute microseconds only roughly. Rows whose fp64
check failed are never counted. A missing bundle, or an entry that selects no row, is an error naming the entry (the
test suite evaluates every entry).
"""
from __future__ import annotations

import ast
import json
import math
import operator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from k3lab.harness.bundle import read_json

ROOT = Path(__file__).resolve().parent.parent
SPEC = ROOT / "data" / "targets.json"
METRICS = ("us", "pct_read", "pct_copy", "x_floor", "over_floor", "x_peer", "ratio", "field", "speedup", "x_floor_sum",
           "auto_gap")
OPS = {"<=": operator.le, "<": operator.lt, ">=": operator.ge, ">": operator.gt}


class TargetError(ValueError):
    """A target entry that cannot be evaluated, named."""


@dataclass
class Result:
    issue: int
    case: str
    target: str
    measured: float
    met: bool
    where: str  # the worst case's name and the row(s) that decided it
    bundle: str
    date: str = ""  # when the (newest) bundle was made, YYYY-MM-DD
    measured_here: bool = True  # False: its bundle is not in the directory read (`profiles`)
    cases: int = 1  # how many cases the verdict covers (an "every batch" target: one a batch)

    def cells(self, digits: int = 3) -> list[str]:
        if not self.measured_here:
            return [f"#{self.issue}", self.case, self.target, "-", "not measured", self.where, self.bundle, ""]
        v = f"{self.measured:.{digits}g}" if abs(self.measured) < 1e4 else f"{self.measured:.0f}"
        return [f"#{self.issue}", self.case, self.target, v, "yes" if self.met else "**no**", self.where,
                self.bundle, self.date]


def load_spec(path: str | Path | None = None) -> list[dict[str, Any]]:
    p = Path(path) if path is not None else SPEC
    if not p.is_file():
        raise TargetError(f"spec {p}: no such file (the target list is data/targets.json)")
    d = json.loads(p.read_text())
    entries = d["targets"] if isinstance(d, dict) else d
    for i, e in enumerate(entries):
        for k in ("issue", "case", "target", "bundle", "metric", "op", "value"):
            if k not in e:
                raise TargetError(f"{p}: entry {i} ({e.get('case', '?')!r}) lacks {k!r}")
        if e["metric"] not in METRICS:
            raise TargetError(f"{p}: entry {i} ({e['case']!r}): metric must be one of {METRICS}, got {e['metric']!r}")
        if e["op"] not in OPS:
            raise TargetError(f"{p}: entry {i} ({e['case']!r}): op must be one of {tuple(OPS)}, got {e['op']!r}")
    return entries


def _date(d: dict[str, Any]) -> str:
    """YYYY-MM-DD of a bundle (`created`) or a run record (`started`, seconds since the epoch)."""
    if d.get("created"):
        return str(d["created"])[:10]
    if d.get("started"):
        import datetime

        return datetime.datetime.fromtimestamp(float(d["started"]), datetime.timezone.utc).strftime("%Y-%m-%d")
    return ""


def _load(bundles: str | list[str], root: Path) -> tuple[list[dict[str, Any]], str]:
    """The rows of one or more bundles (a run record, `k3lab run`'s run.json, is one row named "run") and the date
    of the newest."""
    out, dates = [], []
    for i, b in enumerate([bundles] if isinstance(bundles, str) else bundles):
        p = root / b
        if not p.exists():
            raise TargetError(f"bundle {b} does not exist under {root}")
        d = read_json(p)
        run = (_date(d), i)  # which run a row came from (the peers of a case are compared within one run)
        out += [dict(r, _run=run) for r in d["rows"]] if "rows" in d else [dict(d, name="run", backend="run", _run=run)]
        dates.append(_date(d))
    return out, max(dates, default="")


def _get(row: dict[str, Any], key: str) -> Any:
    """A row's value by key: its own field, else its `extra`'s, else a dotted path."""
    if "." in key:
        cur: Any = row
        for part in key.split("."):
            cur = cur.get(part) if isinstance(cur, dict) else None
        return cur
    if key in row:
        return row[key]
    return (row.get("extra") or {}).get(key)


def _match(row: dict[str, Any], where: dict[str, Any]) -> bool:
    for k, want in where.items():
        if k == "name_prefix":
            if not str(row.get("name", "")).startswith(want):
                return False
            continue
        if k in ("min_bytes", "max_bytes", "max_batch", "min_batch"):
            v = row.get("bytes") if k.endswith("bytes") else _get(row, "batch")
            if v is None or (v < want if k.startswith("min") else v >= want if k == "max_bytes" else v > want):
                return False
            continue
        v = _get(row, k)
        if isinstance(want, list):
            if v not in want:
                return False
        elif v != want:
            return False
    return True


def _ok(row: dict[str, Any]) -> bool:
    err = row.get("error")
    return err is None or bool(err.get("ok", True))


def _case_key(row: dict[str, Any], group_by: list[str] | None) -> str:
    if group_by:
        return ",".join(f"{k}={_get(row, k)}" for k in group_by)
    x = row.get("extra") or {}
    return str(x.get("case") or row.get("name"))


def _best(rows: list[dict[str, Any]], require_ok: bool = True) -> dict[str, Any] | None:
    """The fastest row; ours must have passed the fp64 check, a peer's time counts either way (FlashInfer's KDA state
    misses our tolerance by design: its rows are timed and marked, docs/NOTES_kda.md)."""
    rows = [r for r in rows if _ok(r) or not require_ok]
    timed = [r for r in rows if r.get("median_us") is not None]
    if timed:
        return min(timed, key=lambda r: r["median_us"])
    return rows[0] if rows else None  # an untimed row (a run record) for the `field` metric


def _value(e: dict[str, Any], mine: dict[str, Any], case_rows: list[dict[str, Any]],
           all_rows: list[dict[str, Any]], root: Path) -> tuple[float, str]:
    v, tag = _value_of(e, mine, case_rows, all_rows, root)
    cp = e.get("context_peer")
    if cp is not None and e["metric"] in ("pct_read", "pct_copy", "x_floor", "over_floor"):
        cps = cp if isinstance(cp, list) else [cp]
        p = _best([r for r in case_rows if r["backend"] in cps], require_ok=False)
        pv = None if p is None else _value_of(e, p, case_rows, all_rows, root)[0]
        if pv is not None:
            tag += f"; {p['backend']} {pv:.3g}"
    return v, tag


def _value_of(e: dict[str, Any], mine: dict[str, Any], case_rows: list[dict[str, Any]],
              all_rows: list[dict[str, Any]], root: Path) -> tuple[float, str]:
    m = e["metric"]
    tag = f"{mine['backend']}"
    if m == "us":
        return mine["median_us"], tag
    if m in ("pct_read", "pct_copy"):
        want = "read" if m == "pct_read" else "copy"
        if mine.get("floor_bw") != want:
            raise TargetError(f"{e['case']!r}: the row's floor is over {mine.get('floor_bw')!r} bandwidth, "
                              f"not {want!r}")
        return mine["pct_of_bw"], tag
    if m == "x_floor":
        return mine["median_us"] / mine["floor_us"], tag
    if m == "over_floor":
        return mine["median_us"] - mine["floor_us"], tag
    if m in ("x_peer", "speedup"):
        peers = e["peer"] if isinstance(e["peer"], list) else [e["peer"]]
        p = _best([r for r in case_rows if r["backend"] in peers], require_ok=False)
        if p is None:
            raise TargetError(f"{e['case']!r}: no row of peer {peers} in case {_case_key(mine, e.get('group_by'))}")
        tag += f" vs {p['backend']} {p['median_us']:.2f}"
        return ((mine["median_us"] / p["median_us"]) if m == "x_peer" else (p["median_us"] / mine["median_us"])), tag
    if m == "ratio":
        rows = _load(e["over_bundle"], root)[0] if "over_bundle" in e else all_rows
        d = _best([r for r in rows if _match(r, e["over"]) and r["backend"] in e["ours"]])
        if d is None:
            raise TargetError(f"{e['case']!r}: `over` selects no row")
        return mine["median_us"] / d["median_us"], tag + f" over {d['median_us']:.2f}"
    if m == "field":
        v = _get(mine, e["field"])
        if v is None:
            raise TargetError(f"{e['case']!r}: the row has no {e['field']!r}")
        return float(v), tag
    raise TargetError(f"{e['case']!r}: metric {m!r} is not per case")


def _names(b: str | list[str]) -> list[str]:
    return ["|".join(Path(a).name for a in x.split("|")) for x in ([b] if isinstance(b, str) else b)]


def _pick(b: str | list[str], root: Path) -> str | list[str]:
    """Each "a|b" entry as the newest (its date, `_date`; then its place in the list) of its alternatives that
    exist under root (the first when none does). The newest is taken whole: a newer bundle covering fewer cases
    decides alone; entries that resolve to the same bundle read it once."""
    def one(x: str) -> str:
        alts = x.split("|")
        there = [a for a in alts if (root / a).exists()]
        if len(there) < 2:
            return there[0] if there else alts[0]
        return max(there, key=lambda a: (_date(read_json(root / a)), -alts.index(a)))
    # two entries resolving to one bundle (a newer run covering both older ones) read it once
    return one(b) if isinstance(b, str) else list(dict.fromkeys(one(x) for x in b))


def _there(profiles: str | Path, name: str, root: Path) -> str:
    """A bundle's path in the directory `profiles` by its name, plain or gzipped, whichever is there (a bench writes
    NAME.json, the committed H200 bundles are NAME.json.gz); the committed form when neither is."""
    p = Path(profiles) / name
    alt = p.with_suffix("") if name.endswith(".json.gz") else p.with_name(name + ".gz")
    return str(alt if not (root / p).exists() and name.endswith((".json", ".json.gz")) and (root / alt).exists()
               else p)


def on_profiles(e: dict[str, Any], profiles: str | Path, root: Path | None = None) -> dict[str, Any]:
    """The entry with its bundles (and `over_bundle`) taken from the directory `profiles` by name (NAME.json or
    NAME.json.gz)."""
    e2 = dict(e, _moved=True)  # (the table then names the bundles alone)
    for k in ("bundle", "over_bundle"):
        if k in e:
            base = Path(root) if root is not None else ROOT
            moved = ["|".join(_there(profiles, Path(a).name, base) for a in x.split("|"))
                     for x in ([e[k]] if isinstance(e[k], str) else e[k])]
            e2[k] = moved[0] if isinstance(e[k], str) else moved
    return e2


def evaluate(e: dict[str, Any], root: Path | None = None, profiles: str | Path | None = None) -> Result:
    """One entry -> its result: the worst case against the target, dated by its newest bundle. With `profiles` its
    bundles are read from that directory by name, and one that is not there, or one without the rows the target
    reads (another GPU's run of the same name without a peer, e.g. FlashInfer not carried), makes a not-measured
    result that says why; the committed H200 bundles (no `profiles`) are held to every row (TargetError)."""
    root = Path(root) if root is not None else ROOT
    e0 = e
    if profiles is not None:
        e = on_profiles(e, profiles, root)
    e = dict(e, **{k: _pick(e[k], root) for k in ("bundle", "over_bundle") if k in e})
    if profiles is not None:
        paths = [b for k in ("bundle", "over_bundle") if k in e for b in ([e[k]] if isinstance(e[k], str) else e[k])]
        missing = [Path(b).name for b in paths if not (root / b).exists()]
        if missing:
            return Result(e["issue"], e["case"], e["target"], math.nan, False, f"no {', '.join(missing)} there",
                          " + ".join(_names(e["bundle"])), measured_here=False)
    rows, date = _load(e["bundle"], root)
    try:
        r = _evaluate(e, root, rows)
    except TargetError as err:
        if profiles is None:
            raise
        why = str(err).split(": ", 1)[-1]
        return Result(e["issue"], e["case"], e["target"], math.nan, False,
                      f"not measurable there: {why[:140]}", " + ".join(_names(e["bundle"])), measured_here=False)
    r.date = date
    missed = [k for k in _not_run(e["bundle"], root) if _may_match(k, e.get("where", {}))]
    if missed:  # a bench stopped by its deadline: the cases it never ran cannot count as met
        r.met = False
        r.where += f"; {len(missed)} of its cases not run (bench deadline), e.g. {missed[0]}"
    if profiles is not None and r.cases < (full := _cases(e0, root)):
        # another GPU's bundle of the same name that covers fewer of the target's cases than the committed one
        r.met = False
        r.where += f"; only {r.cases} of the {full} cases the committed bundles hold"
    return r


def _cases(e: dict[str, Any], root: Path) -> int:
    """How many cases the committed bundles give a target (0 where they cannot be read: nothing to compare with)."""
    try:
        return evaluate(e, root).cases
    except TargetError:
        return 0


def _not_run(bundles: str | list[str], root: Path) -> list[str]:
    """The case keys (op[axis=value,...]) a bench's deadline left out of these bundles (its note)."""
    out: list[str] = []
    for b in [bundles] if isinstance(bundles, str) else bundles:
        d = read_json(root / b)
        for n in d.get("notes") or [] if isinstance(d.get("notes"), list) else []:
            if isinstance(n, str) and n.startswith("deadline reached; cases not run: "):
                try:
                    out += [str(k) for k in ast.literal_eval(n.split(": ", 1)[1])]
                except (ValueError, SyntaxError):
                    out.append(n)
    return out


def _may_match(key: str, where: dict[str, Any]) -> bool:
    """Whether a case that did not run (its key, k3lab.registry.Case.key) could be one a target reads: every `where`
    field its key states must match; what it cannot state (bytes, options) is taken as matching."""
    op, _, rest = key.partition("[")
    vals: dict[str, Any] = {"op": op}
    for item in rest.rstrip("]").split(","):
        k, eq, v = item.partition("=")
        if eq:
            vals[k] = {"True": True, "False": False, "None": None}.get(v, v)
            for cast in (int, float):
                try:
                    vals[k] = cast(v)
                    break
                except ValueError:
                    pass
    for k, want in where.items():
        if k in ("max_batch", "min_batch"):
            b = vals.get("batch")
            if isinstance(b, int) and (b > want if k == "max_batch" else b < want):
                return False
        elif k == "name_prefix":
            if not (key.startswith(want) or want.startswith(key.rstrip("]"))):
                return False
        elif k in vals and (vals[k] not in want if isinstance(want, list) else vals[k] != want):
            return False
    return True


def _evaluate(e: dict[str, Any], root: Path, rows: list[dict[str, Any]]) -> Result:
    sel = [r for r in rows if _match(r, e.get("where", {}))]
    bundle = " + ".join(_names(e["bundle"]) if e.get("_moved") else
                        [b.removeprefix("profiles/h200/") for b in ([e["bundle"]] if isinstance(e["bundle"], str)
                                                                     else e["bundle"])])
    cmp = OPS[e["op"]]
    m = e["metric"]
    if m == "x_floor_sum":
        picked = [next((r for r in sel if r["name"] == n and r["backend"] == e["ours"][0]), None) for n in e["names"]]
        if any(p is None for p in picked):
            raise TargetError(f"{e['case']!r}: rows {e['names']} not all in {bundle}")
        v = sum(p["median_us"] for p in picked) / sum(p["floor_us"] for p in picked)
        return Result(e["issue"], e["case"], e["target"], v, cmp(v, e["value"]), "+".join(e["names"]), bundle)
    if m == "auto_gap":
        groups: dict[str, list] = {}
        for r in sel:
            if r["backend"] in e["ours"] and _ok(r):
                groups.setdefault(_case_key(r, e["group_by"]), []).append(r)
        vals = []
        for k, g in groups.items():
            auto = [r for r in g if _match(r, e["auto"])]
            if not auto:
                raise TargetError(f"{e['case']!r}: group {k} has no row that `auto` selects")
            vals.append((auto[0]["median_us"] / min(r["median_us"] for r in g), k))
        return _worst(e, vals, bundle)
    groups = {}
    for r in sel:
        groups.setdefault(_case_key(r, e.get("group_by")), []).append(r)
    vals = []
    for k, g in groups.items():
        mine_rows = [r for r in g if r["backend"] in e["ours"]]
        if m == "field" and e.get("worst_row"):
            for r in mine_rows:
                if _ok(r) or e["field"].startswith("error"):
                    v = _get(r, e["field"])
                    if v is not None:
                        vals.append((float(v), f"{k} ({r['backend']})"))
            continue
        if m in ("x_peer", "speedup"):  # ours against the peer of the same run: the newest run that has both
            g = _same_run(e, g, k)
            if g is None:
                continue
            mine_rows = [r for r in g if r["backend"] in e["ours"]]
        mine = _best(mine_rows)
        if mine is None:
            continue
        v, tag = _value(e, mine, g, rows, root)
        vals.append((v, f"{k} ({tag})"))
    return _worst(e, vals, bundle)


def _same_run(e: dict[str, Any], g: list[dict[str, Any]], key: str) -> list[dict[str, Any]] | None:
    """The rows of one case from the newest run (bundle date, then its place in the list) that holds both a passing
    row of ours and a row of the peer; None when ours has no passing row at all; an error when ours and the peer were
    never timed in one run."""
    peers = e["peer"] if isinstance(e["peer"], list) else [e["peer"]]
    if not any(r["backend"] in e["ours"] and _ok(r) for r in g):
        return None
    if not any(r["backend"] in peers for r in g):
        raise TargetError(f"{e['case']!r}: no row of peer {peers} in case {key}")
    for run in sorted({r.get("_run") for r in g}, key=lambda x: x or ("", 0), reverse=True):
        rs = [r for r in g if r.get("_run") == run]
        if any(r["backend"] in e["ours"] and _ok(r) for r in rs) and any(r["backend"] in peers for r in rs):
            return rs
    raise TargetError(f"{e['case']!r}: no run times ours and peer {peers} together in case {key}")


def _worst(e: dict[str, Any], vals: list[tuple[float, str]], bundle: str) -> Result:
    if not vals:
        raise TargetError(f"{e['case']!r}: no row of {e['ours']} selected in {bundle} by {e.get('where')}")
    cmp = OPS[e["op"]]
    fails = [(v, k) for v, k in vals if not (math.isfinite(v) and cmp(v, e["value"]))]
    pool = fails or vals
    # the worst case: the farthest from the target in its direction (the largest for <=, the smallest for >=)
    v, k = max(pool, key=lambda t: t[0]) if e["op"] in ("<=", "<") else min(pool, key=lambda t: t[0])
    n = f" (worst of {len(vals)})" if len(vals) > 1 else ""
    return Result(e["issue"], e["case"], e["target"], v, not fails, _short(k) + n, bundle, cases=len(vals))


NOISE = {"dcp=1", "dcp_layout=interleave", "fp8_scale=tensor", "kv_dtype=bf16", "pad_heads=0", "page_size=64",
         "ragged=False", "heads=12", "D=128", "state_dtype=fp32"}  # axes every case of those sweeps shares


def _short(k: str) -> str:
    """A case name without the axes every case of a sweep shares (NOISE), each [..] group filtered."""
    out, rest = "", k
    while "[" in rest and "]" in rest.split("[", 1)[1]:
        head, tail = rest.split("[", 1)
        inner, rest = tail.split("]", 1)
        keep = [a for a in inner.split(",") if a and a not in NOISE]
        out += head + "[" + ",".join(keep) + "]"
    return out + rest


def evaluate_all(spec: list[dict[str, Any]] | None = None, root: Path | None = None,
                 issues: list[int] | None = None, profiles: str | Path | None = None) -> list[Result]:
    spec = spec if spec is not None else load_spec()
    if issues and (none := sorted(set(issues) - {e["issue"] for e in spec})):
        raise TargetError(f"issues {none} have no targets; issues with targets: {sorted({e['issue'] for e in spec})}")
    if profiles is not None and not (Path(root or ROOT) / profiles).is_dir():
        raise TargetError(f"profiles {profiles}: no such directory (a directory of bundles, e.g. profiles/<gpu>)")
    return [evaluate(e, root, profiles) for e in spec if not issues or e["issue"] in issues]


def _summary(results: list[Result], what: str = "") -> str:
    here = [r for r in results if r.measured_here]
    gone = len(results) - len(here)
    return f"{what}{sum(r.met for r in here)} of {len(here)} targets met" + (
        f" ({gone} not measured there)." if gone else ".")


def markdown(results: list[Result], where: str = "profiles/h200/",
             beside: list[tuple[str, list[Result]]] | None = None) -> str:
    """The table; `beside` [(name, results)]: the same targets read off another directory (another GPU's bundles),
    one column each: its measured value and whether it meets the target there (`-` where not measured)."""
    beside = beside or []
    for name, other in beside:
        if [(r.issue, r.case) for r in other] != [(r.issue, r.case) for r in results]:
            raise TargetError(f"beside {name!r}: not the same targets as the table")
    head = ["issue", "case", "target", "measured", "met", "worst case (rows)", f"bundle ({where})", "measured on"]
    head += [f"on {name}" for name, _ in beside]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for i, r in enumerate(results):
        cells = r.cells()
        for _, other in beside:
            o = other[i]
            cells.append("-" if not o.measured_here else o.cells()[3] + (" (met)" if o.met else " (**no**)"))
        lines.append("| " + " | ".join(c.replace("|", "/") for c in cells) + " |")
    tail = [_summary(results)] + [_summary(other, f"on {name}: ") for name, other in beside]
    return "\n".join(lines) + "\n\n" + "\n".join(tail) + "\n"


REMAKE_OUT = "profiles/runs/targets"


def _bundles_of(e: dict[str, Any], root: Path) -> list[str]:
    """The bundle paths an entry reads (its "a|b" alternatives resolved as evaluate does)."""
    out: list[str] = []
    for k in ("bundle", "over_bundle"):
        if k in e:
            b = _pick(e[k], root)
            out += [b] if isinstance(b, str) else b
    return out


def _arg(v: Any) -> str:
    """A grid value as `k3lab bench --grid` reads it back (k3lab.report.parse_value, split on commas)."""
    from k3lab.report import parse_value

    return v if isinstance(v, str) and "," not in v and '"' not in v and parse_value(v) == v else json.dumps(v)


def bench_command(d: dict[str, Any], name: str, out: str = REMAKE_OUT) -> str:
    """The `k3lab bench` command that remakes bundle `d` from its recorded config (component, ops, grid, backends,
    peers, skip, mode, reps; the op variants such as cute_pdl left out where the bundle has no row of one) as
    `out`/<gpu>/`name`.json on the machine it runs on, with the code as it stands."""
    import shlex

    from k3lab import registry

    c = d["config"]
    cmd = ["python", "-m", "k3lab.cli", "bench", c["bench"]]
    if c.get("ops"):
        cmd += ["--ops", ",".join(c["ops"])]
    ops = [o for o in registry.ops_of(c["bench"]) if not c.get("ops") or o.name in c["ops"]]
    gone = []
    for k, vs in (c.get("grid") or {}).items():
        # an option value no backend takes any more (a measured-and-lost form, removed since) is left out, and said
        allowed = {v for o in ops for per_be in o.option_axes.get(k, {}).values() for v in per_be}
        keep = [v for v in vs if not allowed or v in allowed]
        gone += [f"{k}={_arg(v)}" for v in vs if v not in keep]
        if keep:
            cmd += ["--grid", f"{k}={','.join(_arg(v) for v in keep)}"]
    cmd += ["--backends", ",".join(c["backends"])]
    if not c.get("peers", True):
        cmd.append("--no-peers")
    if c.get("skip"):
        cmd += ["--skip", ",".join(c["skip"])]
    var = {v for op in registry.ops_of(c["bench"]) for v in op.variants}
    if var and not var & {r.get("backend") for r in d.get("rows", [])}:
        cmd.append("--no-variants")
    if c.get("mode") == "hot":
        cmd.append("--hot")
    cmd += ["--reps", str(c.get("reps", 50)), "--name", name, "--out", out]
    line = " ".join(shlex.quote(x) for x in cmd)
    return line + (f"  # left out, no backend takes it now: {', '.join(gone)}" if gone else "")


def made_by(path: str | Path, root: Path | None = None) -> tuple[str, str] | None:
    """(the README, its "made by" cell) of the evidence table row that names a file: the README.md beside it or in a
    directory above it (up to the repository), whose row's first cell holds the file's path from there (or, for a
    README above the file's own directory, its name alone) in backticks."""
    root = Path(root) if root is not None else ROOT
    path = root / path
    for parent in path.parents:
        readme = parent / "README.md"
        if readme.exists():
            rel = path.relative_to(parent).as_posix()
            names = {f"`{rel}`", f"`{path.name}`"}
            for line in readme.read_text().splitlines():
                cells = line.split(" | ")
                if line.startswith("| ") and len(cells) >= 3 and any(n in cells[0] for n in names):
                    return readme.relative_to(root).as_posix(), cells[1].strip()
        if parent == root:
            break
    return None


# what a bundle's rows ran on beyond torch and Triton, and what brings it to the device (../shared/device)
_CARRY = (("cute", "CuTe DSL (.gpu/cute)"), ("flashinfer", "FlashInfer (.gpu/fi; fa3 also .gpu/fijit)"),
          ("fla", "fla (.gpu/base)"))


def _carry(d: dict[str, Any]) -> list[str]:
    """The packages a bundle's rows ran on beyond torch and Triton (from its backends_ran), with their archives."""
    ran = list((d.get("backends_ran") or {}).keys())
    return [what for key, what in _CARRY if any(r == key or r.startswith(key + "_") for r in ran)]


def remake_commands(entries: list[dict[str, Any]], root: Path | None = None, out: str = REMAKE_OUT,
                    gpu: str | None = None) -> str:
    """Shell lines that remake the bundles these targets read, under the same names, on the machine they run on (a
    `k3lab bench` command from each bundle's recorded config; for a bundle another command made, the README's
    "made by" line as a comment), then the `k3lab targets --profiles` line that reads them: the same targets on
    another GPU. `gpu`: the directory name bench writes into (k3lab.harness.env.gpu_slug; None: `<gpu>`)."""
    root = Path(root) if root is not None else ROOT
    reads: dict[str, list[str]] = {}
    for e in entries:
        for b in _bundles_of(e, root):
            reads.setdefault(b, []).append(f"#{e['issue']} {e['case']}")
    lines = [f"# remake the {len(reads)} bundles of {len(entries)} targets on this machine's GPU (code as it stands; "
             "peers that are not installed are skipped with the reason)"]
    for b, cases in reads.items():
        name = Path(b).name.removesuffix(".gz").removesuffix(".json")
        d = read_json(root / b) if (root / b).exists() else {}
        needs = _carry(d)
        lines.append(f"# {Path(b).name}: " + "; ".join(dict.fromkeys(cases))
                     + (f" (its rows need {', '.join(needs)})" if needs else ""))
        if "bench" in (d.get("config") or {}):
            lines.append(bench_command(d, name, out))
        else:
            how = made_by(b, root)
            lines.append(f"#   not a `k3lab bench` bundle: made by ({how[0]}) {how[1]}" if how else
                         "#   not a `k3lab bench` bundle, and no README row names it")
    lines.append(f"python -m k3lab.cli targets --profiles {out}/{gpu or '<gpu>'}")
    return "\n".join(lines) + "\n"


STATUS = ROOT / "docs" / "STATUS.md"
STATUS_HEAD = ("# Where the issues' targets stand\n\n"
               "Made by `k3lab targets --write docs/STATUS.md` from the committed bundles (`data/targets.json` lists "
               "the targets; a test fails when this page and the bundles disagree). Each line is the worst case of "
               "its target; the rows that decided it and the bundle are named. Figures and their context: "
               "docs/NOTES_*.md. The last column reads the same targets off an H100's committed bundles of the same "
               "names (`profiles/h100-80gb-hbm3/`; `-` where there is none: `k3lab targets --commands --failing "
               "--profiles h100-80gb-hbm3` prints how to make them).\n\n")


STATUS_BESIDE = ("h100-80gb-hbm3",)  # other GPUs' committed bundles, a column each on the page


def status_page(results: list[Result] | None = None) -> str:
    """docs/STATUS.md's text: the header and the whole table, with a column for each GPU of STATUS_BESIDE (its
    committed bundles of the same names under profiles/<gpu>/: `-` where it has none)."""
    spec = load_spec()
    beside = [(g, evaluate_all(spec, profiles=ROOT / "profiles" / g)) for g in STATUS_BESIDE
              if (ROOT / "profiles" / g).is_dir()]
    return STATUS_HEAD + markdown(results if results is not None else evaluate_all(spec), beside=beside)
