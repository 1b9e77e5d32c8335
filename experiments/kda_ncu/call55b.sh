#!/usr/bin/env bash
# The fifty-fifth session's second call (.gpu/base carried), everything under $OUT:
#  1. issue 14's bf16 rows at batch 16 / 32 / 64 uniform on the Triton grouped path with the floor from the experts
#     the timed sets touch (the registry's set_bytes; bundle moe_bf16_sets);
#  2. notebook 07 (draft depth) at batch DB (1), depths DD (0 / 1 / 3), with the release of each step before the next
#     (the fifty-fourth session's fix of its out-of-memory on an 80 GB GPU; queue item 2).
# Device: bash experiments/kda_ncu/call55b.sh
set -uo pipefail
. experiments/device_setup.sh q
timeout 150 python3 -m k3lab.cli bench moe --ops moe_experts --backends triton --no-variants --no-peers --reps 20 \
  --grid tp=8 --grid latent=3584 --grid inter=3072 --grid n_experts=896 --grid top_k=16 --grid dtype=bf16 \
  --grid batch=16,32,64 --grid routing=uniform --out "$OUT/q" --name moe_bf16_sets --deadline 120 \
  2>&1 | grep -E "^moe_experts|rror" | cut -c1-150
python3 - "$OUT/q" <<'PY'
import glob, json, sys
for p in glob.glob(sys.argv[1] + "/*/moe_bf16_sets.json"):
    b = json.load(open(p))
    for r in b["rows"]:
        x = r["extra"]
        print(x["batch"], r["backend"], round(r["median_us"], 2), f"{r['pct_of_bw']:.1f} % of read", "bytes", r["bytes"],
              "formula", x.get("bytes_formula"), "by set", x.get("bytes_by_set"))
PY
BATCHES= DEPTH=1 DEPTH_BATCHES=${DB:-1} DEPTH_DEPTHS=${DD:-0,1,3} DEPTH_S=${DS:-280} bash scripts/gpu_step.sh 2>&1 | tail -n 40
