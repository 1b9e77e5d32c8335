"""The CuTe DSL MLA decode (kernels/cute/mla_decode.py) beside the Triton split kernel on the H200, one call:
    python experiments/mla_cute/explore.py OUT_DIR [DEADLINE_S]
Every row comes from `k3lab.bench.runner.run` (checked against fp64 with poisoned outputs first, then graph replay
with the inputs rotated past L2); bundles (gzipped) under OUT_DIR, a short table last.
  mla_cute_b1          batch 1, 1K..128K: triton (its defaults) and cute x cluster (8, 4) x stages (4, 2) x pdl
  mla_cute_partitions  cute at batch 1, 1K / 8K / 32K: clusters a sequence auto, 1, 2, 4, 8, 16 (cluster 8)
  mla_cute_batch       batch 4, 16, 64 at 8K: triton and cute x cluster (8, 2) x stages (4, 2)"""
from __future__ import annotations

import sys
import time

from k3lab.bench import runner

out = sys.argv[1]
deadline = time.time() + (float(sys.argv[2]) if len(sys.argv) > 2 else 480)
RUNS = [
    ("mla_cute_b1", ("triton", "cute"), dict(heads=(12,), batch=(1,), context=(1024, 8192, 32768, 131072),
                                             cluster=(None, 4), stages=(None, 2), pdl=(None, True))),
    ("mla_cute_partitions", ("cute",), dict(heads=(12,), batch=(1,), context=(1024, 8192, 32768),
                                           partitions=("auto", 1, 2, 4, 8, 16))),
    ("mla_cute_batch", ("triton", "cute"), dict(heads=(12,), batch=(4, 16, 64), context=(8192,), cluster=(None, 2),
                                                stages=(None, 2))),
]

table = []
for name, backends, grid in RUNS:
    left = deadline - time.time()
    if left < 20:
        print(f"{name}: skipped (deadline)")
        continue
    t0 = time.time()
    bd = runner.run("mla", grid=grid, ops=["mla_decode"], backends=backends, peers=False, reps=25, name=name,
                    deadline_s=left - 10, log=lambda s: None)
    bd.save_as(f"{out}/{name}.json.gz")
    for r in bd.rows:
        x = r.extra
        opts = ",".join(f"{k}={v}" for k, v in (x.get("options") or {}).items() if v is not None)
        table.append((name, x["batch"], x.get("context", "-"), x["partitions"], r.backend, opts, r.median_us,
                      r.pct_of_bw, r.error["ok"] if r.error else None))
    print(f"{name}: {len(bd.rows)} rows in {time.time() - t0:.0f} s; notes {[n[:200] for n in bd.notes]}", flush=True)
print(f"{'bundle':<20} {'B':>3} {'ctx':>6} {'P':>5} {'backend':<8} {'options':<36} {'us':>8} {'%bw':>6} ok")
for t in table:
    print(f"{t[0]:<20} {t[1]:>3} {t[2]!s:>6} {t[3]!s:>5} {t[4]:<8} {t[5]:<36} {t[6]:8.2f} {t[7]:6.1f} {t[8]}")
