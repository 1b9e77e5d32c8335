#!/usr/bin/env bash
# The fifty-ninth session's short H200 item (nothing carried; a.sh of queue57 part 1, cut to fit a small budget):
# issue 14's bf16 grouped experts at batch 64 / 16 uniform on the H200 (93.6 / 93.9 % of read with the rule's 4 stages,
# 4 warps: profiles/h200/moe_bf16_sets.json.gz; the H100 reads 99-100 % whatever the tiles), 3 / 4 / 5 stages at
# 4 warps, per-set floor (bundle moe_bf16_tiles59).
# Device: nvidia-smi ... | grep -q H200 || exit 0; bash experiments/queue59/a.sh    (everything under $OUT/q)
set -uo pipefail
. experiments/device_setup.sh q
timeout 230 python3 -m k3lab.cli bench moe --ops moe_experts --backends triton --no-variants --no-peers --reps 15 \
  --grid tp=8 --grid latent=3584 --grid inter=3072 --grid n_experts=896 --grid top_k=16 --grid dtype=bf16 \
  --grid routing=uniform --grid batch=64,16 --grid num_stages=4,3,5 --grid num_warps=4 --out "$OUT/q" \
  --name moe_bf16_tiles59 --deadline 200 2>&1 | grep -E "^moe_experts|rror" | cut -c1-160  # the bench's own rows
