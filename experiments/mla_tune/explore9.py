"""The ninth session's exploration on the H200 (one device call): the decode split kernel's variants beside
the kernel as it was, every row checked against fp64 by `k3lab bench`'s checker, rotated past L2.
    python experiments/mla_tune/explore9.py OUT_DIR [DEADLINE_S]
Bundles OUT_DIR/e9_*.json.gz; a short table last. Variants (options of mla_decode):
    preload_pages 0 (the page index loaded in the block loop: one buffer) / 64 (indices preloaded: the
    pipeliner double-buffers the rows at num_stages 3), fused (one launch, last program merges), pdl (the
    split triggers the merge after its stores), merge_block_c 128 (the old merge tiling) / 32."""
from __future__ import annotations

import sys
import time

from k3lab.bench import runner

out = sys.argv[1]
deadline = float(sys.argv[2]) if len(sys.argv) > 2 else 120.0
t_end = time.time() + deadline
B1 = dict(heads=(12,), batch=(1,), context=(1024, 8192, 32768, 131072))
RUNS = [  # in priority order (the deadline skips the last)
    ("e9_b1", dict(B1, preload_pages=(0, 64), fused=(False, True), pdl=(False, True))),
    ("e9_b1_old", dict(B1, preload_pages=(0,), merge_block_c=(128,))),
    ("e9_b64", dict(heads=(12,), batch=(64,), context=(1024, 8192), preload_pages=(0, 64), block_n=(32, 64),
                    num_stages=(2, 3))),
    ("e9_b1_parts", dict(heads=(12,), batch=(1,), context=(1024, 8192), partitions=(8, 16, 32, 64, 132),
                         fused=(False, True))),
    ("e9_b64_w8", dict(heads=(12,), batch=(64,), context=(8192,), preload_pages=(64,), block_n=(64,),
                       num_stages=(3, 4), num_warps=(8,))),
    ("e9_verify", dict(heads=(12,), batch=(1,), context=(32768,), T=(1, 4), block_m=(16, 64))),
]
table = []
for name, grid in RUNS:
    left = t_end - time.time()
    if left < 5:
        print(f"{name}: skipped (deadline)")
        continue
    bd = runner.run("mla", grid=grid, ops=["mla_decode"], backends=("triton",), peers=False, reps=10,
                    deadline_s=left, name=name, log=lambda s: None)
    bd.save_as(f"{out}/{name}.json.gz")
    for r in bd.rows:
        x = r.extra
        opts = ",".join(f"{k}={v}" for k, v in x["options"].items() if v is not None)
        table.append((name, x["batch"], x["context"], x["T"], x["partitions"], opts, r.median_us, r.pct_of_bw,
                      r.error["ok"] if r.error else None, x.get("ran", {}).get("notes", "")))
    print(f"{name}: {len(bd.rows)} rows, notes {[n[:200] for n in bd.notes]}", flush=True)
print(f"{'run':<12} {'B':>3} {'ctx':>6} {'T':>2} {'P':>5} {'options':<58} {'us':>8} {'%bw':>6} ok  K")
for t in table:
    print(f"{t[0]:<12} {t[1]:>3} {t[2]:>6} {t[3]:>2} {str(t[4]):>5} {t[5]:<58} {t[6]:8.2f} {t[7]:6.1f} {t[8]!s:<4}"
          f" {t[9]}")
