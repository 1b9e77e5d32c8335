"""What the routing does to the MoE experts' bytes and to the kernel choice (issue 14, notebooks/05_moe.ipynb).

A decode step's expert cost is set by the DISTINCT experts its tokens touch (each is read once) and by how many tokens
share each of them (the grouped kernels' work per weight read). Uniform routing spreads B x top-k picks over the
pool (about 610 distinct experts of 896 at batch 64); a trace with next-token reuse touches fewer (data/routing/);
"same16" touches 16 whatever the batch. `traffic` tabulates both quantities and the bytes a step must read.

The `auto` policy (data/moe_defaults.json) picks the experts' backend by batch and weight format only: it cannot see
the routing. `choice` sets what it picks beside what a bench bundle measured fastest for each routing, batch and
format (every row's fp64 check passed), so a routing under which another kernel wins shows as auto / best > 1.
"""
from __future__ import annotations

import re
from typing import Any

import pandas as pd

from k3lab import policy, registry, routing
from k3lab.ops import moe as ops_moe

K3 = dict(latent=3584, inter=3072, n_experts=896, top_k=16)
BATCHES = (1, 2, 4, 8, 16, 32, 64)


def traffic(tp: int = 8, batches=BATCHES, routings=None, dtypes=("bf16", "mxfp4"), dims=None) -> pd.DataFrame:
    """Per routing, batch and weight format: distinct experts touched, tokens a touched expert serves on average,
    and the MB a step must read (the registry's formula, `k3lab.ops.moe.experts_bytes`)."""
    op = registry.get("moe_experts")
    dims = dims or K3
    recs = []
    for r in routings or ["uniform", "same16", *routing.available()]:
        for B in batches:
            for dt in dtypes:
                c = op.case(batch=B, routing=r, dtype=dt, tp=tp, **dims)
                d = ops_moe.distinct_experts(c)
                recs.append(dict(routing=r, batch=B, dtype=dt, distinct=d, tokens_per_expert=B * dims["top_k"] / d,
                                 MB=ops_moe.experts_bytes(c) / 1e6))
    return pd.DataFrame(recs)


def traffic_figures(df: pd.DataFrame, tp: int = 8) -> list[Any]:
    import plotly.express as px

    one = df[df.dtype == df.dtype.iloc[0]]
    figs = [px.line(one, x="batch", y="distinct", color="routing", markers=True, log_x=True,
                    title="distinct experts touched a step (of 896, top 16)"),
            px.line(one, x="batch", y="tokens_per_expert", color="routing", markers=True, log_x=True, log_y=True,
                    title="tokens a touched expert serves (the grouped kernels' work a weight read)"),
            px.line(df, x="batch", y="MB", color="routing", facet_col="dtype", markers=True, log_x=True, log_y=True,
                    title=f"bytes a step must read (TP{tp} slice)")]
    for f in figs:
        f.update_layout(template="plotly_white", height=380)
    return figs


def trace_stats() -> pd.DataFrame:
    """The committed routing traces' statistics (k3lab.routing.stats: skew, next-token reuse, distinct experts), a
    row a trace."""
    return pd.DataFrame({n: routing.stats(routing.load(n)) for n in routing.available()}).T


def auto_backend(batch: int, dtype: str) -> tuple[str, str]:
    """(backend, rule) `auto` takes for the experts at `batch` tokens of `dtype` weights on a GPU where CuTe DSL and
    Triton both run (k3lab.policy.choose over data/moe_defaults.json; the routing plays no part)."""
    be, _, why = policy.choose("moe", "experts", batch, 1, lambda b: b in ("cute", "triton"), {"fmt": dtype})
    return be, why


def _path(row: Any) -> str:
    """The kernel path a row ran (its `ran` notes: "path token: ...", "path grouped ..."), '' if not said."""
    ran = (row.extra or {}).get("ran") or {}
    m = re.search(r"\bpath (\w+)", ran.get("notes") or "")
    return m.group(1) if m else ""


def choice(bundle: Any) -> pd.DataFrame:
    """Per (routing, batch, dtype) of a moe bench bundle: `auto`'s backend, the fastest correct row (its backend and
    kernel path) and auto's time over it. auto's time is its backend's row at the default options (path None); a case
    the bundle did not run under auto's backend has no ratio."""
    best: dict[tuple, Any] = {}
    plain: dict[tuple, Any] = {}
    for r in bundle.rows:
        x = r.extra or {}
        if x.get("op") != "moe_experts" or not (r.error or {}).get("ok") or r.median_us is None:
            continue
        k = (x["routing"], x["batch"], x["dtype"])
        if k not in best or r.median_us < best[k].median_us:
            best[k] = r
        if (x.get("options") or {}).get("path") is None:
            pk = k + (r.backend,)
            if pk not in plain or r.median_us < plain[pk].median_us:
                plain[pk] = r
    recs = []
    for (rt, B, dt), b in sorted(best.items(), key=lambda kv: (kv[0][0], kv[0][2], kv[0][1])):
        be, why = auto_backend(B, dt)
        a = plain.get((rt, B, dt, be))
        recs.append(dict(routing=rt, batch=B, dtype=dt, auto=be, auto_path=_path(a) if a else "",
                         auto_us=a.median_us if a else None, best=b.backend, best_path=_path(b), best_us=b.median_us,
                         auto_over_best=(a.median_us / b.median_us) if a else None, auto_rule=why))
    return pd.DataFrame(recs)


def choice_figure(df: pd.DataFrame) -> Any:
    import plotly.express as px

    d = df.dropna(subset=["auto_over_best"])
    fig = px.line(d, x="batch", y="auto_over_best", color="routing", facet_col="dtype", markers=True, log_x=True,
                  hover_data=["auto", "auto_path", "best", "best_path", "best_us"],
                  title="auto's kernel over the fastest measured, by routing (1.0: auto took the winner)")
    fig.update_layout(template="plotly_white", height=380)
    return fig
