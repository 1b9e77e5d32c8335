#!/usr/bin/env bash
# fp8 projections at batch 1: the cute GEMV (one warp a row, kernels/cute/proj_gemv.py) against the Triton default for
# every projection at TP8 / TP16 (the H200's proj_cute_fp8 and the H100's fp8_small had it ahead on kda_q / kda_o /
# moe_down: 7.17 / 5.23 / 9.55 against 8.31 / 8.07 / 13.37 us on the H200), beside cuBLAS and the stream peer: the
# evidence of data/trunk_defaults.json's fp8 batch-1 rule (BATCHES=2,4 and PROJS / NAME: the batch-2 rule's,
# fp8_b2_rule). .gpu/cute carried.
# Device: [BATCHES=1] [PROJS=a,b] [NAME=fp8_b1] bash experiments/proj_b64/fp8_b1.sh   (the bundle under $OUT/fp8_b1, a
# short table last)
set -uo pipefail
. experiments/device_setup.sh fp8_b1
eval "$(bash .gpu/cute/unpack.sh)"
timeout 280 python3 -m k3lab.cli bench trunk --ops proj --backends triton,cute --no-variants \
  --skip torch_compile,reference --reps 20 --grid preset=tp8,tp16 --grid batch=${BATCHES:-1} --grid wdtype=fp8 \
  --grid proj=${PROJS:-shared_w1,kda_q,kda_o,kda_b,mla_dkv,mla_uq,moe_router,moe_down,shared_w2} --out "$OUT/fp8_b1" \
  --name ${NAME:-fp8_b1} --deadline 260 2>&1 | tail -n 1
python3 experiments/proj_b64/table.py "$OUT/fp8_b1" | cut -c1-60
