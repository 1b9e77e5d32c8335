"""The cute path "mma" (kernels/cute/proj_mma.py) at batch 1..8 with fp8 weights, its module settings varied: UNROLL
(chunks a warp's round) and PIPE (the next round's weights loaded into a second set of registers while this round's
MMAs run). ncu (experiments/proj_b64/mma_small.sh) had the default at 48 % of DRAM peak with 22 % occupancy and 16.5
cycles a warp between issues on TP8 moe_down batch 1: each round loads, waits, multiplies, so a warp's loads are in
flight only part of the time. Beside it in the same run: the Triton default, the cute GEMV and the stream peer. Every
arm is checked by the shared checker (fp64 reference, poisoned outputs) on one input set, then timed (graph replays,
inputs rotated past L2, k3lab.harness.timing).
Device (.gpu/cute): python3 experiments/proj_b64/mma_pipe.py $OUT   ($OUT/mma_pipe.json, a table last)"""
import json
import os
import sys

import torch

from k3lab import registry
from k3lab.harness import checker, timing
from k3lab.ops import trunk
from k3lab_kernels.cute import proj_mma as pm

OUT = sys.argv[1] if len(sys.argv) > 1 else "/tmp"
OP = registry.get("proj")
PROJS = os.environ.get("PROJS", "kda_q,kda_o,moe_down").split(",")
BATCHES = [int(b) for b in os.environ.get("BATCHES", "1,4,8").split(",")]
WDTYPES = os.environ.get("WDTYPES", "fp8").split(",")
# (name, backend, options, module settings of proj_mma)
ARMS = [("triton", "triton", {}, {}), ("gemv", "cute", {}, {}),
        ("mma", "cute", {"path": "mma"}, {"UNROLL": 4, "PIPE": False}),
        ("mma_u8", "cute", {"path": "mma"}, {"UNROLL": 8, "PIPE": False}),
        ("mma_pipe", "cute", {"path": "mma"}, {"UNROLL": 4, "PIPE": True}),
        ("mma_pipe_u2", "cute", {"path": "mma"}, {"UNROLL": 2, "PIPE": True})]
rows = []
pr = timing.probes("cuda")
for wd in WDTYPES:
    for proj in PROJS:
        for batch in BATCHES:
            case = OP.case(preset="tp8", proj=proj, batch=batch, wdtype=wd, residual=False, prologue="none")
            nb = OP.nbytes(case)
            sets = [OP.make_inputs(case, 100 + i, "cuda")
                    for i in range(timing.rotation_count(nb, timing.l2_bytes()) + 1)]
            for name, be, opts, mod in ARMS + [("stream", None, None, None)]:
                for k, v in (mod or {}).items():
                    setattr(pm, k, v)
                if be is None:
                    peer = next(p for p in trunk.proj_peers(case) if p.name == "stream")
                    made = {id(s): peer.make(s) for s in sets}
                    ok, err = None, None

                    def fn(s, made=made):
                        made[id(s)]()
                else:
                    res = checker.check(OP, case, backend=be, options=opts, inputs=sets[0])
                    ok, err = res.ok, res.worst("y0")

                    def fn(s, be=be, opts=opts, case=case):
                        OP.call(s, case, be, dict(opts), None)
                t = timing.bench_gpu(fn, input_sets=[(s,) for s in sets], reps=20, bytes_per_call=nb)
                rows.append(dict(wdtype=wd, proj=proj, batch=batch, arm=name, settings=mod, ok=ok, rel_err=err,
                                 median_us=t.median_us, samples_us=t.samples_us,
                                 floor_us=nb / (pr["read_tbps"] * 1e12) * 1e6))
                print(f"{wd:4s} {proj:9s} {batch:2d} {name:12s} {t.median_us:8.2f} us  ok={ok} err={err}", flush=True)
            json.dump(dict(probes=pr, rows=rows, env=dict(torch=torch.__version__, gpu=torch.cuda.get_device_name())),
                      open(f"{OUT}/mma_pipe.json", "w"), indent=1)
print("\nus:", " ".join(a[0] for a in ARMS), "stream")
for wd in WDTYPES:
    for proj in PROJS:
        for batch in BATCHES:
            r = [x for x in rows if (x["wdtype"], x["proj"], x["batch"]) == (wd, proj, batch)]
            print(f"{wd} {proj:9s} {batch:2d} "
                  + " ".join(f"{x['median_us']:6.2f}{'' if x['ok'] in (True, None) else '!'}" for x in r))
