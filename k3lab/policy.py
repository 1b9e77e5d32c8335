"""The `auto` policy: which backend and options run an op, from measurement.

`data/<component>_defaults.json` holds, per op (its registry `policy_key`, e.g. "decode"), rules measured
by `k3lab bench` and written by `k3lab defaults COMPONENT BUNDLE...`:

    {"decode": [{"max_batch": 1, "backend": "cute", "tile_v": 16}, ..., {"max_batch": null, ...}],
     "fallback": {"decode": [... rules for when the first choice cannot run here ...]}}

The first rule with batch <= max_batch, T <= max_T and batch x T <= max_rows matches (null or absent: any; max_rows
bounds the query rows (b, t) a call carries, which is what the MLA combine's kernels see); a rule with `fmt` (a list)
matches only calls whose shape names one of those weight formats (the formats it was measured on: the MoE experts'
CuTe rules are MXFP4's), a rule with `min_n` / `max_n` only calls of at least / at most that many output rows
(shape["n"]) and one with `min_k` / `max_k` only calls of that reduction length (shape["k"]: a projection's input
width, the MLA combine's partials): the trunk's rules at batch 1 and 2, which name the projections they were measured
on, and the MLA combine's by the partials it merges. A rule that filters on a fact does not match a query
that does not state it: a question without the call's shape (the decode step's choice of one backend for a whole
component group) gets the rules that hold whatever the shape, never one measured on some shapes only. Every key of a
rule besides max_batch, max_T, max_rows, fmt, min_n, max_n, min_k, max_k and backend is an option of the op (tile_v,
...).
`choose` takes the first matching rule when its backend can run the call here, else the first matching fallback rule
whose backend can; without a GPU it is the reference.
"""
from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

DATA = Path(__file__).resolve().parent.parent / "data"
RULE_KEYS = ("max_batch", "max_T", "max_rows", "fmt", "min_n", "max_n", "min_k", "max_k", "backend")
_tables: dict[str, dict] = {}


def path(component: str) -> Path:
    return DATA / f"{component}_defaults.json"


def table(component: str) -> dict:
    """data/<component>_defaults.json, read once ({} when the component has none yet)."""
    if component not in _tables:
        p = path(component)
        _tables[component] = json.loads(p.read_text()) if p.exists() else {}
    return _tables[component]


def matches(rule: dict, B: int, T: int = 1, shape: dict | None = None) -> bool:
    """Batch, T and batch x T within the rule's bounds, the call's weight format (shape["fmt"]) one of the rule's
    `fmt` when it names any, its output rows (shape["n"]) within the rule's `min_n` / `max_n` and its reduction length
    (shape["k"]) within `min_k` / `max_k`. A fact the rule filters on and the shape does not state fails the rule
    (the module doc)."""
    shape = shape or {}
    fmt, n, k = shape.get("fmt"), shape.get("n"), shape.get("k")

    def within(v, lo, hi) -> bool:
        if rule.get(lo) is None and rule.get(hi) is None:
            return True
        return v is not None and (rule.get(lo) is None or v >= rule[lo]) and (rule.get(hi) is None or v <= rule[hi])
    return ((rule.get("max_batch") is None or B <= rule["max_batch"])
            and (rule.get("max_T") is None or T <= rule["max_T"])
            and (rule.get("max_rows") is None or B * T <= rule["max_rows"])
            and (rule.get("fmt") is None or (fmt is not None and fmt in rule["fmt"]))
            and within(n, "min_n", "max_n") and within(k, "min_k", "max_k"))


def options_of(rule: dict) -> dict[str, Any]:
    return {k: v for k, v in rule.items() if k not in RULE_KEYS}


def rule(component: str, key: str, B: int, T: int = 1, shape: dict | None = None) -> dict | None:
    """The first primary rule of `key` matching (B, T) (and `shape`'s format, rows and width), whatever its backend
    can do here."""
    return next((r for r in table(component).get(key, []) if matches(r, B, T, shape)), None)


