#!/usr/bin/env bash
# The fifty-seventh session's first call (nothing carried):
#   1. issue 14's bf16 grouped experts at batch 16 / 32 / 64 on this GPU, the tiles swept (num_stages 3 / 4 / 5,
#      num_warps 4 / 8 at block_n 64; then block_n 32: two programs an SM; the rule's 4 stages,
#      BK 128, 4 warps, BN 64 were measured on an H100 only, where they reach 99 % of read, 93.6-94.6 % on the
#      H200: moe_bf16_sets) (bundles moe_bf16_tiles57, moe_bf16_bn32_57);
#   2. the MLA decode's partitions at batch 16, 8K / 32K, finer than mla_parts56 (the rule's 16 at 32K ties fa3 there)
#      (bundle mla_parts57).
# Device: bash experiments/queue57/a.sh    (everything under $OUT/q)
set -uo pipefail
. experiments/device_setup.sh q
moe() {  # name deadline grid...
  local name=$1 dl=$2; shift 2
  timeout $(( dl + 30 )) python3 -m k3lab.cli bench moe --ops moe_experts --backends triton --no-variants --no-peers \
    --reps 15 --grid tp=8 --grid latent=3584 --grid inter=3072 --grid n_experts=896 --grid top_k=16 --grid dtype=bf16 \
    --grid routing=uniform "$@" --out "$OUT/q" --name "$name" --deadline "$dl" 2>&1 | grep -E "rror" | cut -c1-160
}
moe moe_bf16_tiles57 200 --grid batch=64,16,32 --grid num_stages=4,3,5 --grid num_warps=4,8
moe moe_bf16_bn32_57 60 --grid batch=64,16,32 --grid block_n=32 --grid num_stages=4,5
timeout 80 python3 -m k3lab.cli bench mla --ops mla_decode --backends triton --no-variants --no-peers --reps 25 \
  --grid batch=16 --grid context=32768,8192 --grid partitions=16,20,24,12,28 \
  --out "$OUT/q" --name mla_parts57 --deadline 60 2>&1 | grep -E "^mla_decode|rror" | cut -c1-160
python3 - "$OUT/q" <<'PY'
import json, sys, pathlib
for f in sorted(pathlib.Path(sys.argv[1]).rglob("*57.json")):
    print(f.name)
    for r in json.load(open(f))["rows"]:
        o = r["extra"].get("options", {})
        o = ",".join(f"{k}={v}" for k, v in o.items() if v is not None)
        print(f" {r['extra'].get('batch')} {r['extra'].get('context', '')} {r['extra'].get('partitions', '')} {o} "
              f"{r['median_us']:.2f} "
              f"{r['pct_of_bw'] or 0:.1f}% {'ok' if r['error']['ok'] else 'FAIL'}")
PY
