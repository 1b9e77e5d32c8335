"""The CuTe GEMV's (kernels/cute/proj_gemv.py) bytes in flight a warp at batch 1: its module settings UNROLL / PRE
(steps of 512 bytes of a row a warp keeps in flight / loads first; 8 / 8 by default: 16 / 16, faster here, was
slower in the decode step, docs/NOTES_trunk.md sixty-second section;
inputs <= SHORT_K take UNROLL_SHORT / PRE_SHORT)
against the Triton default and the two stream peers of the same run (k3lab.ops.trunk.proj_peers: the weight bytes
read with no arithmetic), single projections at TP8, bf16 and fp8 weights. The idea: a 1,536-row projection is 384
CTAs of four warps (~3 an SM), each warp's 14 KB row read in rounds of UNROLL x 512 bytes; the stream peer reads
64 KB a program in one round and leads it by ~30 % at 22 MB (profiles/h100-80gb-hbm3/proj_rows61.json.gz, git
history at e88bf4d). The sixty-first session ran it through experiments/queue61/c.sh (docs/NOTES_trunk.md).
Every variant checked against fp64 by the shared checker first, then timed (graph replay, inputs rotated past L2).
Run: python experiments/proj_unroll/unroll.py $OUT [REPS]   ($OUT/proj_unroll.json after every case, a table last;
PROJS='kda_q,mla_dkv', WDTYPES='bf16', VARIANTS='[[16, 16], [28, 8]]' replace the defaults)."""
import json
import os
import sys

import torch

from k3lab import registry
from k3lab.harness import checker, env, timing
from k3lab.ops import trunk
from k3lab_kernels.cute import proj_gemv as G

OUT = sys.argv[1] if len(sys.argv) > 1 else "/tmp"
REPS = int(sys.argv[2]) if len(sys.argv) > 2 else 30
OP = registry.get("proj")
PROJS = os.environ.get("PROJS", "kda_q,mla_dkv,shared_w1,kda_o,moe_down").split(",")
WDTYPES = os.environ.get("WDTYPES", "bf16,fp8").split(",")
VARIANTS = [tuple(v) for v in json.loads(os.environ.get("VARIANTS", "[[8, 8], [16, 8], [16, 16], [28, 8]]"))]
DEFAULT = (G.UNROLL, G.PRE)
rows = []


def save():
    e = {**env.fingerprint(), **env.git_state(), "default": DEFAULT}
    json.dump(dict(probes=pr, rows=rows, reps=REPS, env=e), open(f"{OUT}/proj_unroll.json", "w"), indent=1)


def timed(label, fn_of, case, sets, floor_us, chk_ok):
    t = timing.bench_gpu(fn_of, input_sets=[(s,) for s in sets], reps=REPS)
    rows.append(dict(case=str(case), variant=label, median_us=t.median_us, p10_us=t.p10_us, p90_us=t.p90_us,
                     samples=t.samples_us, floor_us=floor_us, ok=chk_ok))
    save()
    print(case.get("proj"), case.get("wdtype"), label, round(t.median_us, 2), chk_ok, flush=True)


pr = timing.probes("cuda")
print("probes", pr, flush=True)
for wd in WDTYPES:
    for p in PROJS:
        case = OP.case(preset="tp8", proj=p, batch=1, wdtype=wd, residual=False)
        nbytes = OP.nbytes(case)
        n_sets = max(2, timing.rotation_count(nbytes, timing.l2_bytes()))
        sets = [OP.make_inputs(case, 1000 + i, "cuda") for i in range(n_sets)]
        floor_us = nbytes / (pr["read_tbps"] * 1e12) * 1e6
        chk = checker.check(OP, case, backend="triton", inputs=sets[0])
        timed("triton", lambda s, c=case: OP.call(s, c, "triton", {}, None), case, sets, floor_us, chk.ok)
        for unroll, pre in VARIANTS:
            G.UNROLL, G.PRE = unroll, pre
            label = f"cute unroll={unroll} pre={pre}"
            try:
                chk = checker.check(OP, case, backend="cute", inputs=sets[0])
                timed(label, lambda s, c=case: OP.call(s, c, "cute", {}, None), case, sets, floor_us, chk.ok)
            except Exception as e:  # a setting that fails to build is a row, not the end of the run
                rows.append(dict(case=str(case), variant=label, error=f"{type(e).__name__}: {e}"[:800]))
                save()
                print(p, wd, label, "FAILED", type(e).__name__, str(e)[:200], flush=True)
            finally:
                G.UNROLL, G.PRE = DEFAULT
        for peer in trunk.proj_peers(case):
            if peer.name in ("stream", "stream_grid"):
                calls = {}

                def fn(s, mk=peer.make, calls=calls):
                    f = calls.get(id(s))
                    if f is None:
                        f = calls[id(s)] = mk(s)
                    return f()
                for s in sets:
                    fn(s)
                timed(peer.name, fn, case, sets, floor_us, True)
        del sets
        torch.cuda.empty_cache()
save()
print("\n%-10s %-5s %-26s %9s %9s %8s %s" % ("proj", "w", "variant", "us", "p90", "floor", "ok"))
for r in rows:
    c = r["case"]
    if "error" in r:
        print("%-60s %s" % (c[:60], r["error"][:100]))
        continue
    print("%-40s %-26s %9.2f %9.2f %8.2f %s" % (c[:40], r["variant"], r["median_us"], r["p90_us"], r["floor_us"],
                                                r["ok"]))
