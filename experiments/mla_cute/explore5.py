"""Fifth call (ldmatrix .trans for V in the code): the chunk wait as a test_wait spin (SPIN, the default now) against
try_wait (which may suspend the warp: NANOSLEEP.SYNCS in the SASS), batch 1 at four contexts and batch 64 at 8K, triton
beside them.
    python experiments/mla_cute/explore5.py OUT_DIR"""
import sys

from k3lab.bench import runner  # (k3lab first: it maps kernels/ to k3lab_kernels)

import k3lab_kernels.cute.mla_decode as kdm  # noqa: E402

out = sys.argv[1]
rows = []
for spin in (True, False):
    kdm.SPIN = spin
    grid = dict(heads=(12,), batch=(1,), context=(1024, 8192, 32768, 131072), cluster=(4,), pdl=(True,))
    for name, g in ((f"mla_cute_spin{int(spin)}_b1", grid),
                    (f"mla_cute_spin{int(spin)}_b64", dict(grid, batch=(64,), context=(8192,), cluster=(2,)))):
        bd = runner.run("mla", grid=g, ops=["mla_decode"], backends=("triton", "cute") if spin else ("cute",),
                        peers=False, reps=25, name=name, deadline_s=120, log=lambda s: None)
        bd.notes.append(f"k3lab_kernels.cute.mla_decode.SPIN = {spin}")
        bd.save_as(f"{out}/{name}.json.gz")
        for r in bd.rows:
            x = r.extra
            rows.append((spin, x["batch"], x["context"], r.backend, r.median_us, r.pct_of_bw, r.error["ok"]))
for r in rows:
    print(f"spin={r[0]!s:<5} B{r[1]:<3} {r[2]:>6} {r[3]:<7} {r[4]:8.2f} {r[5]:6.1f} {r[6]}")
