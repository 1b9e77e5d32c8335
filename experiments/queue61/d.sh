#!/usr/bin/env bash
# The trunk's batch-1 (and 2) projection rule again with the CuTe GEMV at UNROLL = PRE = 16 (sixty-first session:
# ahead of Triton on every bf16 batch-1 projection timed on an H100, where data/trunk_defaults.json's H200 rule gives
# the 1,536-row and smaller ones over K = 7168 to Triton): every TP8 / TP16 projection, bf16 and fp8, triton and cute
# beside cuBLAS and the stream peer (bundle proj_cute16_b$BATCH). Then, off the device: `k3lab defaults trunk
# profiles/h200/proj_cute16_b1.json.gz ...` for the rule and k3lab.step.proj_cute_takes to follow it.
# Device (an H200), carry .gpu/cute: BATCH=1 bash experiments/queue61/d.sh   (then BATCH=2)
set -uo pipefail
eval "$(bash .gpu/cute/unpack.sh)"
. experiments/device_setup.sh q
B=${BATCH:-1}
timeout 540 python3 -m k3lab.cli bench trunk --ops proj --backends triton,cute --grid preset=tp8,tp16 --grid batch=$B \
  --grid wdtype=bf16,fp8 --grid residual=false --grid proj=kda_q,kda_fa,kda_b,kda_fb,kda_o,mla_dq,mla_dkv,mla_gate,mla_uq,mla_o,moe_router,moe_down,moe_up,shared_w1,shared_w2 --no-variants --skip torch_compile,reference,stream_grid --reps 30 \
  --deadline 500 --name proj_cute16_b$B --out "$OUT/q" 2>&1 | grep -E "^proj|rror" | cut -c1-150
