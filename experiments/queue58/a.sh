#!/usr/bin/env bash
# The fifty-eighth session's first call (.gpu/cute carried), an H200 only (exits at once elsewhere: every figure it
# makes was measured on an H100 already, bundles of the fifty-seventh):
#   1. issue 14's bf16 grouped experts at batch 16 / 32 / 64, tiles swept (queue57/a.sh part 1; bundle
#      moe_bf16_tiles57);
#   2. the MLA combine's one-row kernel against the rows kernel at 2..16 query rows (queue57/c.sh part 1; bundle
#      mla_combine_rowk57).
# Device: bash experiments/queue58/a.sh    (everything under $OUT/q)
set -uo pipefail
nvidia-smi --query-gpu=name --format=csv,noheader | grep -q H200 || { echo "not an H200: nothing run"; exit 0; }
. experiments/device_setup.sh q
eval "$(bash .gpu/cute/unpack.sh)"
timeout 230 python3 -m k3lab.cli bench moe --ops moe_experts --backends triton --no-variants --no-peers \
  --reps 15 --grid tp=8 --grid latent=3584 --grid inter=3072 --grid n_experts=896 --grid top_k=16 --grid dtype=bf16 \
  --grid routing=uniform --grid batch=64,16,32 --grid num_stages=4,3,5 --grid num_warps=4,8 \
  --out "$OUT/q" --name moe_bf16_tiles57 --deadline 200 2>&1 | grep -E "rror" | cut -c1-160
timeout 200 python3 -m k3lab.cli bench mla --ops mla_combine --backends triton --no-variants \
  --skip torch_compile,reference --reps 20 --grid heads=12 --grid batch=2,4 --grid T=1,2,4 \
  --grid partitions=4,8,16,33,64 --grid block_r=null,1 --grid premerge=null,true --out "$OUT/q" \
  --name mla_combine_rowk57 --deadline 170 2>&1 | grep -E "rror" | cut -c1-120
python3 - "$OUT/q" <<'PY'
import json, sys, pathlib
for f in sorted(pathlib.Path(sys.argv[1]).rglob("*57.json")):
    print(f.name)
    for r in json.load(open(f))["rows"]:
        e = r["extra"]
        o = ",".join(f"{k}={v}" for k, v in e.get("options", {}).items() if v is not None)
        extra = "".join(f" {k}={e[k]}" for k in ("partitions", "block_r", "premerge") if e.get(k) is not None)
        print(f" b{e.get('batch')} T{e.get('T', '')}{extra} {o} {r['median_us']:.2f} {r['pct_of_bw'] or 0:.1f}% "
              f"{'ok' if r['error']['ok'] else 'FAIL'}")
PY
