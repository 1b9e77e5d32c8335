#!/usr/bin/env bash
# The sixty-fourth session's H200 call (carry .gpu/cute):
#   1. issue 13's fused input groups at batch 1 / 8 / 16 with today's CuTe GEMV (profiles/h200/proj_group_cute.json.gz
#      is the seventeenth session's: mla_in 1.30x its floor with cute; UNROLL / PRE and SHORT_K changed since), the
#      same command and bundle name;
#   2. an H200 only: queue59/a.sh (issue 14's bf16 grouped experts, 3 / 4 / 5 stages at batch 64 / 16).
# Device: bash experiments/queue64/c.sh    (everything under $OUT/q)
set -uo pipefail
eval "$(bash .gpu/cute/unpack.sh)"
. experiments/device_setup.sh q
timeout 200 python3 -m k3lab.cli bench trunk --ops proj_group --backends triton,cute --grid preset=tp8 \
  --grid batch=1,8,16 --grid wdtype=bf16 --grid group=kda_in,mla_in,moe_in --no-variants \
  --skip torch_compile,reference --reps 30 --deadline 170 --name proj_group_cute --out "$OUT/q" 2>&1 \
  | grep -E "^proj_group|rror" | cut -c1-170
if nvidia-smi --query-gpu=name --format=csv,noheader | grep -q H200; then
  bash experiments/queue59/a.sh
fi
