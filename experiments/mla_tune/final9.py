"""The ninth session's evidence call on the H200: bundles (gzipped) under OUT_DIR, a short table last.
    python experiments/mla_tune/final9.py OUT_DIR
Our rows come from `k3lab.bench.runner.run` (every row checked against fp64, timed by graph replay rotated
past L2); FlashInfer's fa3 rows (its JIT build, ~20 s, once) are added to the decode bundles with the same
runner, checker and timer on the same seeded input sets (fa2, the reference and torch.compile are left out to
fit the call: the seventh session's bundles in git history have them; the reference code did not change).
  mla_decode        batch 1, 1K..128K: pdl x host_chunk, + fa3
  mla_decode_b64    batch 64, 1K..32K: pdl x host_chunk x num_stages (rule, 4), + fa3
  mla_verify        batch 1, 32K: T = 1, 4 x block_m 16, 64
  mla_partitions    the automatic partition count against swept ones (batch 1 at four contexts, batch 64 at 8K)
  mla_combine_premerge   the combine at batch 1 (premerge through the merge kernel above 8 partials) x pdl"""
from __future__ import annotations

import sys
import time

import torch

from k3lab import registry
from k3lab.bench import runner
from k3lab.harness import roofline, timing

out = sys.argv[1]
PEERS = ("flashinfer_fa3",)
B1 = dict(heads=(12,), batch=(1,), context=(1024, 8192, 32768, 131072))
B64 = dict(heads=(12,), batch=(64,), context=(1024, 8192, 32768))
RUNS = [
    ("mla_decode", ["mla_decode"], dict(B1, pdl=(False, True), host_chunk=(False, True)), True),
    ("mla_decode_b64", ["mla_decode"], dict(B64, pdl=(False, True), host_chunk=(False, True), num_stages=(None, 4)),
     True),
    ("mla_verify", ["mla_decode"], dict(heads=(12,), batch=(1,), context=(32768,), T=(1, 4), block_m=(16, 64)), False),
    ("mla_partitions", ["mla_decode"], dict(B1, partitions=("auto", 16, 33, 66, 132, 264)), False),
    ("mla_partitions_b64", ["mla_decode"], dict(heads=(12,), batch=(64,), context=(8192,),
                                                partitions=("auto", 2, 4, 8)), False),
    ("mla_combine_premerge", ["mla_combine"], dict(heads=(12,), batch=(1,), partitions=(1, 4, 33, 132, 264),
                                                   pdl=(False, True)), False),
]


def peer_rows(bd, op, grid):
    """FlashInfer rows for every case of `grid`, through the runner's own row function."""
    pr = timing.probes("cuda")
    for case in op.cases({k: v for k, v in grid.items() if k in op.axes}):
        peers = [p for p in op.peers(case) if p.name in PEERS]
        if not peers:
            continue
        nbytes, flops = op.nbytes(case), op.flops(case)
        n_sets = max(2, timing.rotation_count(nbytes, timing.l2_bytes()))
        sets = [op.make_inputs(case, 1000 + i, "cuda") for i in range(n_sets)]
        fl = roofline.floor_from_probes(nbytes, flops, pr, op.floor_bw)
        for p in peers:
            chk = (lambda s, p=p, case=case: p.check(case, s)) if p.check is not None else None
            row = runner._row(op, case, runner.Impl(p.name, p.make, chk, {}, p.note), sets, fl, reps=25, hot=False,
                              gpu=True, kernels=True, log=print)
            if isinstance(row, str):
                bd.notes.append(row)
            else:
                bd.add(row)
                bd.backends_ran.setdefault(p.name, p.note or p.name)
        del sets
        torch.cuda.empty_cache()


table = []
for name, ops, grid, peers in RUNS:
    t0 = time.time()
    bd = runner.run("mla", grid=grid, ops=ops, backends=("triton",), peers=False, reps=25, name=name,
                    log=lambda s: None)
    if peers:
        peer_rows(bd, registry.get(ops[0]), grid)
        bd.config["peers"] = list(PEERS)
    bd.save_as(f"{out}/{name}.json.gz")
    for r in bd.rows:
        x = r.extra
        opts = ",".join(f"{k}={v}" for k, v in (x.get("options") or {}).items() if v is not None)
        table.append((name, x["batch"], x.get("context", "-"), x["T"], x["partitions"], r.backend, opts, r.median_us,
                      r.pct_of_bw, r.error["ok"] if r.error else None))
    print(f"{name}: {len(bd.rows)} rows in {time.time() - t0:.0f} s; notes {[n[:160] for n in bd.notes]}", flush=True)
print(f"{'bundle':<20} {'B':>3} {'ctx':>6} {'T':>2} {'P':>5} {'backend':<15} {'options':<44} {'us':>8} {'%bw':>6} ok")
for t in table:
    print(f"{t[0]:<20} {t[1]:>3} {t[2]!s:>6} {t[3]:>2} {t[4]!s:>5} {t[5]:<15} {t[6]:<44} {t[7]:8.2f} {t[8]:6.1f}"
          f" {t[9]}")
