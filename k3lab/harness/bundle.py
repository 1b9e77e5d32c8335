"""Versioned results bundles: one JSON per run of a notebook, comparable across commits and GPUs.

    {schema_version, name, created, env, config: {view, model}, switches, backends_ran,
     backends_skipped, copy_tbps, read_tbps, launch_floor_us, rows: [Row...], notes}

Each row records its timing mode ("rotated" past L2 or "hot") and which bandwidth its floor used
(`floor_bw`: "read" for ops that mostly read, "copy" for ops that read and write the same bytes).

A Row is one component on one backend. `save(dir)` writes `dir/<gpu-slug>/<name>.json`; `load(path)`
reads and validates. A bundle may be stored gzipped (`<name>.json.gz`, as the large committed ones under
profiles/ are, to keep the repository small): `read_json` / `load` / `find_bundles` read either form.
`compare(a, b)` matches rows on (name, backend) and reports b/a median ratios; rows of different timing
kinds (cpu-smoke vs gpu-graph) are never compared.
"""
from __future__ import annotations

import datetime as _dt
import gzip
import json
import math
import re
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

SCHEMA_VERSION = 1


class BundleError(ValueError):
    """A bundle file that is not a valid k3lab results bundle."""


@dataclass
class Row:
    name: str
    backend: str
    kind: str  # timing kind: gpu-graph | gpu-eager | cpu-smoke
    median_us: float
    p10_us: float
    p90_us: float
    samples_us: list[float] = field(default_factory=list)
    floor_us: float | None = None
    bytes: int | None = None
    flops: int | None = None
    achieved_tbps: float | None = None
    pct_of_bw: float | None = None  # achieved / the floor's bandwidth (floor_bw), in %
    floor_bw: str | None = None  # "read" | "copy": the bandwidth the floor used
    mode: str | None = None  # timing mode: "rotated" (inputs past L2) | "hot"
    launches: float | None = None
    kernels: list[dict[str, Any]] = field(default_factory=list)
    error: dict[str, Any] | None = None  # numerics.ErrorStats.to_dict() vs fp64
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def distance(self) -> float | None:
        return self.median_us / self.floor_us if self.floor_us else None

    @classmethod
    def from_timing(cls, name: str, backend: str, timing: Any, *, floor: Any = None, flops: int | None = None,
                    kernels: list | None = None, error: Any = None, **extra: Any) -> Row:
        """Build a row from a timing.Timing, a roofline.Floor and a numerics.ErrorStats."""
        from k3lab.harness.roofline import assess

        r = cls(name=name, backend=backend, kind=timing.kind, median_us=timing.median_us,
                p10_us=timing.p10_us, p90_us=timing.p90_us, samples_us=list(timing.samples_us),
                kernels=list(kernels or []), extra=dict(extra), mode=getattr(timing, "mode", None))
        r.extra.setdefault("calls_per_sample", timing.calls_per_sample)
        r.extra.setdefault("input_sets", timing.input_sets)
        if timing.note:
            r.extra.setdefault("timing_note", timing.note)
        if floor is not None:
            a = assess(timing.median_us, floor)
            r.floor_us, r.bytes, r.flops = a["floor_us"], floor.bytes, floor.flops
            r.achieved_tbps, r.pct_of_bw, r.floor_bw = a["achieved_tbps"], a["pct_of_bw"], a["floor_bw"]
            r.extra.setdefault("bound", a["bound"])
        elif flops is not None:
            r.flops = flops
        if kernels and kernels[0].get("device") == "cuda":
            r.launches = round(sum(k["count"] for k in kernels), 3)
        if error is not None:
            r.error = error.to_dict() if hasattr(error, "to_dict") else dict(error)
        return r


ROW_REQUIRED = {"name": str, "backend": str, "kind": str, "median_us": (int, float),
                "p10_us": (int, float), "p90_us": (int, float)}
TOP_REQUIRED = {"schema_version": int, "name": str, "env": dict, "config": dict, "switches": dict,
                "backends_ran": dict, "rows": list}


