"""One launch of ours at a registry case inside an NVTX range `target` for ncu (`--nvtx --nvtx-include target/`), after
warm-up calls that compile it: the fp8 one-token experts and the fp8 / bf16 batch-1 CuTe GEMV (moe_down, TP8), where
issue 13's and 14's fp8 rows sit furthest from their floors.
Device: python experiments/queue65/one.py {moe_fp8|moe_bf16|proj_fp8|proj_bf16} (see ncu.sh)."""
import sys

from k3lab import registry
from k3lab.bench import runner
from k3lab.harness.timing import profile_once

CASES = {
    "moe_fp8": ("moe_experts", dict(batch=1, dtype="fp8", inter=3072, latent=3584, n_experts=896, routing="uniform",
                                    top_k=16, tp=8)),
    "moe_bf16": ("moe_experts", dict(batch=1, dtype="bf16", inter=3072, latent=3584, n_experts=896,
                                     routing="uniform", top_k=16, tp=8)),
    "proj_fp8": ("proj", dict(batch=1, preset="tp8", proj="moe_down", wdtype="fp8", residual=False)),
    "proj_bf16": ("proj", dict(batch=1, preset="tp8", proj="moe_down", wdtype="bf16", residual=False)),
}
name, kw = CASES[sys.argv[1]]
op = registry.get(name)
case = op.case(**kw)
s = op.make_inputs(case, 1234, "cuda")
profile_once(runner._ours(op, case, "cute", {}).make(s))
print(sys.argv[1], "ok")
