"""GPU study of the MXFP4 simt experts kernel at K3's TP8 sizes (issue 14): where its time goes and what two
latency changes buy. For batch 1 and 64 (uniform routing), every combination of
  XPRE  the next step's activations loaded with its weights (else each step loads its own before its arithmetic),
  TPRE  a persistent program takes its next ticket before the current item's work,
is checked against fp64 (the shared checker) and timed whole, role A only (w1/w3, NITEMS = NA) and role B only
(w2, NA = 0: no wait, y not zeroed), graph replay rotated past L2 (k3lab.harness.timing).
Run: python experiments/moe_simt/phases.py $OUT   (writes $OUT/moe_simt_phases.json, prints a table)."""
import json
import sys

import torch

from k3lab import registry
from k3lab.harness import checker, timing
from k3lab_kernels.triton import moe_experts as M

OUT = sys.argv[1] if len(sys.argv) > 1 else "/tmp"
OP = registry.get("moe_experts")
REAL = M._moe_simt_kernel
BATCHES = [int(b) for b in (sys.argv[2].split(",") if len(sys.argv) > 2 else ("1", "64"))]


class Phase:
    """Stands in for the kernel: launches it with NA / NITEMS changed for one role only."""

    def __init__(self, phase):
        self.phase = phase

    def __getitem__(self, grid):
        def launch(*a, **kw):
            a = list(a)
            na, nitems = a[14], a[15]
            if self.phase == "A":
                a[15] = na
            elif self.phase == "B":
                a[14], a[15] = 0, nitems - na
            return REAL[grid](*a, **kw)
        return launch


rows = []
pr = timing.probes("cuda")
print("probes", pr, flush=True)
for B in BATCHES:
    case = OP.case(dtype="mxfp4", batch=B, routing="uniform", tp=8, latent=3584, inter=3072, n_experts=896,
                   top_k=16)
    nbytes = OP.nbytes(case)
    n_sets = max(2, timing.rotation_count(nbytes, timing.l2_bytes()))
    sets = [OP.make_inputs(case, 1000 + i, "cuda") for i in range(n_sets)]
    floor_us = nbytes / (pr["read_tbps"] * 1e12) * 1e6
    for xpre in (False, True):
        for tpre in (False, True):
            if B == 1 and tpre:
                continue  # one item a program at batch 1: no next ticket
            M.SIMT_XPRE, M.SIMT_TPRE = xpre, tpre
            chk = checker.check(OP, case, backend="triton", options={}, inputs=sets[0])
            for phase in ("all", "A", "B"):
                M._moe_simt_kernel = REAL if phase == "all" else Phase(phase)
                try:
                    t = timing.bench_gpu(lambda s: OP.call(s, case, "triton", {}, None),
                                         input_sets=[(s,) for s in sets], reps=15)
                finally:
                    M._moe_simt_kernel = REAL
                r = dict(batch=B, xpre=xpre, tpre=tpre, phase=phase, median_us=t.median_us, samples=t.samples_us,
                         floor_us=floor_us, ok=chk.ok, failures=chk.failures[:3], sets=n_sets)
                rows.append(r)
                print(B, xpre, tpre, phase, round(t.median_us, 2), chk.ok, flush=True)
    del sets
    torch.cuda.empty_cache()
M.SIMT_XPRE = M.SIMT_TPRE = False
json.dump(dict(probes=pr, rows=rows, env=dict(torch=torch.__version__, gpu=torch.cuda.get_device_name())),
          open(f"{OUT}/moe_simt_phases.json", "w"), indent=1)
print("\n%3s %5s %5s %5s %9s %8s %s" % ("B", "xpre", "tpre", "phase", "us", "floor", "ok"))
for r in rows:
    print("%3d %5s %5s %5s %9.2f %8.2f %s" % (r["batch"], r["xpre"], r["tpre"], r["phase"], r["median_us"],
                                               r["floor_us"], r["ok"]))
