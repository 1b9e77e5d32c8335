"""The step's `pdl` switch on the GPU: the whole per-GPU step (tp8, one AttnRes block, MXFP4 experts, 8K context)
timed with every Triton kernel launched plainly and with programmatic dependent launch (pdl), the step's output
checked equal to the plain launch's (the same kernels, the same maths: only the MoE's atomics may reorder fp32
sums). The first run (h200/pdl_step.json.gz) also timed pdl with each projection program prefetching its W slice
into L2 before its wait ("pdl" there; "pdl_noprefetch" is what the switch runs now): 280 us slower, removed.

    python experiments/step_pdl/pdl_step.py OUT [BATCH ...]

Writes OUT/pdl_step.json (environment, each variant's graph-replay samples) and prints a table.
"""
import json
import sys
import time

import torch

from k3lab import step as S
from k3lab.config import preset
from k3lab.harness import env as envmod
from k3lab.harness.numerics import rel_norm_error
from k3lab.switches import COMPONENTS, Switches


def main(out: str, batches: list[int]) -> None:
    rows = []
    for B in batches:
        view = preset("tp8", batch=B, context=8192, expert_dtype="mxfp4")
        base = Switches(backend={c: "auto" for c in COMPONENTS})
        st = S.DecodeStep(view, base)
        x = torch.randn(tuple(st.x_in.shape), device=st.device).to(st.dtype)
        kda = [L.state for L in st.layers if L.kind == "kda"]
        start = [(s.state.clone(), s.conv_state.clone()) for s in kda]
        ref = None
        for name, pdl in (("plain", False), ("pdl", True), ("plain_again", False)):
            st.set_switches(base.replace(pdl=pdl))
            for s, (s0, c0) in zip(kda, start):
                s.state.copy_(s0)
                s.conv_state.copy_(c0)
            y = st.run(x).clone()
            torch.cuda.synchronize()
            err = 0.0 if ref is None else rel_norm_error(y, ref)
            ref = y if ref is None else ref
            t = S.time_step(st, reps=20, warmup=3)
            rows.append(dict(batch=B, variant=name, pdl=pdl, median_us=t.median_us,
                             samples_us=list(t.samples_us), kind=t.kind, err_vs_plain=err,
                             why=st.why.get("pdl", "")))
            print(f"B={B:3d} {name:16s} {t.median_us:9.1f} us  {t.kind}  err {err:.2e}", flush=True)
    with open(f"{out}/pdl_step.json", "w") as f:
        json.dump(dict(env=envmod.fingerprint(), created=time.strftime("%Y-%m-%dT%H:%M:%S"), rows=rows), f, indent=1)
    print("\n| batch | variant | step us | vs plain |")
    print("|---|---|---|---|")
    for r in rows:
        p = next(q for q in rows if q["batch"] == r["batch"] and q["variant"] == "plain")
        print(f"| {r['batch']} | {r['variant']} | {r['median_us']:.1f} | {r['median_us'] - p['median_us']:+.1f} |")


if __name__ == "__main__":
    main(sys.argv[1], [int(b) for b in sys.argv[2:]] or [1, 64])
