"""One call of the MXFP4 experts at K3's sizes, for ncu (experiments/moe_simt/README.md,
experiments/moe_cute/ncu.sh): python experiments/moe_simt/ncu_one.py BATCH [BACKEND [TP [PATH]]] (backend triton by
default, TP 8, the triton path by its rule unless PATH, e.g. tc; two warm-up calls, then the profiled third; ROUTING
uniform unless set, e.g. same16)."""
import os
import sys

import torch

from k3lab import registry

B = int(sys.argv[1])
BACKEND = sys.argv[2] if len(sys.argv) > 2 else "triton"
TP = int(sys.argv[3]) if len(sys.argv) > 3 else 8
OPTS = {"path": sys.argv[4]} if len(sys.argv) > 4 else {}
OP = registry.get("moe_experts")
case = OP.case(dtype="mxfp4", batch=B, routing=os.environ.get("ROUTING", "uniform"), tp=TP, latent=3584, inter=3072,
               n_experts=896, top_k=16)
sets = [OP.make_inputs(case, 1000 + i, "cuda") for i in range(3)]
for s in sets:
    OP.call(s, case, BACKEND, OPTS, None)
torch.cuda.synchronize()
