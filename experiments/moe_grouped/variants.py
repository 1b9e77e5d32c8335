"""GPU study of the grouped CuTe DSL MoE experts (kernels/cute/moe_grouped.py, issue 14) at K3's pool (896 experts,
latent 3584, MXFP4, TP8, uniform routing) and several batches: the kernel file's module settings (`UP_UNROLL`, blocks
of L an up step; `DOWN_TILES`, tiles of 16 latent rows a warp of the down kernel; `FEW_PAIRS`, `FEW_UP_SPLIT`,
`FEW_DOWN_TILES`, the few-pairs shape; `UP_SHARE`, `DOWN_SHARE`, `SHARE_FROM`, a large group's work shared among
its members' CTAs; `DOWN_CTAS_PER_SM`) and the component's `path` knob
("grouped" at batch 1, where the default is the one-token kernels), each set checked against fp64 by the
shared checker, then timed (graph replay, inputs rotated past L2, k3lab.harness.timing) beside the Triton default
of the same run.
Run: python experiments/moe_grouped/variants.py $OUT [REPS]   (writes $OUT/moe_grouped_variants.json after every case,
prints a table;
BATCHES='8,64', ROUTINGS='uniform,same16' and VARIANTS='[{"UP_UNROLL": 4, "DOWN_TILES": 2}, ...]' replace the
defaults)."""
import json
import os
import sys

import torch

from k3lab import registry
from k3lab.harness import checker, timing
from k3lab_kernels.cute import moe_grouped as M

OUT = sys.argv[1] if len(sys.argv) > 1 else "/tmp"
REPS = int(sys.argv[2]) if len(sys.argv) > 2 else 20
OP = registry.get("moe_experts")
VARIANTS = [{"UP_UNROLL": 8, "DOWN_TILES": 4}, {"UP_UNROLL": 4, "DOWN_TILES": 4}, {"UP_UNROLL": 8, "DOWN_TILES": 2},
            {"UP_UNROLL": 8, "DOWN_TILES": 8}] if not os.environ.get("VARIANTS") else json.loads(os.environ["VARIANTS"])
BATCHES = [int(b) for b in os.environ.get("BATCHES", "8,64").split(",")]
ROUTINGS = os.environ.get("ROUTINGS", "uniform").split(",")
# every module setting a variant sets is put back after it (a setting missing here leaked into the next batch's rows:
# UP_LSPLIT in the fifty-ninth session's batch-64 rows, docs/NOTES_moe.md)
DEFAULTS = {k: getattr(M, k) for k in ("UP_UNROLL", "DOWN_TILES", "FEW_PAIRS", "FEW_UP_SPLIT", "FEW_DOWN_TILES",
                                       "UP_SHARE", "UP_SHARE_LARGE", "SHARE_LARGE_PAIRS", "DOWN_SHARE", "SHARE_FROM",
                                       "DOWN_CTAS_PER_SM", "UP_LSPLIT")}
DEFAULTS.update({k: getattr(M, k) for f in VARIANTS for k in f if k != "path"})

rows = []


def save():
    """The results so far (a run cut short by its call's limit still returns them)."""
    env = dict(torch=torch.__version__, gpu=torch.cuda.get_device_name())
    json.dump(dict(probes=pr, rows=rows, reps=REPS, env=env), open(f"{OUT}/moe_grouped_variants.json", "w"), indent=1)


pr = timing.probes("cuda")
print("probes", pr, flush=True)
for batch, routing in [(b, r) for r in ROUTINGS for b in BATCHES]:
    case = OP.case(dtype="mxfp4", batch=batch, routing=routing, tp=8, latent=3584, inter=3072, n_experts=896,
                   top_k=16)
    nbytes = OP.nbytes(case)
    n_sets = max(2, timing.rotation_count(nbytes, timing.l2_bytes()))
    sets = [OP.make_inputs(case, 1000 + i, "cuda") for i in range(n_sets)]
    floor_us = nbytes / (pr["read_tbps"] * 1e12) * 1e6
    for be, flags in [("triton", None)] + [("cute", f) for f in VARIANTS]:
        opts = {k: v for k, v in (flags or {}).items() if k == "path"}   # the component's knob, not a setting
        for k, v in (flags or {}).items():
            if k != "path":
                setattr(M, k, v)
        try:
            chk = checker.check(OP, case, backend=be, inputs=sets[0], options=opts)
            t = timing.bench_gpu(lambda s, c=case, b=be, o=opts: OP.call(s, c, b, o, None),
                                 input_sets=[(s,) for s in sets], reps=REPS)
        except Exception as e:  # a variant that fails to build or launch is a row, not the end of the run
            print(batch, flags, "FAILED", type(e).__name__, str(e)[:300], flush=True)
            rows.append(dict(batch=batch, routing=routing, variant=str(flags), error=f"{type(e).__name__}: {e}"[:1000]))
            save()
            continue
        finally:
            for k, v in DEFAULTS.items():
                setattr(M, k, v)
        name = be if flags is None else "cute " + " ".join(f"{k.lower()}={v}" for k, v in flags.items())
        r = dict(batch=batch, routing=routing, variant=name, median_us=t.median_us, p10_us=t.p10_us, p90_us=t.p90_us,
                 samples=t.samples_us, floor_us=floor_us, ok=chk.ok, failures=chk.failures[:3], sets=n_sets)
        rows.append(r)
        save()
        print(batch, routing, name, round(t.median_us, 2), chk.ok, flush=True)
    del sets
    torch.cuda.empty_cache()
save()
print("\n%5s %-8s %-40s %9s %9s %9s %8s %s" % ("batch", "routing", "variant", "us", "p10", "p90", "floor", "ok"))
for r in rows:
    if "error" in r:
        print("%5d %-8s %-24s %s" % (r["batch"], r["routing"], r["variant"], r["error"][:100]))
        continue
    print("%5d %-8s %-40s %9.2f %9.2f %9.2f %8.2f %s" % (r["batch"], r["routing"], r["variant"], r["median_us"],
                                                         r["p10_us"], r["p90_us"], r["floor_us"], r["ok"]))
