#!/usr/bin/env bash
# d.sh's part 2 alone, smaller (device time nearly spent): on an H200 only, the bf16 grouped experts at batch 64 / 16,
# 3 / 4 / 5 stages at 4 warps (bundle moe_bf16_tiles57); elsewhere it exits at once.
# Device: bash experiments/queue57/e.sh    (everything under $OUT/q)
set -uo pipefail
. experiments/device_setup.sh q
nvidia-smi --query-gpu=name --format=csv,noheader | grep -q H200 || { echo "not an H200: nothing run"; exit 0; }
timeout 110 python3 -m k3lab.cli bench moe --ops moe_experts --backends triton --no-variants --no-peers --reps 15 \
  --grid tp=8 --grid latent=3584 --grid inter=3072 --grid n_experts=896 --grid top_k=16 --grid dtype=bf16 \
  --grid routing=uniform --grid batch=64,16 --grid num_stages=4,3,5 --out "$OUT/q" --name moe_bf16_tiles57 \
  --deadline 80 2>&1 | grep -E "^moe_experts|rror" | cut -c1-160