def choose(component: str, key: str, B: int, T: int, can_run: Callable[[str], bool],
           shape: dict | None = None) -> tuple[str, dict, str]:
    """(backend, options, why) that `auto` runs. `can_run(backend)` says whether a backend runs here; `shape` the
    call's facts a rule may filter on (its weight format, output rows, reduction length)."""
    t = table(component)
    r = next((r for r in t.get(key, []) if matches(r, B, T, shape)), None)  # the measured choice: the first match
    if r is not None and can_run(r["backend"]):
        return r["backend"], options_of(r), f"measured rule of data/{component}_defaults.json: {r}"
    for r in t.get("fallback", {}).get(key, []):  # else the first fallback rule that matches and can run
        if matches(r, B, T, shape) and can_run(r["backend"]):
            return r["backend"], options_of(r), f"fallback rule of data/{component}_defaults.json: {r}"
    return "reference", {}, "no measured rule can run here: the torch reference"


def default_rules(rows: list[dict], impl: str, *, key_of: Callable[[dict], str | None], heads: int | None = None,
                  option: str = "tile_v") -> dict[str, list[dict]]:
    """Rules for `impl` from bench bundle rows (their JSON form): per op and per measured batch and T, the
    fastest `option` value whose fp64 check passed (at `heads` heads when given). `key_of(row)` names the
    policy key of a row (None: the row is not ruled). A rule matches the first (B, T) with
    B <= max_batch and T <= max_T, so an unmeasured batch or T takes the next measured one above it and
    anything beyond the sweep takes its largest. A later bundle's rows replace an earlier one's: a row's `_bundle`
    (its bundle's place in the list, 0 when absent) names its run, and a (op, batch, T) case is ruled from the latest
    run that measured it alone, so options timed in different runs are never compared."""
    best: dict[tuple, dict] = {}
    latest: dict[tuple, int] = {}
    kept: list[tuple[tuple, dict]] = []
    for r in rows:
        x = r.get("extra") or {}
        if r.get("backend") != impl or not (r.get("error") or {}).get("ok"):
            continue
        if heads is not None and x.get("heads") != heads:
            continue
        key = key_of(r)
        if key is not None:
            case = (key, x["batch"], x.get("T", 1))
            latest[case] = max(latest.get(case, 0), int(r.get("_bundle", 0)))
            kept.append((case, r))
    for case, r in kept:
        if int(r.get("_bundle", 0)) == latest[case]:
            best[(*case, (r.get("extra") or {})[option])] = r
    out: dict[str, list[dict]] = {}
    for key in sorted({k for (k, _, _, _) in best}):
        cells: dict[int, dict[int, tuple]] = {}
        for (k, B, T, ov), r in best.items():
            if k == key:
                cur = cells.setdefault(B, {}).get(T)
                if cur is None or r["median_us"] < cur[1]:
                    cells[B][T] = (ov, r["median_us"])
        groups: list[list] = []  # per batch: ((max_T, value), ...) with equal consecutive values merged
        for B in sorted(cells):
            g: list[list] = []
            for T in sorted(cells[B]):
                ov = cells[B][T][0]
                if g and g[-1][1] == ov:
                    g[-1][0] = T
                else:
                    g.append([T, ov])
            g[-1][0] = None  # the largest measured T also covers any T above it
            if groups and groups[-1][1] == [tuple(x) for x in g]:
                groups[-1][0] = B
            else:
                groups.append([B, [tuple(x) for x in g]])
        if groups:
            groups[-1][0] = None
        rules = []
        for B, g in groups:
            for max_T, ov in g:
                r = {"max_batch": B}
                if len(g) > 1:
                    r["max_T"] = max_T
                r.update({"backend": impl, option: ov})
                rules.append(r)
        out[key] = rules
    return out


def winners(rows: list[dict], impls: tuple[str, ...], group: tuple[str, ...] = ("heads", "batch", "T")) -> dict:
    """Per case group: the fastest of `impls` whose check passed (rows in bundle JSON form)."""
    best: dict[str, dict] = {}
    for r in rows:
        x = r.get("extra") or {}
        if r.get("backend") not in impls or not (r.get("error") or {}).get("ok"):
            continue
        k = "_".join(f"{g}{x.get(g)}" for g in group)
        if k not in best or r["median_us"] < best[k]["median_us"]:
            best[k] = dict(backend=r["backend"], options=x.get("options", {}), median_us=r["median_us"])
    return best
