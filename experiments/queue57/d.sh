#!/usr/bin/env bash
# The fifty-seventh session's last call (nothing carried):
#   1. any GPU: the MLA combine over one merged partial (the decode step's call: K = 1) at 2..32 query rows, the
#      one-row kernel (block_r 1) against the rows kernel (the kernel's choice at 3..8 rows with one partial is the
#      rows kernel, unmeasured) (bundle mla_combine_k1_57);
#   2. an H200 only: a.sh's part 1 (the bf16 grouped tiles) at batch 16 / 64 (bundle moe_bf16_tiles57).
# Device: bash experiments/queue57/d.sh    (everything under $OUT/q)
set -uo pipefail
. experiments/device_setup.sh q
timeout 100 python3 -m k3lab.cli bench mla --ops mla_combine --backends triton --no-variants \
  --skip torch_compile,reference --reps 20 --grid heads=12 --grid batch=2,4,8,16 --grid T=1,2,4 \
  --grid partitions=1 --grid block_r=null,1 --out "$OUT/q" --name mla_combine_k1_57 --deadline 80 2>&1 \
  | grep -E "rror" | cut -c1-120
if nvidia-smi --query-gpu=name --format=csv,noheader | grep -q H200; then
  timeout 200 python3 -m k3lab.cli bench moe --ops moe_experts --backends triton --no-variants --no-peers --reps 15 \
    --grid tp=8 --grid latent=3584 --grid inter=3072 --grid n_experts=896 --grid top_k=16 --grid dtype=bf16 \
    --grid routing=uniform --grid batch=64,16 --grid num_stages=4,3,5 --grid num_warps=4,8 --out "$OUT/q" \
    --name moe_bf16_tiles57 --deadline 170 2>&1 | grep -E "rror" | cut -c1-160
fi
python3 - "$OUT/q" <<'PY'
import json, sys, pathlib
for f in sorted(pathlib.Path(sys.argv[1]).rglob("*57.json")):
    print(f.name)
    for r in json.load(open(f))["rows"]:
        e = r["extra"]
        o = ",".join(f"{k}={v}" for k, v in e.get("options", {}).items() if v is not None)
        print(f" b{e.get('batch')} T{e.get('T', '')} {o} {r['median_us']:.2f} {r['pct_of_bw'] or 0:.1f}% "
              f"{'ok' if r['error']['ok'] else 'FAIL'}")
PY
