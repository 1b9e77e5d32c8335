"""The MoE sweeps on the H200 (docs/NOTES_moe.md, eighth session): `python3 profiles/h200/moe_sweep.py PLAN.json`
runs `k3lab.bench.runner.run` once per plan entry ([grid, peers]) at K3's sizes (TP8, 896 experts) in one process
and merges the rows into one bundle $OUT/$NAME.json.gz (every row checked against fp64, then timed; LIMIT seconds
in all; BACKENDS: ours to time, comma-separated, default triton); the plan is kept in the bundle's config. Prints a
short table last."""
import json
import os
import sys
import time
from k3lab.bench import runner

OUT = os.environ.get("OUT", "/tmp/out")
K3 = dict(latent=[3584], inter=[3072], n_experts=[896], top_k=[16], tp=[8])
T0 = time.time()
LIMIT = float(os.environ.get("LIMIT", "200"))
NAME = os.environ.get("NAME", "moe_sweep")
PLAN = json.loads(open(sys.argv[1]).read())
bd_all = None
for i, entry in enumerate(PLAN):  # [grid, peers] or [grid, peers, reps, seconds it needs left to start]
    grid, peers = entry[0], entry[1]
    reps = entry[2] if len(entry) > 2 else int(os.environ.get("REPS", "20"))
    left = LIMIT - (time.time() - T0)
    if left < (entry[3] if len(entry) > 3 else 5):
        print("skip", grid)
        bd_all.notes.append(f"plan entry {i} not run (time limit): {grid}")
        continue
    g = dict(K3, **grid)
    bd = runner.run("moe", grid=g, backends=os.environ.get("BACKENDS", "triton").split(","), peers=peers, reps=reps,
                    deadline_s=left, kernels=False, name=NAME, log=lambda s: print(s, flush=True))
    if bd_all is None:
        bd_all = bd
        bd_all.config = dict(bd.config, plan=PLAN, driver="profiles/h200/moe_sweep.py (runner.run per plan entry, "
                             "rows merged into one bundle)")
    else:
        bd_all.rows.extend(bd.rows)
        bd_all.notes.extend(bd.notes)
    bd_all.save_as(f"{OUT}/{NAME}.json.gz")
rows = []
for r in bd_all.rows:
    x = r.extra
    opt = ",".join(f"{k}={x.get(k)}" for k in ("path", "block_n", "block_k", "block_l", "num_warps", "num_stages",
                                               "wait") if x.get(k) is not None)
    if x.get("path") is None and "path " in (x.get("ran") or {}).get("notes", ""):
        opt = "rule:" + x["ran"]["notes"].split()[1] + ("," + opt if opt else "")
    ok = (r.error or {}).get("ok")
    rows.append((x["dtype"], x["batch"], x["routing"], r.backend, opt, r.median_us, r.pct_of_bw, ok))
rows.sort()
print("\n%-6s %3s %-8s %-12s %-44s %9s %6s %s" % ("dtype", "B", "routing", "impl", "options", "us", "%bw",
                                                   "ok"))
for t in rows:
    print("%-6s %3d %-8s %-12s %-44s %9.1f %6.1f %s"
          % (t[0], t[1], t[2], t[3][:12], t[4][:44], t[5], (t[6] or 0), t[7]))
