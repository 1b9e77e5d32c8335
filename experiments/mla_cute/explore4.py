"""Fourth call: batch 4 / 16 / 64 at 8K with the code of the third (triton beside cute, cluster 2 and 4).
    python experiments/mla_cute/explore4.py OUT_DIR"""
import sys

from k3lab.bench import runner

out = sys.argv[1]
bd = runner.run("mla", grid=dict(heads=(12,), batch=(4, 16, 64), context=(8192,), cluster=(2, 4), pdl=(True,)),
                ops=["mla_decode"], backends=("triton", "cute"), peers=False, reps=25, name="mla_cute_batch_r4",
                deadline_s=150, log=lambda s: None)
bd.save_as(f"{out}/mla_cute_batch_r4.json.gz")
for r in bd.rows:
    x = r.extra
    opts = ",".join(f"{k}={v}" for k, v in (x.get("options") or {}).items() if v is not None)
    print(f"{x['batch']:>3} {x['context']:>6} {r.backend:<7} {opts:<22} {r.median_us:8.2f} {r.pct_of_bw:6.1f} "
          f"{r.error['ok'] if r.error else None}")
