"""A target for Nsight Compute: the MLA decode (split + merge) on one case, a few calls.
    ncu --clock-control none --kernel-name regex:_mla_split --launch-skip 2 --launch-count 1 \\
        --section SpeedOfLight --section MemoryWorkloadAnalysis --section Occupancy --section WarpStateStats \\
        python experiments/mla_tune/ncu_split.py BATCH CONTEXT"""
from __future__ import annotations

import sys

import torch

from k3lab import registry

op = registry.get("mla_decode")
case = op.case(heads=12, batch=int(sys.argv[1]), context=int(sys.argv[2]), page_size=64)
d = op.make_inputs(case, 0, "cuda")
for _ in range(4):
    op.call(d, case, "triton", {}, None)
torch.cuda.synchronize()
