#!/usr/bin/env bash
# Batch-1 bf16 projections at TP8 that trail a plain read of their bytes by 0.8-2.8 us on an H100
# (profiles/h100-80gb-hbm3/proj_rows61.json.gz): (1) the Triton default's shared-memory stages, which set the one-wave
# split-K (one tma program an SM at 6 stages: 112-120 programs for 132 SMs), swept with the split the rule then picks
# (bundle proj_stages61); (2) the CuTe GEMV's row bytes in flight a warp (experiments/proj_unroll/unroll.py, short).
# Device, carry .gpu/cute: bash experiments/queue61/c.sh
set -uo pipefail
eval "$(bash .gpu/cute/unpack.sh)"
. experiments/device_setup.sh pu
timeout 150 python3 -m k3lab.cli bench trunk --ops proj --backends triton --grid preset=tp8 --grid batch=1 \
  --grid wdtype=bf16 --grid proj=kda_q,moe_down,kda_o,shared_w1,mla_dkv --grid residual=false \
  --grid num_stages=null,2,3,4 --no-variants --skip torch_compile,reference,cublas,stream_grid --reps 30 \
  --deadline 130 --name proj_stages61 --out "$OUT/q" 2>&1 | grep -E "^proj|rror" | cut -c1-150
PROJS=kda_q,mla_dkv WDTYPES=bf16 VARIANTS='[[8, 8], [16, 16], [28, 28]]' timeout 170 \
  python3 experiments/proj_unroll/unroll.py "$OUT/pu" 30 2>&1 | tail -n 14
