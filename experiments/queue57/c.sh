#!/usr/bin/env bash
# The fifty-seventh session's combine call (CuTe DSL unpacked by a.sh, or .gpu/cute carried): the MLA combine's
# one-row kernel (block_r 1) against the rows kernel with and without premerge at 2..16 query rows (batch 2 / 4 x
# T 1 / 2 / 4; bundle mla_combine_rowk57), and above 16 rows at T > 1, where the rule's premerge is unmeasured
# (batch 8 / 16 x T 2 / 4, Triton with and without premerge against cute; bundle mla_combine_t2big57).
# Device: bash experiments/queue57/c.sh    (everything under $OUT/q)
set -uo pipefail
. experiments/device_setup.sh q
if [ -d .gpu/cute ]; then eval "$(bash .gpu/cute/unpack.sh)"; else
  export PYTHONPATH=/root/k3site/nvidia_cutlass_dsl/dsl_packages:$PYTHONPATH; fi
timeout 200 python3 -m k3lab.cli bench mla --ops mla_combine --backends triton --no-variants \
  --skip torch_compile,reference --reps 20 --grid heads=12 --grid batch=2,4 --grid T=1,2,4 \
  --grid partitions=4,8,16,33,64 --grid block_r=null,1 --grid premerge=null,true --out "$OUT/q" \
  --name mla_combine_rowk57 --deadline 180 2>&1 | grep -E "rror" | cut -c1-120
timeout 120 python3 -m k3lab.cli bench mla --ops mla_combine --backends triton,cute --no-variants \
  --skip torch_compile,reference --reps 20 --grid heads=12 --grid batch=8,16 --grid T=2,4 \
  --grid partitions=4,16,64 --grid premerge=null,true --out "$OUT/q" --name mla_combine_t2big57 \
  --deadline 100 2>&1 | grep -E "rror" | cut -c1-120
python3 - "$OUT/q" <<'PY'
import json, sys, pathlib
for f in sorted(pathlib.Path(sys.argv[1]).rglob("mla_combine_*57.json")):
    best = {}
    for r in json.load(open(f))["rows"]:
        e = r["extra"]
        key = (e["batch"], e["T"], e["partitions"])
        tag = r["backend"] + (f"/r{e['block_r']}" if e.get("block_r") else "") + ("+pm" if e.get("premerge") else "")
        best.setdefault(key, []).append((round(r["median_us"], 2), tag, r["error"]["ok"]))
    print(f.name)
    for k, v in sorted(best.items()):
        print(k, " ".join(f"{t}={u}{'' if ok else '!'}" for u, t, ok in sorted(v)))
PY
