"""KDA state-dtype drift: one layer's decode run for many steps with an fp32 state and with a bf16
state (same backend, same inputs), each compared per step against an fp64 reference run.

The fp64 reference carries its own fp64 state and conv state; the tested runs carry theirs, so errors
accumulate exactly as they would in a long generation. Inputs are fresh random per step (seeded),
from `make_kda_inputs`.
"""
from __future__ import annotations

import pandas as pd
import torch

from k3lab.harness.numerics import rel_norm_error as _rel
from k3lab.ref import kda as ref


def drift_study(steps: int = 2000, *, B: int = 1, H: int = 12, D: int = 128, backend: str = "auto",
                tile_v: int | None = None, device: str | None = None, seed: int = 0, every: int = 1,
                state_dtypes=("fp32", "bf16")) -> pd.DataFrame:
    """Run `steps` decode steps of one KDA layer per state dtype; rows every `every` steps with columns
    step, state_dtype, backend, out_err, state_err (relative Frobenius norm vs fp64), state_norm."""
    from k3lab.components import dispatch
    from k3lab.components import kda as comp

    for arg, v, least in (("steps", steps, 1), ("every", every, 1), ("B", B, 1), ("H", H, 1), ("D", D, 1)):
        if isinstance(v, bool) or not isinstance(v, int) or v < least:
            raise ValueError(f"drift_study: {arg!r} must be an int >= {least}, got {v!r}")
    be, opts, _ = dispatch.select("kda_decode", backend, B=B)
    tile_v = tile_v or min(opts.get("tile_v") or 128, D)
    if device is None:
        device = "cuda" if (be in ("triton", "cute") and torch.cuda.is_available()) else "cpu"
    _, params, state0, conv0 = ref.make_kda_inputs(B, H, D, seed=seed, device=device)
    p64 = params.to(torch.float64)
    sdt = {"fp32": torch.float32, "bf16": torch.bfloat16}
    runs = {n: (state0.to(sdt[n]).clone(), conv0.clone()) for n in state_dtypes}
    S64, c64 = state0.double(), conv0.double()
    rows = []
    out = torch.empty(B, H * D, dtype=torch.bfloat16, device=device)
    for step in range(steps):
        inp, *_ = ref.make_kda_inputs(B, H, D, seed=seed * 1_000_003 + step + 1, device=device)
        o64, S64, c64 = ref.kda_decode(*(inp[k].double() for k in ("qkv", "f", "b", "gate")), p64, S64, c64,
                                       dtype=torch.float64, out_dtype=torch.float64)
        for name, (S, cs) in runs.items():
            comp.decode(inp["qkv"], inp["f"], inp["b"], inp["gate"], params, S, cs, out, backend=be,
                        tile_v=tile_v)
            if step % every == 0 or step == steps - 1:
                rows.append(dict(step=step, state_dtype=name, backend=be, out_err=_rel(out, o64),
                                 state_err=_rel(S, S64), state_norm=float(S64.norm())))
    return pd.DataFrame(rows)
