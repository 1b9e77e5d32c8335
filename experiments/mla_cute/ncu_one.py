"""One CuTe MLA decode call per configuration for ncu (experiments/mla_cute/ncu.sh): batch 1, 12 heads, bf16 page-64
cache; argv: context partitions cluster stages (repeated in groups of four)."""
import sys

import torch

from k3lab import registry
from k3lab.components import mla
from k3lab.ops.mla import SCALE, _cache_of

op = registry.get("mla_decode")
a = [int(x) for x in sys.argv[1:]]
for i in range(0, len(a), 4):
    ctx, P, CL, STG = a[i:i + 4]
    c = op.case(heads=12, batch=1, context=ctx, T=1, page_size=64, kv_dtype="bf16", fp8_scale="tensor", ragged=False,
                partitions="auto", pad_heads=0, dcp=1, dcp_layout="interleave")
    d = op.make_inputs(c, 0, "cuda")
    for _ in range(3):
        mla.attend(d["q_lat"], d["q_rope"], _cache_of(d), d["lengths"], scale=SCALE, backend="cute", partitions=P,
                   cluster=CL, stages=STG, n_positions=ctx + 1, check_values=False, merge=False)
    torch.cuda.synchronize()
