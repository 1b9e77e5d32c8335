"""One launch of a trunk projection at a batch inside an NVTX range `target` for ncu (`--nvtx --nvtx-include
target/`), after warm-up calls: ours (Triton, options as key=value), cute (the CuTe DSL GEMV), cuBLAS (torch's
F.linear) or stream (the read probe's sum over the same weight bytes), TP8, bf16 weights (WDTYPE=fp8 in the
environment: fp8).
Device: python experiments/proj_b64/one.py {ours|cute|cublas|stream} PROJ BATCH [key=value ...]   (see ncu.sh)"""
import os
import sys

from k3lab import registry
from k3lab.bench import runner
from k3lab.harness.timing import profile_once
from k3lab.ops import trunk

who, proj, batch = sys.argv[1], sys.argv[2], int(sys.argv[3])
opts = {}
for kv in sys.argv[4:]:
    k, v = kv.split("=")
    opts[k] = None if v == "null" else (v if not v.lstrip("-").isdigit() else int(v))
op = registry.get("proj")
case = op.case(preset="tp8", proj=proj, batch=batch, wdtype=os.environ.get("WDTYPE", "bf16"), residual=False,
               prologue="none")
s = op.make_inputs(case, 1234, "cuda")
if who in ("ours", "cute"):
    fn = runner._ours(op, case, "triton" if who == "ours" else "cute", opts).make(s)
else:
    fn = next(p for p in trunk.proj_peers(case) if p.name == who).make(s)
profile_once(fn)
print(who, proj, batch, opts, "ok")
