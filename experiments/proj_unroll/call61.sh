#!/usr/bin/env bash
# The CuTe GEMV's UNROLL / PRE at batch 1 (experiments/proj_unroll/unroll.py), bf16 then fp8. Device, carry
# .gpu/cute: bash experiments/proj_unroll/call61.sh
set -uo pipefail
eval "$(bash .gpu/cute/unpack.sh)"
. experiments/device_setup.sh pu
PROJS=kda_q,mla_dkv,shared_w1,moe_down VARIANTS='[[8, 8], [16, 8], [16, 16], [28, 28]]' timeout 540 \
  python3 experiments/proj_unroll/unroll.py "$OUT/pu" 30 2>&1 | tail -n 60
