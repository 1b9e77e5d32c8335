"""Routing traces: which experts each token chose in each MoE layer, and with what weights.

Format (`Trace`, saved as a small compressed .npz):
    ids      int16   [S, T, L, K]   expert ids of sequence s, token t (in decode order), MoE layer l, slot k
    weights  float16 [S, T, L, K]   the renormalized routing weights (sum over K = routed scaling)
    meta     a JSON string: n_experts, top_k, source (how it was made), and free-form notes
S sequences of T tokens each; L MoE layers (a subset of a model's layers, in order); K = top-k.

Statistics (`stats`):
    skew          the share of all selections taken by the most-chosen 10% of experts (0.1 = uniform), and
                  max load / mean load, per layer, averaged
    reuse         next-token reuse: |S(t) & S(t+1)| / K for consecutive tokens of one sequence in one layer,
                  averaged (uniform random routing: K / E = 1.8% at K3's 16 of 896)
    distinct(B)   experts touched by a batch of B tokens (`batch_ids`), averaged over the trace

A batch of B decode tokens is B different sequences at one step. A trace of one sequence stands in for
them with B tokens spaced T/B apart (`batch_ids`), so their choices are as unrelated as the trace's
far-apart tokens.

Recorder: `record(stack, tokens, n_steps)` runs the reference model (k3lab.ref.stack.Stack) greedily and
writes every MoE layer's (ids, weights) per token (the router k3lab.ref.router.route, as the model runs it).
Synthetic traces: `synthetic(n_experts, top_k, tokens, layers, zipf=..., reuse=...)`: expert popularity
Zipf-distributed (a random permutation per layer), each token keeping a Binomial(K, reuse) share of the
previous token's experts; `data/routing/` holds the ones the bench uses (docs/NOTES_moe.md states theirs).
"""
from __future__ import annotations

import json
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

DATA = Path(__file__).resolve().parent.parent / "data" / "routing"
MAX_TRACE_BYTES = 100_000


class TraceError(ValueError):
    """A trace file or argument that does not fit the trace format."""


