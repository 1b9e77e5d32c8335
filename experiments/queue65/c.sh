#!/usr/bin/env bash
# The sixty-fifth session's third call (carry .gpu/cute; any GPU): 1. ncu.sh (what bounds the fp8 one-token experts
# and the fp8 CuTe GEMV: WHO="moe_fp8 proj_fp8" by default, their bf16 twins on request); 2. the tensor-core path "mma"
# of the CuTe projection at batch 4 against the Triton tiles (2.6-3.5 us behind a stream of the same bytes there:
# proj_chain65) and the GEMV; bundle proj_mma65.
# Device: bash experiments/queue65/c.sh    (everything under $OUT/q)
set -uo pipefail
WHO=${WHO:-"moe_fp8 proj_fp8"} bash experiments/queue65/ncu.sh
eval "$(bash .gpu/cute/unpack.sh)"
timeout 150 python3 -m k3lab.cli bench trunk --ops proj --backends cute,triton --grid preset=tp8 --grid batch=4 \
  --grid wdtype=bf16 --grid proj=moe_down,kda_q,kda_o --grid path=null,mma --grid tile_m=null,32 \
  --no-variants --skip torch_compile,reference,cublas --reps 15 --deadline 130 --name proj_mma65 --out "$OUT/q" \
  2>&1 | grep -E "^proj|rror" | cut -c1-150