@dataclass
class Bundle:
    name: str
    env: dict[str, Any]
    config: dict[str, Any]
    switches: dict[str, Any]
    backends_ran: dict[str, str] = field(default_factory=dict)  # backend -> what ran
    backends_skipped: dict[str, str] = field(default_factory=dict)  # backend -> why not
    rows: list[Row] = field(default_factory=list)
    copy_tbps: float | None = None
    read_tbps: float | None = None
    launch_floor_us: float | None = None
    notes: list[str] = field(default_factory=list)
    created: str = field(default_factory=lambda: _dt.datetime.now(_dt.UTC).isoformat(timespec="seconds"))
    schema_version: int = SCHEMA_VERSION

    @classmethod
    def new(cls, name: str, *, view: Any = None, switches: Any = None, env: dict | None = None, **kw: Any) -> Bundle:
        """Start a bundle for a run: the environment fingerprint, GpuView + K3Config and Switches."""
        from k3lab.harness.env import fingerprint

        config: dict[str, Any] = {}
        if view is not None:
            config = {"view": view.to_dict(), "model": view.cfg.to_dict()}
        sw = switches.to_dict() if hasattr(switches, "to_dict") else dict(switches or {})
        return cls(name=name, env=env if env is not None else fingerprint(), config=config, switches=sw, **kw)

    @property
    def gpu_slug(self) -> str:
        return self.env.get("gpu_slug") or "cpu"

    def add(self, row: Row) -> Row:
        self.rows.append(row)
        return row

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        return _jsonable(d)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Bundle:
        validate(d)
        kw = {k: v for k, v in d.items() if k in cls.__dataclass_fields__ and k != "rows"}
        rows = []
        for r in d["rows"]:
            known = {k: v for k, v in r.items() if k in Row.__dataclass_fields__}
            if "pct_of_copy" in r and "pct_of_bw" not in r:  # bundles before the read probe: copy floors
                known.update(pct_of_bw=r["pct_of_copy"], floor_bw="copy")
            rows.append(Row(**known))
        return cls(rows=rows, **kw)

    def save(self, root: str | Path) -> Path:
        """Write `root/<gpu-slug>/<name>.json`; returns the path."""
        path = Path(root) / self.gpu_slug / f"{safe_name(self.name)}.json"
        return self.save_as(path)

    def save_as(self, path: str | Path) -> Path:
        """Write the bundle to `path` (gzipped when it ends in .gz)."""
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        d = self.to_dict()
        validate(d)
        text = json.dumps(d, indent=1, sort_keys=False, allow_nan=False) + "\n"
        if path.suffix == ".gz":
            path.write_bytes(gzip.compress(text.encode(), mtime=0))
        else:
            path.write_text(text)
        return path

    def table(self):
        """The rows as a pandas DataFrame (samples and kernels left out)."""
        import pandas as pd

        recs = []
        for r in self.rows:
            rec = {k: v for k, v in asdict(r).items() if k not in ("samples_us", "kernels", "extra", "error")}
            rec["distance"] = r.distance
            rec["rel_err"] = (r.error or {}).get("rel_norm")
            rec["max_abs_err"] = (r.error or {}).get("max_abs")
            rec["err_ok"] = (r.error or {}).get("ok")
            recs.append(rec)
        return pd.DataFrame(recs)


def safe_name(name: str) -> str:
    s = re.sub(r"[^A-Za-z0-9._-]+", "-", name).strip("-")
    if not s:
        raise BundleError(f"bundle name {name!r} has no usable characters")
    return s


