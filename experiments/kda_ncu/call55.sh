#!/usr/bin/env bash
# The fifty-fifth session's call (.gpu/cute and .gpu/fi carried), everything under $OUT, a table per part:
#  1. experiments/moe_tail/tail.py (retired for room, git history at 97e16e8): the bf16 grouped experts at batch 16 over routings of D experts across the wave
#     edges, plain against the new `tail` option;
#  2. issue 14's bf16 rows at batch 16 / 32 / 64 uniform, tail off / on, through the registry (fp64-checked; bundle
#     moe_tail);
#  3. the KDA decode across the one-wave edge: batch 10 / 11 / 12 / 16 / 20 / 22 / 24 at 12 heads (120..288 CTAs of
#     one head each), cute (auto, and its pdl variant) beside FlashInfer (bundle kda_wave);
#  4. ncu of the KDA decode at batch 16, ours against FlashInfer (queue item 4, on whatever GPU comes);
#  5. the Triton combine's premerge against its default and cute (experiments/mla_tune/combine_premerge.sh).
# Device: bash experiments/kda_ncu/call55.sh
set -uo pipefail
. experiments/device_setup.sh q
eval "$(bash .gpu/cute/unpack.sh)"
eval "$(bash .gpu/fi/unpack.sh)"
timeout 100 python3 experiments/moe_tail/tail.py 2>&1 | tail -n 20
timeout 150 python3 -m k3lab.cli bench moe --ops moe_experts --backends triton --no-variants --no-peers --reps 20 \
  --grid tp=8 --grid latent=3584 --grid inter=3072 --grid n_experts=896 --grid top_k=16 --grid dtype=bf16 \
  --grid batch=16,32,64 --grid routing=uniform --grid tail=null,true --out "$OUT/q" --name moe_tail --deadline 130 \
  2>&1 | grep -E "^moe_experts|rror" | cut -c1-150
timeout 90 python3 -m k3lab.cli bench kda --ops kda_decode --backends cute --grid heads=12 \
  --grid batch=10,11,12,16,20,22,24 --skip torch_compile,reference,fla_recurrence,fla_path,torch_copy --reps 30 \
  --out "$OUT/q" --name kda_wave --deadline 70 2>&1 | grep -E "^kda_decode" | cut -c1-120
timeout 100 bash experiments/kda_ncu/ncu.sh 16 2>&1 | tail -n 40
D=120 timeout 150 bash experiments/mla_tune/combine_premerge.sh 2>&1 | tail -n 45
