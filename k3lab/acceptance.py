"""Draft acceptance curves: what speculative decoding commits per verify cycle, for the draft-depth study.

The model. A verify cycle with D draft tokens runs the target model on D + 1 positions of each sequence.
Draft position i (1-based) is accepted with probability a_i given that positions 1..i-1 were; the first
rejection ends the cycle, and the target's own token at the first rejected (or the extra) position is
always committed. The expected tokens committed per cycle is

    committed(D) = 1 + sum_{i=1..D} prod_{j=1..i} a_j

A curve is the list of per-position acceptance probabilities a_1..a_7 (7 = the largest draft depth of
`k3lab.config.GpuView`). Two parametric forms are fitted here:
    "geometric"  a_j = p * r**(j - 1)  (acceptance decays with depth; r = 1 is a constant rate)
    "constant"   a_j = p
Curves live in `data/acceptance/<name>.json` with the form, its parameters, the probabilities, the targets
they were fitted to and the fit residual (largest |committed - target| over the targets).

Shipped curves (`write_defaults` regenerates them):
    agentx_fixed  geometric, fitted so that 3 drafts commit 3.00 tokens a cycle and 4 commit 3.36 (docs/MODEL.md
                  section 4, the AgentX fixed acceptance: 4 drafts pay only if the cycle grows < 12%)
    al6_at7       constant, acceptance length 6 at 7 drafts (committed(7) = 6, the 16 x GB300 figure)

The useful rate of a depth is committed(D) / cycle time: `committed_per_s`.
"""
from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

DATA = Path(__file__).resolve().parent.parent / "data" / "acceptance"
MAX_DEPTH = 7
FORMS = ("geometric", "constant")
MODEL = "committed(D) = 1 + sum_{i=1..D} prod_{j=1..i} a_j"


class AcceptanceError(ValueError):
    """A curve file or argument that is not a valid acceptance curve (named)."""


@dataclass
class Curve:
    name: str
    form: str
    params: dict[str, float]
    probs: list[float]
    targets: list[dict[str, float]] = field(default_factory=list)  # [{"drafts": D, "committed": c}]
    residual: float = 0.0
    note: str = ""

    def __post_init__(self) -> None:
        if self.form not in FORMS:
            raise AcceptanceError(f"curve {self.name!r}: form must be one of {FORMS}, got {self.form!r}")
        if not self.probs or any(not 0.0 <= float(a) <= 1.0 for a in self.probs):
            raise AcceptanceError(f"curve {self.name!r}: probs must be probabilities in [0, 1], got {self.probs}")

    def committed(self, depth: int) -> float:
        return expected_committed(self.probs, depth)

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["model"] = MODEL
        d["fitted"] = [{"drafts": t["drafts"], "committed": self.committed(int(t["drafts"]))} for t in self.targets]
        return d


def expected_committed(probs: Sequence[float], depth: int) -> float:
    """1 + sum over the first `depth` positions of the running product of acceptance probabilities."""
    if not isinstance(depth, int) or isinstance(depth, bool) or depth < 0:
        raise AcceptanceError(f"'depth' must be an int >= 0, got {depth!r}")
    if depth > len(probs):
        raise AcceptanceError(f"'depth' {depth} exceeds the curve's {len(probs)} positions")
    tot, run = 1.0, 1.0
    for a in probs[:depth]:
        run *= float(a)
        tot += run
    return tot


def probs_of(form: str, params: dict[str, float], n: int = MAX_DEPTH) -> list[float]:
    if form == "geometric":
        return [min(1.0, params["p"] * params["r"] ** j) for j in range(n)]
    if form == "constant":
        return [params["p"]] * n
    raise AcceptanceError(f"form must be one of {FORMS}, got {form!r}")


def _bisect(f, lo: float, hi: float, iters: int = 200) -> float:
    flo = f(lo)
    for _ in range(iters):
        mid = 0.5 * (lo + hi)
        fm = f(mid)
        if (fm > 0) == (flo > 0):
            lo, flo = mid, fm
        else:
            hi = mid
    return 0.5 * (lo + hi)


def fit_constant(depth: int, committed: float, name: str = "constant") -> Curve:
    """a_j = p with committed(depth) = `committed` (1 <= committed <= depth + 1)."""
    if not 1.0 <= committed <= depth + 1:
        raise AcceptanceError(f"'committed' must be in [1, {depth + 1}] at depth {depth}, got {committed}")
    p = _bisect(lambda p: expected_committed([p] * depth, depth) - committed, 0.0, 1.0)
    tg = [{"drafts": depth, "committed": committed}]
    c = Curve(name, "constant", {"p": p}, probs_of("constant", {"p": p}), tg)
    c.residual = max(abs(c.committed(depth) - committed) for _ in tg)
    return c