def _jsonable(x: Any) -> Any:
    if isinstance(x, dict):
        return {str(k): _jsonable(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_jsonable(v) for v in x]
    if isinstance(x, float):
        if math.isnan(x):
            return None
        if math.isinf(x):
            return "inf" if x > 0 else "-inf"
        return x
    if isinstance(x, (str, int, bool)) or x is None:
        return x
    if hasattr(x, "item"):  # numpy / torch scalars
        return _jsonable(x.item())
    return str(x)


def validate(d: Any) -> None:
    """Raise BundleError naming the first problem; None when `d` is a valid bundle dict."""
    if not isinstance(d, dict):
        raise BundleError(f"a bundle is a JSON object, got {type(d).__name__}")
    for k, t in TOP_REQUIRED.items():
        if k not in d:
            raise BundleError(f"bundle is missing {k!r}")
        if not isinstance(d[k], t):
            raise BundleError(f"bundle field {k!r} must be {t}, got {type(d[k]).__name__}")
    if d["schema_version"] > SCHEMA_VERSION:
        raise BundleError(f"bundle schema_version {d['schema_version']} is newer than this k3lab ({SCHEMA_VERSION})")
    from k3lab.harness.timing import KINDS

    for i, r in enumerate(d["rows"]):
        if not isinstance(r, dict):
            raise BundleError(f"row {i} is not an object")
        for k, t in ROW_REQUIRED.items():
            if k not in r:
                raise BundleError(f"row {i} ({r.get('name')}) is missing {k!r}")
            if not isinstance(r[k], t) or isinstance(r[k], bool):
                raise BundleError(f"row {i} ({r.get('name')}) field {k!r} must be {t}, got {r[k]!r}")
        if r["kind"] not in KINDS:
            raise BundleError(f"row {i} ({r['name']}) has timing kind {r['kind']!r}; allowed {KINDS}")
        if not r["median_us"] >= 0:
            raise BundleError(f"row {i} ({r['name']}) has median_us {r['median_us']!r}")
    keys = [(r["name"], r["backend"]) for r in d["rows"]]
    dup = {k for k in keys if keys.count(k) > 1}
    if dup:
        raise BundleError(f"duplicate rows (name, backend): {sorted(dup)}")


BUNDLE_GLOBS = ("*.json", "*.json.gz")


def read_json(path: str | Path) -> Any:
    """The JSON document in `path`, plain or gzipped (by its first two bytes)."""
    raw = Path(path).read_bytes()
    if raw[:2] == b"\x1f\x8b":
        raw = gzip.decompress(raw)
    return json.loads(raw.decode())


def load(path: str | Path) -> Bundle:
    """Read a bundle JSON (plain or .json.gz), or the one bundle inside a run directory."""
    p = Path(path)
    if p.is_dir():
        found = find_bundles(p)
        if len(found) != 1:
            raise BundleError(f"{p} holds {len(found)} bundles ({[str(f) for f in found]}); name one")
        p = found[0]
    if not p.exists():
        gz = p.with_name(p.name + ".gz")
        hint = f" (a gzipped bundle {gz.name} is there: pass that path)" if gz.exists() else ""
        raise BundleError(f"{p} does not exist{hint}")
    try:
        d = read_json(p)
    except (ValueError, OSError, EOFError) as e:
        raise BundleError(f"{p} is not JSON (plain or gzipped): {e}") from None
    try:
        return Bundle.from_dict(d)
    except BundleError as e:
        raise BundleError(f"{p}: {e}") from None


def stem_path(p: str | Path) -> Path:
    """`p` without its bundle suffix (.json or .json.gz): where its report (`.html`) goes beside it."""
    p = Path(p)
    name = p.name
    for suf in (".json.gz", ".json"):
        if name.endswith(suf):
            return p.with_name(name[: -len(suf)])
    return p.with_suffix("")


def is_bundle_file(p: str | Path) -> bool:
    """Whether `p` is a results bundle (plain or gzipped JSON with schema_version and rows)."""
    try:
        d = read_json(p)
    except (OSError, ValueError, EOFError):
        return False
    return isinstance(d, dict) and "schema_version" in d and "rows" in d


def find_bundles(root: str | Path) -> list[Path]:
    """Bundle files (.json or .json.gz) under `root` (any depth), skipping run metadata and notebooks."""
    paths = sorted({p for g in BUNDLE_GLOBS for p in Path(root).rglob(g)})
    return [p for p in paths if is_bundle_file(p)]


@dataclass
class Comparison:
    threshold: float
    rows: list[dict[str, Any]]
    only_a: list[tuple[str, str]]
    only_b: list[tuple[str, str]]

    @property
    def regressions(self) -> list[dict[str, Any]]:
        return [r for r in self.rows if r["regression"]]

    @property
    def has_regressions(self) -> bool:
        return bool(self.regressions)

    def table(self):
        import pandas as pd

        return pd.DataFrame(self.rows)


def compare(a: Bundle, b: Bundle, threshold: float = 0.05) -> Comparison:
    """Ratio b/a of median time per (name, backend) present in both. A row regresses when
    b is slower by more than `threshold` (ratio > 1 + threshold) or when its error check went from
    ok to failing. Rows whose timing kinds or modes (rotated / hot) differ are listed with ratio None and never
    regress; cpu-smoke rows show their ratio and never regress on time (wall clock on a shared CPU says
    nothing about a kernel), only on a failing error check."""
    if threshold < 0:
        raise ValueError("threshold must be >= 0")
    ia = {(r.name, r.backend): r for r in a.rows}
    ib = {(r.name, r.backend): r for r in b.rows}
    rows = []
    for key in [k for k in ia if k in ib]:
        ra, rb = ia[key], ib[key]
        rec: dict[str, Any] = {"name": key[0], "backend": key[1], "kind": ra.kind, "a_us": ra.median_us,
                               "b_us": rb.median_us, "ratio": None, "regression": False, "why": ""}
        if ra.kind != rb.kind:
            rec["kind"] = f"{ra.kind} vs {rb.kind}"
            rec["why"] = "timing kinds differ: not compared"
        elif ra.mode and rb.mode and ra.mode != rb.mode:
            rec["why"] = f"timing modes differ ({ra.mode} vs {rb.mode}): not compared"
        else:
            ratio = rb.median_us / ra.median_us if ra.median_us > 0 else float("inf")
            rec["ratio"] = ratio
            if ra.kind == "cpu-smoke":
                rec["why"] = "cpu-smoke: shown, never gated"
            elif ratio > 1.0 + threshold:
                rec["regression"], rec["why"] = True, f"slower by {100 * (ratio - 1):.1f}%"
        ea, eb = (ra.error or {}).get("ok"), (rb.error or {}).get("ok")
        if ea is True and eb is False:
            rec["regression"] = True
            rec["why"] = (rec["why"] + "; " if rec["why"] else "") + "error check now fails"
        rows.append(rec)
    return Comparison(threshold, rows, [k for k in ia if k not in ib], [k for k in ib if k not in ia])