@dataclass
class Trace:
    ids: np.ndarray  # int16 [S, T, L, K]
    weights: np.ndarray  # float16 [S, T, L, K]
    n_experts: int
    meta: dict = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.ids.ndim != 4 or self.ids.shape != self.weights.shape:
            raise TraceError(f"trace ids and weights must both be [S, T, L, K], got {self.ids.shape} and "
                             f"{self.weights.shape}")
        if self.ids.size and (self.ids.min() < 0 or self.ids.max() >= self.n_experts):
            raise TraceError(f"trace ids must lie in 0..{self.n_experts - 1}")
        srt = np.sort(self.ids, axis=-1)
        if self.ids.size and (srt[..., 1:] == srt[..., :-1]).any():
            raise TraceError("trace ids must be distinct within a token's top-k")

    @property
    def top_k(self) -> int:
        return self.ids.shape[-1]

    @property
    def shape(self) -> tuple[int, int, int, int]:
        return tuple(self.ids.shape)

    def save(self, path: str | Path) -> Path:
        p = Path(path)
        p.parent.mkdir(parents=True, exist_ok=True)
        meta = dict(self.meta, n_experts=self.n_experts, top_k=self.top_k)
        with open(p, "wb") as f:
            np.savez_compressed(f, ids=self.ids.astype(np.int16), weights=self.weights.astype(np.float16),
                                meta=np.array(json.dumps(meta, sort_keys=True)))
        return p

    @classmethod
    def load(cls, path: str | Path) -> Trace:
        p = Path(path)
        if not p.exists():
            raise TraceError(f"no trace file {p}")
        with np.load(p, allow_pickle=False) as z:
            missing = {"ids", "weights", "meta"} - set(z.files)
            if missing:
                raise TraceError(f"trace {p} lacks {sorted(missing)} (format: k3lab.routing)")
            meta = json.loads(str(z["meta"]))
            return cls(z["ids"].astype(np.int16), z["weights"].astype(np.float16), int(meta["n_experts"]), meta)

    # ---- batches -------------------------------------------------------------------------------
    def batch_ids(self, B: int, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
        """(ids [B, K] int64, weights [B, K] float32) of one decode step of B sequences: layer
        seed % L, tokens spaced T / B apart from offset seed (sequence b % S)."""
        S, T, L, _ = self.ids.shape
        if B < 1:
            raise TraceError(f"batch must be >= 1, got {B}")
        layer = seed % L
        stride = max(1, T // B)
        t = (seed * 7 + np.arange(B) * stride) % T
        s = np.arange(B) % S
        return self.ids[s, t, layer].astype(np.int64), self.weights[s, t, layer].astype(np.float32)

    def mean_distinct(self, B: int, samples: int = 64) -> float:
        """Experts touched by a `batch_ids` batch of B, averaged over `samples` seeds."""
        return float(np.mean([len(np.unique(self.batch_ids(B, s)[0])) for s in range(samples)]))


def name_path(name: str) -> Path:
    """data/routing/<name>.npz for a trace name (letters, digits, '_' and '-')."""
    if not name or not all(c.isalnum() or c in "_-" for c in name):
        raise TraceError(f"trace name must be letters, digits, '_' or '-', got {name!r}")
    return DATA / f"{name}.npz"


def available() -> list[str]:
    return sorted(p.stem for p in DATA.glob("*.npz")) if DATA.exists() else []


_cache: dict[str, Trace] = {}


def load(name: str) -> Trace:
    """The trace data/routing/<name>.npz (cached)."""
    if name not in _cache:
        p = name_path(name)
        if not p.exists():
            raise TraceError(f"no routing trace {name!r} in {DATA}; available: {available()}")
        _cache[name] = Trace.load(p)
    return _cache[name]


# ---- statistics ---------------------------------------------------------------------------------

def stats(tr: Trace, batches: tuple[int, ...] = (1, 8, 16, 64)) -> dict:
    """Skew, next-token reuse and distinct experts per batch (module docstring)."""
    S, T, L, K = tr.ids.shape
    E = tr.n_experts
    top10, maxload = [], []
    for layer in range(L):
        cnt = np.bincount(tr.ids[:, :, layer].reshape(-1), minlength=E).astype(np.float64)
        srt = np.sort(cnt)[::-1]
        top10.append(srt[: max(1, E // 10)].sum() / cnt.sum())
        maxload.append(srt[0] / cnt.mean())
    reuse = []
    for s in range(S):
        for layer in range(L):
            a = tr.ids[s, :-1, layer]
            b = tr.ids[s, 1:, layer]
            inter = (a[:, :, None] == b[:, None, :]).any(-1).sum(-1)
            reuse.extend((inter / K).tolist())
    return dict(n_experts=E, top_k=K, sequences=S, tokens=T, layers=L,
                top10_share=float(np.mean(top10)), max_over_mean_load=float(np.mean(maxload)),
                next_token_reuse=float(np.mean(reuse)) if reuse else float("nan"),
                distinct={B: tr.mean_distinct(B) for B in batches})


def uniform_distinct(n_experts: int, top_k: int, B: int) -> float:
    """Expected distinct experts of B tokens each choosing top_k of n_experts uniformly at random."""
    return n_experts * (1.0 - (1.0 - top_k / n_experts) ** B)


# ---- synthetic ----------------------------------------------------------------------------------

def synthetic(n_experts: int = 896, top_k: int = 16, tokens: int = 256, layers: int = 2, *, zipf: float = 0.0,
              reuse: float = 0.0, seed: int = 0, name: str = "") -> Trace:
    """A trace of one sequence: per layer a Zipf(zipf) popularity over a random permutation of the experts
    (0 = uniform); each token keeps Binomial(K, reuse) experts of the previous token's and draws the rest
    by popularity without replacement; weights are sigmoid scores renormalized over the K. Note the
    measured next-token reuse is `reuse` plus the chance overlap of the fresh draws (larger when skewed)."""
    if not 1 <= top_k <= n_experts:
        raise TraceError(f"top_k={top_k} must be in 1..{n_experts}")
    if not 0.0 <= reuse <= 1.0 or zipf < 0:
        raise TraceError(f"reuse must be in [0, 1] and zipf >= 0, got reuse={reuse}, zipf={zipf}")
    rng = np.random.default_rng(seed)
    ids = np.zeros((1, tokens, layers, top_k), np.int16)
    for layer in range(layers):
        pop = 1.0 / np.arange(1, n_experts + 1) ** zipf
        pop = pop[rng.permutation(n_experts)]
        prev = None
        for t in range(tokens):
            keep = [] if prev is None else list(rng.choice(prev, rng.binomial(top_k, reuse), replace=False))
            p = pop.copy()
            p[keep] = 0.0
            fresh = rng.choice(n_experts, top_k - len(keep), replace=False, p=p / p.sum())
            sel = np.array(keep + list(fresh), dtype=np.int64)
            rng.shuffle(sel)
            ids[0, t, layer] = sel
            prev = sel
    s = 1.0 / (1.0 + np.exp(-rng.normal(size=ids.shape)))
    w = (s / s.sum(-1, keepdims=True)).astype(np.float16)
    meta = dict(source=f"k3lab.routing.synthetic(zipf={zipf}, reuse={reuse}, seed={seed})", name=name)
    return Trace(ids, w, n_experts, meta)


# ---- recorder -----------------------------------------------------------------------------------

@contextmanager
def recording(store: list):
    """While active, every MoE layer the reference model runs (k3lab.ref.layers.mlp_step ->
    k3lab.ref.moe.moe_forward) appends its router's (idx [N, K], weights [N, K]) to `store`, in call order."""
    from k3lab.ref import layers
    from k3lab.ref import router as ref_router

    orig = layers.moe_forward

    def route_and_keep(h, rw):
        idx, w, s = ref_router.route(h, rw)
        store.append((idx.detach().cpu(), w.detach().float().cpu()))
        return idx, w, s

    def moe_forward(h, w, **kw):
        return orig(h, w, router=route_and_keep, **kw)

    layers.moe_forward = moe_forward
    try:
        yield store
    finally:
        layers.moe_forward = orig


def record(stack, first: torch.Tensor, n_steps: int, *, source: str = "") -> Trace:
    """Run `stack` (k3lab.ref.stack.Stack) greedily for `n_steps` from tokens `first` [B] and return the
    trace of its MoE layers: S = B sequences, T = n_steps tokens, L = the stack's MoE layers."""
    calls: list = []
    with recording(calls):
        stack.generate(first, n_steps)
    if not calls:
        raise TraceError("the stack ran no MoE layer: nothing to record")
    if len(calls) % n_steps:
        raise TraceError(f"{len(calls)} MoE calls do not split into {n_steps} steps")
    L = len(calls) // n_steps
    B, K = calls[0][0].shape
    ids = torch.stack([c[0] for c in calls]).reshape(n_steps, L, B, K).permute(2, 0, 1, 3)
    w = torch.stack([c[1] for c in calls]).reshape(n_steps, L, B, K).permute(2, 0, 1, 3)
    E = next((lw.mlp.router.n_experts for lw in stack.w.layers if hasattr(lw.mlp, "router")), None)
    E = E or int(ids.max()) + 1
    return Trace(ids.numpy().astype(np.int16), w.numpy().astype(np.float16), E,
                 dict(source=source or f"k3lab.routing.record: reference stack, {B} sequences x {n_steps} steps"))


# ---- the traces in data/routing/ ------------------------------------------------------------------

SYNTHETIC = {  # name -> synthetic() arguments (python3 -m k3lab.routing writes them)
    "k3_reuse30": dict(zipf=0.5, reuse=0.275, seed=1),  # next-token reuse 29.6% (a public K3 measurement: 29.5%)
    "k3_skew": dict(zipf=0.8, reuse=0.0, seed=2),  # strongly skewed experts, no reuse beyond chance
}


def write_data(tokens: int = 512, layers: int = 2) -> dict[str, dict]:
    """(Re)write data/routing/<name>.npz for every SYNTHETIC entry (K3's 896 experts, top 16); their stats."""
    out = {}
    for name, kw in SYNTHETIC.items():
        tr = synthetic(896, 16, tokens, layers, name=name, **kw)
        p = tr.save(name_path(name))
        if p.stat().st_size > MAX_TRACE_BYTES:
            raise TraceError(f"{p} is {p.stat().st_size} bytes, over {MAX_TRACE_BYTES}")
        out[name] = dict(stats(tr), bytes=p.stat().st_size)
    return out


if __name__ == "__main__":
    for n, s in write_data().items():
        print(n, json.dumps(s))
