"""GPU diagnosis of the step numerics (docs/NOTES_step.md, ninth session: non-finite from the first MoE layer on
the H200, finite under the interpreter). Runs the tiny stack on the device component by component and names the
first component after which a buffer holds a non-finite value, for the fused switches and variants with one group
sent back to the reference (a buffer flagged before its producer ran, e.g. `z` at attnres_attn, is an unwritten
empty buffer, not a fault). Usage: python experiments/step_numerics/diag.py OUT_DIR"""
import json
import math
import sys

import torch

from k3lab import step as S
from k3lab.config import preset
from k3lab.switches import Switches

FUSED = dict(backend={c: "triton" for c in ("kda", "mla", "attnres", "router", "moe", "proj")}, kda_tile_v=16)


def tensors(v, name):
    if isinstance(v, torch.Tensor):
        yield name, v
    elif isinstance(v, (list, tuple)):
        for i, t in enumerate(v):
            yield from tensors(t, f"{name}[{i}]")


def bad(L):
    return sorted(n for k, v in L.buf.items() for n, t in tensors(v, k)
                  if t.is_floating_point() and not bool(torch.isfinite(t).all()))




def variant(name, sw, dtype="mxfp4", batch=1):
    view = preset("tiny", batch=batch, context=64, expert_dtype=dtype)
    st = S.DecodeStep(view, Switches(**sw), device="cuda", seed=0, gen_device="cpu")
    x = torch.randn(tuple(st.x_in.shape), generator=torch.Generator().manual_seed(1)).to("cuda", st.dtype)
    st.x_in.copy_(x)
    xs, blocks = st.x_in, st.blocks_in
    res = None
    for i, L in enumerate(st.layers):
        L.buf["x"], L.buf["blocks"] = xs, blocks
        for cname, fn in st._layer_fns(i):
            fn()
            torch.cuda.synchronize()
            b = bad(L)
            if b and res is None:
                res = dict(layer=i, component=cname, buffers=b)
        xs, blocks = L.buf["x_out"], L.buf["blocks_mlp"]
        if res:
            break
    num = S.step_numerics(view, Switches(**sw), n_steps=2)
    errs = [e[-1] for e in num["rel_err"]]
    return dict(name=name, first_bad=res, errs=errs, backends=num["backends"], ran=[L.ran for L in st.layers[:2]])


def main(out):
    vs = [("fused", FUSED), ("fused-prologues", dict(FUSED, fuse_prologues=True))]
    for g in ("moe", "router", "proj", "attnres", "kda", "mla"):
        vs.append((f"fused-{g}=ref", dict(FUSED, backend={**FUSED["backend"], g: "reference"})))
    res = []
    for name, sw in vs:
        try:
            r = variant(name, sw)
        except Exception as e:  # noqa: BLE001
            r = dict(name=name, error=f"{type(e).__name__}: {e}"[:400])
        res.append(r)
        print(json.dumps(r)[:600], flush=True)
    for dt in ("bf16", "fp8"):
        r = variant(f"fused-{dt}", FUSED, dtype=dt)
        res.append(r)
        print(json.dumps(r)[:600], flush=True)
    json.dump(res, open(f"{out}/diag.json", "w"), indent=1)
    print("\nvariant                first_bad                                   max err")
    for r in res:
        fb = r.get("first_bad")
        if "errs" not in r:
            print(f"{r['name']:22s} ERROR {r['error'][:80]}")
            continue
        fin = [e for e in r["errs"] if math.isfinite(e)]
        print(f"{r['name']:22s} {str(fb and (fb['layer'], fb['component'], fb['buffers'][:3]))[:60]:60s} "
              f"nonfinite {len(r['errs']) - len(fin)} max finite {max(fin, default=math.nan):.3g}")


if __name__ == "__main__":
    main(sys.argv[1])
