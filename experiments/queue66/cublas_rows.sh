#!/usr/bin/env bash
# Issue 13's cuBLAS target's worst rows (H200, proj_fp8_47: fp8 mla_uq / kda_o at batch 32 / 64, ours 1.2-1.55x
# cuBLAS on the bf16-dequantized weights; the batch-32 rows predate the FP8_NARROW_MIN_K rule): the rule as it stands
# beside the reduction (`reduce` last / kernel) and the K ranges (`split_k`) swept, cuBLAS and the stream read in the
# same run. Any GPU (no carry); bundle proj_fp8_small66.
# Device: bash experiments/queue66/cublas_rows.sh    (everything under $OUT/q)
set -uo pipefail
. experiments/device_setup.sh q
timeout 560 python3 -m k3lab.cli bench trunk --ops proj --backends triton --grid preset=tp8,tp16 --grid batch=32,64 \
  --grid wdtype=fp8 --grid proj=mla_uq,kda_o --grid reduce=null,last,kernel --grid split_k=null,1,2,4 \
  --skip torch_compile,reference --no-variants --reps 20 --deadline 480 --name proj_fp8_small66 --out "$OUT/q" 2>&1 \
  | grep -E "^proj|rror" | cut -c1-160
