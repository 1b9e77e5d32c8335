#!/bin/bash
# The column-owning KDA decode (layout "cols") on the H200: its GPU tests, then the explore bundle beside the rows
# path and FlashInfer (k3lab.ops.kda.H200_COLS); prints a short table. Carry .gpu/cute and .gpu/fi.
#   bash experiments/kda_cols/run.sh DEADLINE_S
eval "$(bash .gpu/cute/unpack.sh)"; eval "$(bash .gpu/fi/unpack.sh)"
export PYTHONPATH=$PWD:$PYTHONPATH
timeout 150 python3 -m pytest -q -m gpu tests/test_kda_cute.py -k cols 2>&1 | tail -15 > "$OUT/pytest_gpu_kda_cols.log"
tail -3 "$OUT/pytest_gpu_kda_cols.log"
python3 - "${1:-200}" <<'PY'
import os, sys, gzip, json
import k3lab.ops.kda as k
out = os.environ["OUT"]
k.h200_explore(out, k.H200_COLS, reps=10, deadline_s=float(sys.argv[1]), name="kda_cols", log=lambda s: None)
b = json.load(gzip.open(f"{out}/kda_cols.json.gz"))
rows = {}
for r in b["rows"]:
    x = r.get("extra", {})
    rows.setdefault(x.get("batch"), []).append((r.get("backend") or r.get("name"), r.get("median_us"),
                                               (r.get("error") or {}).get("ok")))
for B in sorted(k for k in rows if k is not None):
    print(B, "  ".join(f"{n}={m:.2f}{'' if ok else '!'}" if m else f"{n}=-" for n, m, ok in rows[B]))
PY
