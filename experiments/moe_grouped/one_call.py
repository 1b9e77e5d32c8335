"""One call of the MoE experts at K3's pool (896 experts, latent 3584, MXFP4, TP8) for a profiler to catch: after a
warm-up call (the CuTe DSL compile), NVTX range "profiled" holds one call. For ncu:

    ncu --clock-control none --nvtx --nvtx-include "profiled/" --section SpeedOfLight --section Occupancy \\
        --section WarpStateStats --section SchedulerStats --section InstructionStats \\
        python experiments/moe_grouped/one_call.py BATCH ROUTING [BACKEND]

(BACKEND cute by default: the grouped kernels above batch 1; DTYPE=bf16|fp8 for the dense pools, mxfp4 by
default)."""
import os
import sys

from k3lab import registry
from k3lab.harness.timing import profile_once

B = int(sys.argv[1]) if len(sys.argv) > 1 else 64
ROUTING = sys.argv[2] if len(sys.argv) > 2 else "uniform"
BE = sys.argv[3] if len(sys.argv) > 3 else "cute"
OP = registry.get("moe_experts")
case = OP.case(dtype=os.environ.get("DTYPE", "mxfp4"), batch=B, routing=ROUTING, tp=8, latent=3584, inter=3072,
               n_experts=896, top_k=16)
d = OP.make_inputs(case, 0, "cuda")
profile_once(lambda: OP.call(d, case, BE, {}, None), range_name="profiled", warmup=1)
print("done", B, ROUTING, BE)
