#!/usr/bin/env bash
# The sixty-fifth session's second call (nothing carried; any GPU, 132 SMs): the Triton projections at batch 4 are
# ~3 us behind a stream of the same bytes where batch 1's CuTe GEMV is level with it (proj_chain65: moe_down bf16
# 21.13 against stream 18.17 on an H100). Their tiles give 112-120 programs for 132 SMs (moe_down 56 tiles x 2 K
# ranges, kda_o 112 x 1, kda_q 24 x 5). A sweep of K ranges and stages on both tile paths, bundle proj_split65.
# Device: bash experiments/queue65/b.sh    (everything under $OUT/q)
set -uo pipefail
. experiments/device_setup.sh q
timeout 420 python3 -m k3lab.cli bench trunk --ops proj --backends triton --grid preset=tp8 --grid batch=4 \
  --grid wdtype=bf16 --grid proj=moe_down,kda_q,kda_o --grid path=tma,dot --grid split_k=null,1,2,3,4,6,7,8 \
  --grid num_stages=null,3 --no-peers --no-variants --reps 15 --deadline 400 --name proj_split65 --out "$OUT/q" \
  2>&1 | grep -E "^proj|rror" | cut -c1-150