def fit_geometric(t1: tuple[int, float], t2: tuple[int, float], name: str = "geometric") -> Curve:
    """a_j = p r^(j-1) through two targets (drafts, committed) with drafts t1 < t2: for each r the first
    target fixes p (committed is increasing in p), and r is found where the second target is met."""
    (d1, c1), (d2, c2) = t1, t2
    if not (isinstance(d1, int) and isinstance(d2, int) and 0 < d1 < d2 <= MAX_DEPTH):
        raise AcceptanceError(f"targets need 0 < drafts1 < drafts2 <= {MAX_DEPTH}, got {d1}, {d2}")
    if not 1.0 <= c1 <= c2:
        raise AcceptanceError(f"targets need 1 <= committed1 <= committed2, got {c1}, {c2}")

    def p_for(r: float) -> float:
        return _bisect(lambda p: expected_committed(probs_of("geometric", {"p": p, "r": r}), d1) - c1, 0.0, 1.0)

    def miss(r: float) -> float:
        return expected_committed(probs_of("geometric", {"p": p_for(r), "r": r}), d2) - c2

    r = _bisect(miss, 1e-6, 1.0, iters=100)
    params = {"p": p_for(r), "r": r}
    tg = [{"drafts": d1, "committed": c1}, {"drafts": d2, "committed": c2}]
    c = Curve(name, "geometric", params, probs_of("geometric", params), tg)
    c.residual = max(abs(c.committed(t["drafts"]) - t["committed"]) for t in tg)
    return c


def default_curves() -> list[Curve]:
    a = fit_geometric((3, 3.00), (4, 3.36), name="agentx_fixed")
    a.note = ("docs/MODEL.md, Switches: 3 drafts commit 3.00 tokens a cycle and 4 commit 3.36 under the AgentX fixed "
              "acceptance")
    b = fit_constant(7, 6.0, name="al6_at7")
    b.note = "docs/MODEL.md, Switches: acceptance length 6 (tokens committed a cycle) at 7 drafts"
    return [a, b]


def write_defaults(root: str | Path = DATA) -> list[Path]:
    """Fit the shipped curves and write them to `root/<name>.json`."""
    root = Path(root)
    root.mkdir(parents=True, exist_ok=True)
    out = []
    for c in default_curves():
        p = root / f"{c.name}.json"
        p.write_text(json.dumps(c.to_dict(), indent=1) + "\n")
        out.append(p)
    return out


def available(root: str | Path = DATA) -> list[str]:
    return sorted(p.stem for p in Path(root).glob("*.json"))


def load(name: str | Path, root: str | Path = DATA) -> Curve:
    """A curve by name (data/acceptance/<name>.json) or path."""
    p = Path(name)
    if not p.suffix:
        p = Path(root) / f"{name}.json"
    if not p.exists():
        raise AcceptanceError(f"acceptance curve {str(name)!r} not found; available: {available(root)}")
    d = json.loads(p.read_text())
    try:
        return Curve(d["name"], d["form"], dict(d["params"]), [float(a) for a in d["probs"]],
                     list(d.get("targets", [])), float(d.get("residual", 0.0)), d.get("note", ""))
    except KeyError as e:
        raise AcceptanceError(f"{p}: missing field {e}") from None


def accepted_distribution(probs: Sequence[float], depth: int) -> list[float]:
    """P(a cycle commits n tokens), n = 1 .. depth + 1: the first n - 1 drafts accepted and the next rejected (all
    accepted: n = depth + 1). Its mean is `expected_committed`."""
    expected_committed(probs, depth)  # validates depth
    out, run = [], 1.0
    for i in range(depth):
        a = float(probs[i])
        out.append(run * (1.0 - a))
        run *= a
    return out + [run]


def accepted_counts(curve: Curve, depth: int, batch: int) -> list[int]:
    """A batch's committed counts drawn deterministically from the curve (sequence b takes the (b + 1/2) / batch
    quantile of `accepted_distribution`): what the commit of one verify cycle is timed with."""
    if not isinstance(batch, int) or isinstance(batch, bool) or batch < 1:
        raise AcceptanceError(f"'batch' must be an int >= 1, got {batch!r}")
    dist = accepted_distribution(curve.probs, depth)
    cdf, acc = [], 0.0
    for p in dist:
        acc += p
        cdf.append(acc)
    out = []
    for b in range(batch):
        u = (b + 0.5) / batch
        out.append(next((n + 1 for n, c in enumerate(cdf) if c >= u), depth + 1))
    return out


def committed_per_s(curve: Curve, depth: int, batch: int, cycle_us: float) -> float:
    """Committed tokens a second of `batch` sequences whose verify cycle at `depth` drafts takes `cycle_us`."""
    if cycle_us <= 0:
        raise AcceptanceError(f"'cycle_us' must be > 0, got {cycle_us}")
    return batch * curve.committed(depth) / (cycle_us * 1e-6)


if __name__ == "__main__":
    for path in write_defaults():
        print(path)
