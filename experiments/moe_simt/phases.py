"""GPU study of the MXFP4 simt experts kernel at K3's TP8 sizes (issue 14): where its time goes and what two
latency changes buy. For batch 1 and 64 (uniform routing), each
variant (launch options: warps, a register cap `maxnreg`, programs a multiprocessor) is checked against fp64 (the
shared checker) and timed whole, or role A only (w1/w3, NITEMS = NA) or role B only (w2, NA = 0: no wait, y not
zeroed) when PHASES says, graph replay rotated past L2 (k3lab.harness.timing). The first run (XPRE / TPRE study
flags, phases) is in experiments/moe_simt/README.md.
Run: python experiments/moe_simt/phases.py $OUT   (writes $OUT/moe_simt_phases.json, prints a table)."""
import json
import os
import sys

import torch

from k3lab import registry
from k3lab.harness import checker, timing
from k3lab_kernels.triton import moe_experts as M

OUT = sys.argv[1] if len(sys.argv) > 1 else "/tmp"
OP = registry.get("moe_experts")
REAL = M._moe_simt_kernel
PHASES = ("all",)
VARIANTS = [("base", {}, {})]  # (name, launch options, component knobs[, kernel-file constants]); VARIANTS_JSON
# replaces the list
if os.environ.get("VARIANTS_JSON"):
    VARIANTS = [tuple(v) for v in json.loads(os.environ["VARIANTS_JSON"])]
BATCHES = [int(b) for b in (sys.argv[2].split(",") if len(sys.argv) > 2 else ("1", "64"))]


def _moe_simt_arg(name: str) -> int:
    """The position of a runtime argument of the kernel (its signature changes between runs)."""
    return REAL.arg_names.index(name)


class Phase:
    """Stands in for the kernel: launches it with NA / NITEMS changed for one role only ("A", "B"; "all": both),
    and the launch options in `over` (num_warps, maxnreg); keeps the compiled kernel's registers and spills."""

    def __init__(self, phase, **over):
        self.phase, self.over, self.regs = phase, over, None

    def __getitem__(self, grid):
        def launch(*a, **kw):
            a = list(a)
            i_na = _moe_simt_arg("NA")  # (with `leaders` the kernel sizes its roles itself: phases "all" only)
            na, nitems = a[i_na], a[i_na + 1]
            if self.phase == "A":
                a[i_na + 1] = na
            elif self.phase == "B":
                a[i_na], a[i_na + 1] = 0, nitems - na
            k = REAL[grid](*a, **dict(kw, **self.over))
            if self.regs is None and hasattr(k, "n_regs"):
                self.regs = (k.n_regs, k.n_spills)
            return k
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
    for name, over, opts, *mod in VARIANTS:
        if B == 1 and opts.get("persist"):
            continue
        saved = {k: getattr(M, k) for k in (mod[0] if mod else {})}  # module constants of the kernel file (run 4:
        for k, v in (mod[0] if mod else {}).items():                  # SIMT_CHAINS, since removed)
            setattr(M, k, v)
        M._moe_simt_kernel = Phase("all", **over)
        try:
            chk = checker.check(OP, case, backend="triton", options=opts, inputs=sets[0])
        finally:
            M._moe_simt_kernel = REAL
        for phase in PHASES:
            K = Phase(phase, **over)
            M._moe_simt_kernel = K
            try:
                t = timing.bench_gpu(lambda s, c=case, o=opts: OP.call(s, c, "triton", o, None),
                                     input_sets=[(s,) for s in sets], reps=15)
            except Exception as e:  # noqa: BLE001
                print(B, name, phase, type(e).__name__, str(e)[:200], flush=True)
                continue
            finally:
                M._moe_simt_kernel = REAL
            r = dict(batch=B, variant=name, over=over, opts=opts, phase=phase, median_us=t.median_us,
                     samples=t.samples_us, floor_us=floor_us, ok=chk.ok, failures=chk.failures[:3], sets=n_sets,
                     regs=K.regs)
            rows.append(r)
            print(B, name, phase, round(t.median_us, 2), chk.ok, K.regs, flush=True)
        for k, v in saved.items():
            setattr(M, k, v)
    del sets
    torch.cuda.empty_cache()
json.dump(dict(probes=pr, rows=rows, env=dict(torch=torch.__version__, gpu=torch.cuda.get_device_name())),
          open(f"{OUT}/moe_simt_phases.json", "w"), indent=1)
print("\n%3s %-24s %5s %9s %8s %-10s %s" % ("B", "variant", "phase", "us", "floor", "regs", "ok"))
for r in rows:
    print("%3d %-24s %5s %9.2f %8.2f %-10s %s" % (r["batch"], r["variant"], r["phase"], r["median_us"],
                                                  r["floor_us"], r["regs"], r["ok"]))
