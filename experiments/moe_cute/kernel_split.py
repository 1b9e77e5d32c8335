"""Where the one-token experts spend their time, kernel by kernel (issue 14): kernels/cute/moe_dense.py (bf16, fp8)
or with KERNEL=moe_experts kernels/cute/moe_experts.py (MXFP4). K3's TP8 pool at batch 1, uniform routing, each
module setting in VARIANTS (JSON list of dicts, default the module's own) checked against fp64 by the shared checker,
then REPS eager calls on input sets rotated past L2 under torch.profiler (k3lab.harness.timing.kernel_list): each
kernel's device times beside its own byte floor (up: two thirds of the op's bytes, W1 + W3; down: one third, W2; at
the read bandwidth of k3lab.harness.timing.probes). Eager calls: no graph-replay figure, and a PDL launch's time
counts from when it was let in, so a down kernel's time can include some of up's tail.
BATCH (1) and ROUTING (uniform) set the case (KERNEL=moe_grouped: the grouped kernels' settings, e.g. BATCH=8
ROUTING=same16).
Run: python experiments/moe_cute/kernel_split.py $OUT   (writes $OUT/KERNEL_split.json, prints a table)"""
import importlib
import json
import os
import sys

import torch

from k3lab import registry
from k3lab.harness import checker, timing

KERNEL = os.environ.get("KERNEL", "moe_dense")
M = importlib.import_module(f"k3lab_kernels.cute.{KERNEL}")
DTYPES = ("mxfp4",) if KERNEL in ("moe_experts", "moe_grouped") else ("bf16", "fp8")

OUT = sys.argv[1] if len(sys.argv) > 1 else "/tmp"
REPS = int(os.environ.get("REPS", "40"))
OP = registry.get("moe_experts")
VARIANTS = json.loads(os.environ.get("VARIANTS", "[{}]"))
DEFAULTS = {k: getattr(M, k) for k in sorted({k for f in VARIANTS for k in f})}

pr = timing.probes("cuda")
rows = []
for dtype in DTYPES:
    case = OP.case(dtype=dtype, batch=int(os.environ.get("BATCH", "1")), routing=os.environ.get("ROUTING", "uniform"),
                   tp=8, latent=3584, inter=3072, n_experts=896, top_k=16)
    n_sets = max(2, timing.rotation_count(OP.nbytes(case), timing.l2_bytes()))
    sets = [OP.make_inputs(case, 2000 + i, "cuda") for i in range(n_sets)]
    up_b, down_b = 2 * OP.nbytes(case) / 3, OP.nbytes(case) / 3
    for flags in VARIANTS:
        for key, v in flags.items():
            setattr(M, key, v)
        try:
            chk = checker.check(OP, case, backend="cute", inputs=sets[0])
            kl = timing.kernel_list(lambda d, c=case: OP.call(d, c, "cute", {}, None), calls=REPS,
                                    input_sets=[(d,) for d in sets], durations=True)
        finally:
            for key, v in DEFAULTS.items():
                setattr(M, key, v)
        for k in sorted(kl, key=lambda k: -sum(k["us"])):
            low = k["name"].lower()
            nb = up_b if "up" in low else down_b if "down" in low else None
            floor = nb / (pr["read_tbps"] * 1e12) * 1e6 if nb else None
            rows.append(dict(dtype=dtype, variant=str(flags), kernel=k["name"][:120], calls=len(k["us"]),
                             samples=k["us"], mean_us=sum(k["us"]) / len(k["us"]), floor_us=floor, ok=chk.ok))
    del sets
    torch.cuda.empty_cache()
env = dict(torch=torch.__version__, gpu=torch.cuda.get_device_name())
json.dump(dict(probes=pr, rows=rows, reps=REPS, env=env), open(f"{OUT}/{KERNEL}_split.json", "w"), indent=1)
print("%-5s %-32s %-60s %5s %8s %8s %s" % ("dtype", "variant", "kernel", "calls", "us", "floor", "ok"))
for r in rows:
    fl = "%.2f" % r["floor_us"] if r["floor_us"] else "-"
    print("%-5s %-32s %-60s %5d %8.2f %8s %s" % (r["dtype"], r["variant"][:32], r["kernel"][:60], r["calls"],
                                                 r["mean_us"], fl, r["ok"]))
