#!/usr/bin/env bash
# The fifty-eighth session's second call (.gpu/cute carried, or unpacked by a.sh within 30 s), an H200 only (exits
# at once elsewhere: each part ran on an H100 in the fifty-seventh session):
#   1. the MLA combine over one merged partial (K = 1) at 2..32 query rows, one-row kernel against rows kernel
#      (queue57/d.sh part 1; bundle mla_combine_k1_57);
#   2. above 16 rows at T > 1: Triton with and without premerge against cute (queue57/c.sh part 2; bundle
#      mla_combine_t2big57);
#   3. the MLA decode's partitions at batch 16, 8K / 32K (queue57/a.sh part 2; bundle mla_parts57).
# Device: bash experiments/queue58/b.sh    (everything under $OUT/q)
set -uo pipefail
nvidia-smi --query-gpu=name --format=csv,noheader | grep -q H200 || { echo "not an H200: nothing run"; exit 0; }
. experiments/device_setup.sh q
if [ -d .gpu/cute ]; then eval "$(bash .gpu/cute/unpack.sh)"; else
  export PYTHONPATH=/root/k3site/nvidia_cutlass_dsl/dsl_packages:$PYTHONPATH; fi
timeout 110 python3 -m k3lab.cli bench mla --ops mla_combine --backends triton --no-variants \
  --skip torch_compile,reference --reps 20 --grid heads=12 --grid batch=2,4,8,16 --grid T=1,2,4 \
  --grid partitions=1 --grid block_r=null,1 --out "$OUT/q" --name mla_combine_k1_57 --deadline 80 2>&1 \
  | grep -E "rror" | cut -c1-120
timeout 130 python3 -m k3lab.cli bench mla --ops mla_combine --backends triton,cute --no-variants \
  --skip torch_compile,reference --reps 20 --grid heads=12 --grid batch=8,16 --grid T=2,4 \
  --grid partitions=4,16,64 --grid premerge=null,true --out "$OUT/q" --name mla_combine_t2big57 \
  --deadline 100 2>&1 | grep -E "rror" | cut -c1-120
timeout 90 python3 -m k3lab.cli bench mla --ops mla_decode --backends triton --no-variants --no-peers --reps 25 \
  --grid batch=16 --grid context=32768,8192 --grid partitions=16,20,24,12,28 \
  --out "$OUT/q" --name mla_parts57 --deadline 60 2>&1 | grep -E "^mla_decode|rror" | cut -c1-160
python3 - "$OUT/q" <<'PY'
import json, sys, pathlib
for f in sorted(pathlib.Path(sys.argv[1]).rglob("*57.json")):
    print(f.name)
    for r in json.load(open(f))["rows"]:
        e = r["extra"]
        extra = "".join(f" {k}={e[k]}" for k in ("context", "partitions", "block_r", "premerge") if e.get(k) is not None)
        print(f" {r['backend']} b{e.get('batch')} T{e.get('T', '')}{extra} {r['median_us']:.2f} "
              f"{r['pct_of_bw'] or 0:.1f}% {'ok' if r['error']['ok'] else 'FAIL'}")
PY
