#!/usr/bin/env bash
# The fifty-sixth session's first call (.gpu/cute carried; CuTe DSL stays unpacked in /root/k3site for b.sh):
#   an H200: issue 14's bf16 batch 16 / 32 / 64 rows with the per-set floor (bundle moe_bf16_sets, the name
#            data/targets.json reads before moe_b1_b64);
#   any GPU: the MLA combine at batch 2 / 4 (batch 8's rule, unmeasured there) and at T = 2 / 4 (Triton by rule,
#            unmeasured), Triton with and without premerge against CuTe (bundle mla_combine_b2t).
# Device: bash experiments/queue56/a.sh    (everything under $OUT/q)
set -uo pipefail
. experiments/device_setup.sh q
eval "$(bash .gpu/cute/unpack.sh)"
if nvidia-smi --query-gpu=name --format=csv,noheader | grep -q H200; then
  timeout 150 python3 -m k3lab.cli bench moe --ops moe_experts --backends triton --no-variants --no-peers --reps 20 \
    --grid tp=8 --grid latent=3584 --grid inter=3072 --grid n_experts=896 --grid top_k=16 --grid dtype=bf16 \
    --grid batch=16,32,64 --grid routing=uniform --out "$OUT/q" --name moe_bf16_sets --deadline 120 \
    2>&1 | grep -E "^moe_experts|rror" | cut -c1-150
fi
timeout $(( ${D:-150} + 20 )) python3 -m k3lab.cli bench mla --ops mla_combine --backends triton,cute --no-variants \
  --skip torch_compile,reference --reps 20 --grid heads=12 --grid batch=2,4 --grid T=1,2,4 \
  --grid partitions=4,8,16,33,64 --grid premerge=null,true --out "$OUT/q" --name mla_combine_b2t \
  --deadline ${D:-150} 2>&1 | grep -E "^mla_combine|rror" | cut -c1-120
