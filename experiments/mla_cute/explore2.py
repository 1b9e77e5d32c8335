"""second call: after the Q/K register fix"""
import sys
import time
from k3lab.bench import runner
out = sys.argv[1]
RUNS = [
    ("mla_cute_b1_r2", ("triton", "cute"), dict(heads=(12,), batch=(1,), context=(1024, 8192, 32768, 131072),
                                                cluster=(None, 4), pdl=(True,))),
    ("mla_cute_parts_r2", ("cute",), dict(heads=(12,), batch=(1,), context=(1024, 8192, 32768), cluster=(4, 8),
                                          partitions=(2, 4, 8, 16, 33), pdl=(True,))),
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
        table.append((name, x["batch"], x.get("context", "-"), x["partitions"], r.backend, opts, r.median_us,
                      r.pct_of_bw, r.error["ok"] if r.error else None))
    print(f"{name}: {len(bd.rows)} rows in {time.time() - t0:.0f} s", flush=True)
for t in table:
    print(f"{t[0]:<18} {t[1]:>3} {t[2]!s:>6} {t[3]!s:>5} {t[4]:<7} {t[5]:<28} {t[6]:8.2f} {t[7]:6.1f} {t[8]}")
