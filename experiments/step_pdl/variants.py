"""The decode step under switch variants on the GPU, each checked against the first variant's output and timed
through the one timer (whole step, one CUDA graph; tp8, one AttnRes block, MXFP4 pools, 8K context, `auto`).

    python experiments/step_pdl/variants.py OUT [cute|pdl|moe] [BATCH ...]

`cute` (default): the `pdl` switch with the CuTe DSL AttnRes and router (what `auto` picks when CuTe DSL is
installed) against the Triton ones (the router's selection then fused into the MoE input projection at <= 16
tokens), and pdl + split_router + owned_output. `pdl`: plain launches, pdl, plain again (the first measurement,
made without CuTe DSL). `moe`: pdl against plain where the grouped CuTe MoE experts and the CuTe MLA decode run
(twenty-sixth session: pdl cost 395 us at batch 64), each suspect taken out alone: the grouped experts' up launched
with the chain's pdl (`grouped_pdl`: True, a patch of this script, not a switch; the run in
h200/step_variants_moe.json.gz was made when that was the kernel's default, so its row is "pdl, grouped up plain"
with the patch forcing pdl=False), the experts on triton, the MLA on triton. Writes OUT/step_variants-<set>.json
(environment, switches and samples per variant) and
prints a table.
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

AUTO = Switches(backend={c: "auto" for c in COMPONENTS})
SETS = {"pdl": (("plain", {}), ("pdl", dict(pdl=True)), ("plain_again", {}))}
SETS["cute"] = (
    ("auto", {}),
    ("auto+pdl", dict(pdl=True)),
    ("pdl, router triton", dict(pdl=True, backend_router="triton")),
    ("pdl, both triton", dict(pdl=True, backend_router="triton", backend_attnres="triton")),
    ("pdl+split+owned", dict(pdl=True, split_router=True, owned_output=True)),
)
SETS["moe"] = (
    ("pdl", dict(pdl=True)),
    ("plain", {}),
    ("pdl, grouped up under pdl", dict(pdl=True, grouped_pdl=True)),
    ("pdl, moe triton", dict(pdl=True, backend_moe="triton")),
    ("pdl, mla triton", dict(pdl=True, backend_mla="triton")),
)


def grouped_pdl(force: bool | None) -> None:
    """The grouped CuTe experts' up launched by the kernel's own rule (None: plainly unless asked) or forced to
    pdl=True / False."""
    from k3lab_kernels.cute import moe_grouped as mg

    orig = getattr(mg, "_orig_moe_grouped", mg.moe_grouped)
    mg._orig_moe_grouped = orig
    mg.moe_grouped = orig if force is None else (lambda *a, **k: orig(*a, **{**k, "pdl": force}))


def main(out: str, which: str, batches: list[int]) -> None:
    rows = []
    for B in batches:
        st = S.DecodeStep(preset("tp8", batch=B, context=8192, expert_dtype="mxfp4"), AUTO)
        x = torch.randn(tuple(st.x_in.shape), device=st.device).to(st.dtype)
        kda = [L.state for L in st.layers if L.kind == "kda"]
        start = [(s.state.clone(), s.conv_state.clone()) for s in kda]
        ref = None
        for name, over in SETS[which]:
            over = dict(over)
            grouped_pdl(over.pop("grouped_pdl", None))
            st.set_switches(AUTO.replace(**over))
            for s, (s0, c0) in zip(kda, start):
                s.state.copy_(s0)
                s.conv_state.copy_(c0)
            y = st.run(x).clone()
            torch.cuda.synchronize()
            err = 0.0 if ref is None else rel_norm_error(y, ref)
            ref = y if ref is None else ref
            t = S.time_step(st, reps=20, warmup=3)
            rows.append(dict(batch=B, variant=name, switches=over, backends=dict(st.switches.backend),
                             median_us=t.median_us, samples_us=list(t.samples_us), kind=t.kind, err_vs_first=err,
                             why={k: v for k, v in st.why.items() if k in ("attnres", "router", "pdl")}))
            print(f"B={B:3d} {name:22s} {t.median_us:9.1f} us  {t.kind}  err {err:.2e}  "
                  f"attnres={st.switches.backend['attnres']} router={st.switches.backend['router']}", flush=True)
    with open(f"{out}/step_variants-{which}.json", "w") as f:
        json.dump(dict(env=envmod.fingerprint(), created=time.strftime("%Y-%m-%dT%H:%M:%S"), rows=rows), f, indent=1)
    first = SETS[which][0][0]
    print(f"\n| batch | variant | step us | vs {first} |")
    print("|---|---|---|---|")
    for r in rows:
        p = next(q for q in rows if q["batch"] == r["batch"] and q["variant"] == first)
        print(f"| {r['batch']} | {r['variant']} | {r['median_us']:.1f} | {r['median_us'] - p['median_us']:+.1f} |")


if __name__ == "__main__":
    args = sys.argv[2:]
    which = args.pop(0) if args and args[0] in SETS else "cute"
    main(sys.argv[1], which, [int(b) for b in args] or [1, 64])
