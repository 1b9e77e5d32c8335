"""GPU study of the CuTe DSL MoE experts of one token (kernels/cute/moe_experts.py, MXFP4; with KERNEL=moe_dense
kernels/cute/moe_dense.py, bf16 and fp8; issue 14) at K3's pool (896 experts, latent 3584), TP8 and TP16 slices,
uniform routing: the kernel file's module settings (`DOWN_ROWS`, latent rows a CTA of the down kernel; `UP_ROWS`,
intermediate rows of W1 and W3 a CTA of the up kernel), each set checked against fp64 by the shared checker, then timed
(graph replay, inputs rotated past L2, k3lab.harness.timing) beside the Triton default of the same run.
Run: python experiments/moe_cute/variants.py $OUT   (writes $OUT/moe_cute_variants.json, prints a table)
     KERNEL=moe_dense VARIANTS='[{"UP_ROWS": 2, "DOWN_ROWS": 2}, ...]' python experiments/moe_cute/variants.py $OUT
         (the dense kernels at bf16 and fp8: $OUT/moe_dense_variants.json)."""
import importlib
import json
import os
import sys

import torch

from k3lab import registry
from k3lab.harness import checker, timing

KERNEL = os.environ.get("KERNEL", "moe_experts")
M = importlib.import_module(f"k3lab_kernels.cute.{KERNEL}")
DTYPES = ("mxfp4",) if KERNEL == "moe_experts" else ("bf16", "fp8")

OUT = sys.argv[1] if len(sys.argv) > 1 else "/tmp"
REPS = int(sys.argv[2]) if len(sys.argv) > 2 else 20
OP = registry.get("moe_experts")
# module settings a row; VARIANTS='[{"DOWN_ROWS": 4, "UP_ROWS": 2}, ...]' replaces them. The earlier runs' forms are in
# git history: the study flags L2_W2 / EARLY_DOWN at 22b43ed, the warp-per-(pair, two rows) up kernel (UP_ROWS 0) at
# 2125780, the one-launch form (FORM "fused", FUSED_GROUPS, FUSED_GRID) at fca14c9
VARIANTS = [{"DOWN_ROWS": 4, "UP_ROWS": 4}, {"DOWN_ROWS": 4, "UP_ROWS": 2}, {"DOWN_ROWS": 8, "UP_ROWS": 4}] \
    if not os.environ.get("VARIANTS") else json.loads(os.environ["VARIANTS"])
if KERNEL == "moe_dense" and not os.environ.get("VARIANTS"):
    VARIANTS = [{"UP_ROWS": u, "DOWN_ROWS": d} for u, d in ((4, 4), (2, 2), (8, 8), (4, 2), (2, 4))]
DEFAULTS = {k: getattr(M, k) for k in sorted({k for f in VARIANTS for k in f})}
# BATCHES="8,64" (KERNEL=moe_dense): the grouped twins at those batches (TP8 only), their settings (UP_UNROLL, CHAINS,
# GROUP_DOWN_TILES) as the variants
BATCHES = [int(b) for b in os.environ.get("BATCHES", "1").split(",")]

rows = []
pr = timing.probes("cuda")
print("probes", pr, flush=True)
for dtype, tp, batch in [(d, t, b) for d in DTYPES for b in BATCHES for t in ((8, 16) if b == 1 else (8,))]:
    case = OP.case(dtype=dtype, batch=batch, routing="uniform", tp=tp, latent=3584, inter=3072, n_experts=896,
                   top_k=16)
    nbytes = OP.nbytes(case)
    n_sets = max(2, timing.rotation_count(nbytes, timing.l2_bytes()))
    sets = [OP.make_inputs(case, 1000 + i, "cuda") for i in range(n_sets)]
    floor_us = nbytes / (pr["read_tbps"] * 1e12) * 1e6
    for be, flags in [("triton", None)] + [("cute", f) for f in VARIANTS]:
        for k, v in (flags or {}).items():
            setattr(M, k, v)
        try:
            chk = checker.check(OP, case, backend=be, inputs=sets[0])
            t = timing.bench_gpu(lambda s, c=case, b=be: OP.call(s, c, b, {}, None), input_sets=[(s,) for s in sets],
                                 reps=REPS)
        except Exception as e:  # a variant that fails to build or launch is a row, not the end of the run
            print(dtype, tp, batch, flags, "FAILED", type(e).__name__, str(e)[:300], flush=True)
            rows.append(dict(dtype=dtype, tp=tp, batch=batch, variant=str(flags),
                             error=f"{type(e).__name__}: {e}"[:1000]))
            continue
        finally:
            for k, v in DEFAULTS.items():
                setattr(M, k, v)
        name = be if flags is None else "cute " + " ".join(f"{k.lower()}={v}" for k, v in flags.items())
        r = dict(dtype=dtype, tp=tp, batch=batch, variant=name, median_us=t.median_us, p10_us=t.p10_us, p90_us=t.p90_us,
                 samples=t.samples_us, floor_us=floor_us, ok=chk.ok, failures=chk.failures[:3], sets=n_sets)
        rows.append(r)
        print(dtype, tp, batch, name, round(t.median_us, 2), chk.ok, flush=True)
    del sets
    torch.cuda.empty_cache()
    # after every case: a run cut short by its call's limit keeps what it measured
    env = dict(torch=torch.__version__, gpu=torch.cuda.get_device_name())
    json.dump(dict(probes=pr, rows=rows, reps=REPS, env=env),
              open(f"{OUT}/{'moe_cute' if KERNEL == 'moe_experts' else 'moe_dense'}_variants.json", "w"), indent=1)
print("\n%-6s %3s %5s %-40s %9s %9s %9s %8s %s" % ("dtype", "TP", "batch", "variant", "us", "p10", "p90", "floor",
                                                  "ok"))
for r in rows:
    if "error" in r:
        print("%-6s %3d %5d %-24s %s" % (r["dtype"], r["tp"], r["batch"], r["variant"], r["error"][:100]))
        continue
    print("%-6s %3d %5d %-40s %9.2f %9.2f %9.2f %8.2f %s" % (r["dtype"], r["tp"], r["batch"], r["variant"],
                                                              r["median_us"], r["p10_us"], r["p90_us"], r["floor_us"],
                                                              r["ok"]))
