"""Where the batch-1 MLA decode's time goes: each kernel's GPU duration and the gaps between them, at batch 1 and
contexts 1K / 8K / 32K (default options: split + merge), read from a torch.profiler trace of CUDA-graph replays
(the calls cycle over input sets larger than L2, as the harness timer does), beside the harness's graph-replay
median of the same call. Prints a table; writes $OUT/mla_kernels_b1.json.
Device: python experiments/mla_tune/kernels_b1.py"""
import json
import os
import statistics
import tempfile

import torch

from k3lab import registry
from k3lab.harness import timing

op = registry.get("mla_decode")
res = {}
for ctx in (1024, 8192, 32768):
    case = op.case(batch=1, context=ctx)
    n = max(2, timing.rotation_count(op.nbytes(case), timing.l2_bytes()))
    sets = [op.make_inputs(case, 77 + i, "cuda") for i in range(n)]
    med = timing.bench_gpu(lambda s, c=case: op.call(s, c, "triton", {}, None), input_sets=[(s,) for s in sets],
                           reps=30).median_us
    for s in sets:
        op.call(s, case, "triton", {}, None)
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for s in sets:
            op.call(s, case, "triton", {}, None)
    g.replay()
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(5):
            g.replay()
        torch.cuda.synchronize()
    path = os.path.join(tempfile.mkdtemp(), "t.json")
    prof.export_chrome_trace(path)
    ev = sorted((e for e in json.load(open(path))["traceEvents"] if e.get("cat") == "kernel"), key=lambda e: e["ts"])
    per, gaps = {}, {}
    for a, b in zip(ev, ev[1:] + [None]):
        per.setdefault(a["name"][:60], []).append(a["dur"])
        if b is not None:
            gaps.setdefault(a["name"][:30] + " -> " + b["name"][:30], []).append(b["ts"] - (a["ts"] + a["dur"]))
    res[ctx] = {"graph_median_us": med, "sets": n,
                "kernel_us": {k: statistics.median(v) for k, v in per.items()},
                "gap_us": {k: statistics.median(v) for k, v in gaps.items()}}
    print(f"context {ctx}: graph median {med:.2f} us a call ({n} sets)")
    for k, v in res[ctx]["kernel_us"].items():
        print(f"   kernel {v:8.2f}  {k}")
    for k, v in res[ctx]["gap_us"].items():
        print(f"   gap    {v:8.2f}  {k}")
with open(os.path.join(os.environ.get("OUT", "/tmp"), "mla_kernels_b1.json"), "w") as fh:
    json.dump(res, fh, indent=1)
