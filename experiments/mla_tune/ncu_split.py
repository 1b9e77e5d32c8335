"""A target for Nsight Compute: the MLA decode (split + merge) on one case, a few calls.
    ncu --clock-control none --kernel-name regex:_mla_split --launch-skip 4 --launch-count 2 \\
        --section SpeedOfLight --section MemoryWorkloadAnalysis --section Occupancy --section WarpStateStats \\
        python experiments/mla_tune/ncu_split.py BATCH CONTEXT [OPTION=VALUE ...]   (e.g. fuse_merge=true)"""
from __future__ import annotations

import sys

import torch

from k3lab import registry

op = registry.get("mla_decode")
case = op.case(heads=12, batch=int(sys.argv[1]), context=int(sys.argv[2]), page_size=64)
d = op.make_inputs(case, 0, "cuda")
opts = {k: {"true": True, "false": False}.get(v, int(v) if v.isdigit() else v)
        for k, v in (a.split("=", 1) for a in sys.argv[3:])}
for _ in range(6):
    op.call(d, case, "triton", opts, None)
torch.cuda.synchronize()
