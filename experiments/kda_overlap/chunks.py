"""The CuTe KDA decode (kernels/cute/kda_decode.py) at tile 128 with its state in CHUNKS column chunks (each chunk's
stores issued once its own sums are joined; 8: a warp's own 16 columns, joined by its shuffles) against the
whole-state order (CHUNKS 1, the default), plain and with pdl, at batch 1..64, 12 heads (issue 16: batch 16 is 1.09x
FlashInfer's fused decode on the H200). Every variant checked against fp64 by the shared checker first, then timed
by the harness (graph replay, inputs rotated past L2). CHUNKS lost and was removed (docs/NOTES_kda.md, sixty-fourth
section): run this at 8314089, the code it timed.
Run: python experiments/kda_overlap/chunks.py $OUT [REPS]   ($OUT/kda_chunks.json after every case, a table last;
BATCHES='16,8' replaces the batches)."""
import json
import os
import sys

from k3lab import registry
from k3lab.harness import checker, env, timing
from k3lab_kernels.cute import kda_decode as KD

OUT = sys.argv[1] if len(sys.argv) > 1 else "/tmp"
REPS = int(sys.argv[2]) if len(sys.argv) > 2 else 30
OP = registry.get("kda_decode")
BATCHES = [int(b) for b in os.environ.get("BATCHES", "16,8,24,64,12,32,4,1").split(",")]
rows = []


def save():
    e = {**env.fingerprint(), **env.git_state()}
    json.dump(dict(probes=pr, rows=rows, reps=REPS, env=e), open(f"{OUT}/kda_chunks.json", "w"), indent=1)


pr = timing.probes("cuda")
print("probes", pr, flush=True)
for B in BATCHES:
    case = OP.case(heads=12, batch=B, T=1)
    nbytes = OP.nbytes(case)
    n_sets = max(2, timing.rotation_count(nbytes, timing.l2_bytes()))
    sets = [OP.make_inputs(case, 1000 + i, "cuda") for i in range(n_sets)]
    floor_us = nbytes / (pr["copy_tbps"] * 1e12) * 1e6
    for pdl in (False, True):
        for ch in (1, 8, 4, 2):
            KD.CHUNKS = ch
            opts = {"tile_v": 128, "pdl": pdl}
            label = f"chunks={ch}" + (" pdl" if pdl else "")
            try:
                chk = checker.check(OP, case, backend="cute", options=opts, inputs=sets[0])
                t = timing.bench_gpu(lambda s, o=opts, c=case: OP.call(s, c, "cute", o, None),
                                     input_sets=[(s,) for s in sets], reps=REPS)
                rows.append(dict(batch=B, chunks=ch, pdl=pdl, median_us=t.median_us, p10_us=t.p10_us,
                                 p90_us=t.p90_us, samples=t.samples_us, floor_us=floor_us, ok=chk.ok,
                                 sets=t.input_sets))
                print(f"b{B:3d} {label:14s} {t.median_us:7.2f} us  floor {floor_us:.2f}  {'ok' if chk.ok else 'FAIL'}",
                      flush=True)
            except Exception as e:  # a variant that fails to build is a row, not the end of the run
                rows.append(dict(batch=B, chunks=ch, pdl=pdl, error=f"{type(e).__name__}: {e}"[:800]))
                print(f"b{B} {label} FAILED {type(e).__name__}: {str(e)[:300]}", flush=True)
            finally:
                KD.CHUNKS = 1
            save()
COLS = [(c, p) for p in (False, True) for c in (1, 2, 4, 8)]
print("\nbatch  " + "  ".join(f"{'c' + str(c) + (' pdl' if p else ''):>9s}" for c, p in COLS))
for B in BATCHES:
    got = {(r["chunks"], r["pdl"]): r.get("median_us") for r in rows if r["batch"] == B}
    print(f"{B:5d}  " + "  ".join(f"{got.get(k) or float('nan'):9.2f}" for k in COLS))
