"""Third call: the next chunk's page index loaded a chunk ahead; contiguous against page-64 caches.
    python experiments/mla_cute/explore3.py OUT_DIR"""
import sys
import time

from k3lab.bench import runner

out = sys.argv[1]
RUNS = [
    ("mla_cute_b1_r3", ("triton", "cute"), dict(heads=(12,), batch=(1,), context=(1024, 8192, 32768, 131072),
                                                page_size=(64, 0), cluster=(4,), pdl=(True,))),
    ("mla_cute_parts_r3", ("cute",), dict(heads=(12,), batch=(1,), context=(8192, 32768, 131072), cluster=(4, 8),
                                          partitions=(8, 16, 33), pdl=(True,))),
]
table = []
for name, backends, grid in RUNS:
    t0 = time.time()
    bd = runner.run("mla", grid=grid, ops=["mla_decode"], backends=backends, peers=False, reps=25, name=name,
                    deadline_s=200, log=lambda s: None)
    bd.save_as(f"{out}/{name}.json.gz")
    for r in bd.rows:
        x = r.extra
        opts = ",".join(f"{k}={v}" for k, v in (x.get("options") or {}).items() if v is not None)
        table.append((name, x["batch"], x.get("context", "-"), x.get("page_size"), x["partitions"], r.backend, opts,
                      r.median_us, r.pct_of_bw, r.error["ok"] if r.error else None))
    print(f"{name}: {len(bd.rows)} rows in {time.time() - t0:.0f} s", flush=True)
for t in table:
    print(f"{t[0]:<18} {t[1]:>3} {t[2]!s:>6} pg{t[3]!s:<3} {t[4]!s:>5} {t[5]:<7} {t[6]:<22} {t[7]:8.2f} {t[8]:6.1f}"
          f" {t[9]}")
