"""Sixth call (ldmatrix .trans for V in the code): how rows reach shared memory, A/B in one process: cp.async 16 bytes
a thread (COPY = "async", the default now) against bulk copies a row (COPY = "bulk") waited for by a test_wait spin
(SPIN) or by try_wait (which may suspend the warp: NANOSLEEP.SYNCS in the SASS); batch 1 at four contexts and batch 64
at 8K (the automatic cluster and partitions), triton beside them.
    python experiments/mla_cute/explore6.py OUT_DIR     (at f4f848a only: COPY and SPIN were removed after it)"""
import sys

from k3lab.bench import runner  # (k3lab first: it maps kernels/ to k3lab_kernels)

import k3lab_kernels.cute.mla_decode as kdm  # noqa: E402

out = sys.argv[1]
rows = []
for arm, (copy, spin) in {"async": ("async", True), "bulk_spin": ("bulk", True), "bulk_wait": ("bulk", False)}.items():
    kdm.COPY, kdm.SPIN = copy, spin
    grid = dict(heads=(12,), batch=(1,), context=(1024, 8192, 32768, 131072), cluster=(None,), pdl=(True,))
    for name, g in ((f"mla_cute_{arm}_b1", grid),
                    (f"mla_cute_{arm}_b64", dict(grid, batch=(64,), context=(8192,)))):
        bd = runner.run("mla", grid=g, ops=["mla_decode"], backends=("triton", "cute") if arm == "async" else ("cute",),
                        peers=False, reps=25, name=name, deadline_s=120, log=lambda s: None)
        bd.notes.append(f"k3lab_kernels.cute.mla_decode.COPY = {copy!r}, SPIN = {spin}")
        bd.save_as(f"{out}/{name}.json.gz")
        for r in bd.rows:
            x = r.extra
            rows.append((arm, x["batch"], x["context"], r.backend, r.median_us, r.pct_of_bw, r.error["ok"]))
for r in rows:
    print(f"{r[0]:<10} B{r[1]:<3} {r[2]:>6} {r[3]:<7} {r[4]:8.2f} {r[5]:6.1f} {r[6]}")
