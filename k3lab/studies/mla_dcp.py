"""What one GPU of DCP-N spends on an MLA decode step, against N, beside the merge of the N shards.

Under decode context parallelism each of N GPUs holds 1/N of every sequence's latent cache and runs all query
heads over its own positions: its attention is `mla_decode` over a history of ceil((context + T) / N) positions
(its own split-KV pieces merged locally), after which the N partials (o, lse) are exchanged and merged, which
k3lab fuses with the value up-projection and the gate (`mla_combine` with N partials). So the per-shard time
at N is the registry's `mla_decode` at the shard's history length, and the merge is `mla_combine` at
partitions = N: both measured by the one bench (`k3lab.bench.runner.run`), checked against fp64. The exchange
itself (an all-gather of B*T*H*(C+1) fp32 per GPU) is not modelled here.
"""
from __future__ import annotations

from typing import Any

import pandas as pd

from k3lab.bench import runner


def shard_context(context: int, n: int, T: int = 1) -> int:
    """Cached positions one GPU of DCP-n holds before the step (its history is ceil((context + T) / n))."""
    return max(0, -(-(context + T) // n) - T)


def run(context: int = 32768, ns=(1, 2, 4, 8, 16), *, batch=(1,), heads: int = 12, page_size: int = 64,
        kv_dtype: str = "bf16", backends=("triton",), reps: int = 30, deadline_s: float = 0) -> Any:
    """One bundle: `mla_decode` at each shard's history length and `mla_combine` at partitions = N."""
    ctxs = sorted({shard_context(context, n) for n in ns} - {0})
    grid = dict(heads=[heads], batch=list(batch), context=ctxs or [1], page_size=[page_size], kv_dtype=[kv_dtype],
                partitions=["auto"], T=[1])
    bd = runner.run("mla", grid=grid, ops=["mla_decode"], backends=list(backends), peers=False, reps=reps,
                    deadline_s=deadline_s, name=f"mla_dcp_c{context}")
    comb = runner.run("mla", grid=dict(heads=[heads], batch=list(batch), partitions=sorted(set(ns)), T=[1], dcp=[1]),
                      ops=["mla_combine"], backends=list(backends), peers=False, reps=reps, deadline_s=deadline_s)
    bd.rows.extend(comb.rows)
    bd.config["dcp_study"] = dict(context=context, ns=list(ns), shard_contexts={n: shard_context(context, n)
                                                                                for n in ns})
    return bd


def frame(bd: Any) -> pd.DataFrame:
    """Rows n, batch, shard_us (one GPU's attention), merge_us (the N partials merged with Wuv and the gate)."""
    st = bd.config.get("dcp_study")
    if not st:
        raise ValueError("frame: this bundle has no 'dcp_study' config (make it with k3lab.studies.mla_dcp.run)")
    dec, comb = {}, {}
    for r in bd.rows:
        e = r.extra or {}
        if r.backend not in ("triton", "cute") or r.median_us is None:
            continue
        if e.get("op") == "mla_decode":
            dec[(e["batch"], e["context"])] = r.median_us
        elif e.get("op") == "mla_combine":
            comb[(e["batch"], e["partitions"])] = r.median_us
    out = []
    for n in st["ns"]:
        sc = st["shard_contexts"].get(n, st["shard_contexts"].get(str(n)))
        for b in sorted({k[0] for k in dec}):
            out.append(dict(n=n, batch=b, shard_context=sc, shard_us=dec.get((b, max(sc, 1))),
                            merge_us=comb.get((b, n))))
    return pd.DataFrame(out)


def figure(bd: Any):
    """Per-shard time and the merge against N (one trace pair per batch)."""
    import plotly.graph_objects as go

    df = frame(bd)
    fig = go.Figure()
    for b, g in df.groupby("batch"):
        fig.add_bar(x=g["n"].astype(str), y=g["shard_us"], name=f"one GPU's attention, batch {b}")
        fig.add_bar(x=g["n"].astype(str), y=g["merge_us"], name=f"merge of N partials + Wuv + gate, batch {b}")
    st = bd.config["dcp_study"]
    fig.update_layout(barmode="stack", title=f"DCP-N at {st['context']} cached positions: what one GPU spends",
                      xaxis_title="N (DCP ranks)", yaxis_title="us (graph replay, rotated past L2)")
    return fig
