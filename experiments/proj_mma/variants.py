"""GPU study of the few-token tensor-core projection (kernels/cute/proj_mma.py, path "mma" of the cute projection;
issue 13) at K3's TP8 shapes: its module settings (UNROLL chunks a round, CHAINS accumulator chains, X_SMEM x staged in
shared memory), row tiles and cluster sizes, each set checked
against fp64 by the shared checker, then timed (graph replay, inputs rotated past L2, k3lab.harness.timing) beside
Triton's default and the cute GEMV of the same run.
Run: python experiments/proj_mma/variants.py $OUT [REPS]   (writes $OUT/proj_mma_variants.json, prints a table)
     VARIANTS='[{"X_SMEM": false}]' CLUSTERS=null,4,8 TILES=null,16,64 BATCHES=4,8 PROJS=kda_q WDTYPES=fp8 ..."""
import importlib
import json
import os
import sys

import torch

from k3lab import registry
from k3lab.harness import checker, timing

M = importlib.import_module("k3lab_kernels.cute.proj_mma")
OUT = sys.argv[1] if len(sys.argv) > 1 else "/tmp"
REPS = int(sys.argv[2]) if len(sys.argv) > 2 else 20
OP = registry.get("proj")
VARIANTS = json.loads(os.environ.get("VARIANTS", '[{}, {"X_SMEM": false}, {"UNROLL": 2}, {"CHAINS": 1}]'))
CLUSTERS = [None if c == "null" else int(c) for c in os.environ.get("CLUSTERS", "null").split(",")]
TILES = [None if c == "null" else int(c) for c in os.environ.get("TILES", "null").split(",")]
BATCHES = [int(b) for b in os.environ.get("BATCHES", "2,4,8,16").split(",")]
PROJS = os.environ.get("PROJS", "kda_q,kda_o,moe_down,mla_dkv").split(",")
WDTYPES = os.environ.get("WDTYPES", "bf16,fp8").split(",")
DEFAULTS = {k: getattr(M, k) for k in sorted({k for f in VARIANTS for k in f})}

rows = []
pr = timing.probes("cuda")
print("probes", pr, flush=True)
for wdtype, proj, batch in [(w, p, b) for w in WDTYPES for p in PROJS for b in BATCHES]:
    case = OP.case(preset="tp8", proj=proj, batch=batch, wdtype=wdtype, residual=proj == "kda_o", prologue="none")
    nbytes = OP.nbytes(case)
    n_sets = max(2, timing.rotation_count(nbytes, timing.l2_bytes()))
    sets = [OP.make_inputs(case, 1000 + i, "cuda") for i in range(n_sets)]
    floor_us = nbytes / (pr["read_tbps"] * 1e12) * 1e6
    arms = [("triton", {}, None), ("cute", {"path": "gemv"}, None)]
    arms += [("cute", {"path": "mma", "cluster": c, "tile_m": tm}, f) for f in VARIANTS for c in CLUSTERS
             for tm in TILES]
    for be, opts, flags in arms:
        for k, v in (flags or {}).items():
            setattr(M, k, v)
        name = be + "".join(f" {k}={v}" for k, v in opts.items() if v is not None) + "".join(
            f" {k.lower()}={v}" for k, v in (flags or {}).items())
        try:
            chk = checker.check(OP, case, backend=be, options=opts, inputs=sets[0])
            t = timing.bench_gpu(lambda s, c=case, b=be, o=opts: OP.call(s, c, b, o, None),
                                 input_sets=[(s,) for s in sets], reps=REPS)
        except Exception as e:  # a variant that fails to build or launch is a row, not the end of the run
            print(wdtype, proj, batch, name, "FAILED", type(e).__name__, str(e)[:300], flush=True)
            rows.append(dict(wdtype=wdtype, proj=proj, batch=batch, variant=name,
                             error=f"{type(e).__name__}: {e}"[:1000]))
            continue
        finally:
            for k, v in DEFAULTS.items():
                setattr(M, k, v)
        rows.append(dict(wdtype=wdtype, proj=proj, batch=batch, variant=name, median_us=t.median_us, p10_us=t.p10_us,
                         p90_us=t.p90_us, samples=t.samples_us, floor_us=floor_us, ok=chk.ok,
                         failures=chk.failures[:3], sets=n_sets))
        print(wdtype, proj, batch, name, round(t.median_us, 2), chk.ok, flush=True)
    del sets
    torch.cuda.empty_cache()
    # after every case: a run cut short by its call's limit keeps what it measured
    env = dict(torch=torch.__version__, gpu=torch.cuda.get_device_name())
    json.dump(dict(probes=pr, rows=rows, reps=REPS, env=env), open(f"{OUT}/proj_mma_variants.json", "w"), indent=1)
print("\n%-5s %-9s %5s %-44s %9s %9s %8s %s" % ("w", "proj", "batch", "variant", "us", "p90", "floor", "ok"))
for r in rows:
    if "error" in r:
        print("%-5s %-9s %5d %-44s %s" % (r["wdtype"], r["proj"], r["batch"], r["variant"], r["error"][:90]))
        continue
    print("%-5s %-9s %5d %-44s %9.2f %9.2f %8.2f %s" % (r["wdtype"], r["proj"], r["batch"], r["variant"],
                                                         r["median_us"], r["p90_us"], r["floor_us"], r["ok"]))
