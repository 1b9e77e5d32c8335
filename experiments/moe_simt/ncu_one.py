"""One call of the MXFP4 simt experts kernel at K3's TP8 sizes, for ncu (experiments/moe_simt/README.md):
python experiments/moe_simt/ncu_one.py BATCH (two warm-up calls, then the profiled third)."""
import sys

import torch

from k3lab import registry

B = int(sys.argv[1])
OP = registry.get("moe_experts")
case = OP.case(dtype="mxfp4", batch=B, routing="uniform", tp=8, latent=3584, inter=3072, n_experts=896, top_k=16)
sets = [OP.make_inputs(case, 1000 + i, "cuda") for i in range(3)]
for s in sets:
    OP.call(s, case, "triton", {}, None)
torch.cuda.synchronize()
