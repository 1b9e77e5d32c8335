"""One KDA decode launch of ours (the production `auto` CuTe path) or FlashInfer's fused decode at a batch, inside
an NVTX range `target` for ncu (`--nvtx --nvtx-include target/`), after warm-up calls that compile both.
Device: python experiments/kda_ncu/one.py {ours|fi} BATCH (see ncu.sh)."""
import sys

from k3lab import registry
from k3lab.bench import runner
from k3lab.harness.timing import profile_once
from k3lab.ops import kda

who, batch = sys.argv[1], int(sys.argv[2])
op = registry.get("kda_decode")
case = op.case(batch=batch, heads=12)
s = op.make_inputs(case, 1234, "cuda")
if who == "ours":
    fn = runner._ours(op, case, "cute", {}).make(s)
else:
    fn = kda.flashinfer_peer(case)[0].make(s)
profile_once(fn)
print(who, batch, "ok")
