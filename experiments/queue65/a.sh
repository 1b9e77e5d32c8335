#!/usr/bin/env bash
# The sixty-fifth session's call (carry .gpu/cute; any GPU): issue 13's projections timed as the decode step runs them.
# The >= 16 MB rows (kda_q, kda_o, moe_down; bf16 and fp8; TP8 / TP16; batch 1 / 4 / 8) and the fused input groups at
# batch 1, with the variants "triton_pdl" / "cute_pdl" (20 calls chained under programmatic dependent launch, each
# loading its first weights before it waits for the call before) beside the standalone rows, cuBLAS and the stream
# peers of the same run. No committed bundle had a chained projection row. Bundles proj_chain65, proj_group_chain65.
# Device: bash experiments/queue65/a.sh    (everything under $OUT/q)
set -uo pipefail
eval "$(bash .gpu/cute/unpack.sh)"
. experiments/device_setup.sh q
timeout 330 python3 -m k3lab.cli bench trunk --ops proj --backends triton,cute --grid preset=tp8,tp16 \
  --grid batch=1,4,8 --grid wdtype=bf16,fp8 --grid proj=kda_q,kda_o,moe_down --skip torch_compile,reference \
  --reps 20 --deadline 300 --name proj_chain65 --out "$OUT/q" 2>&1 | grep -E "^proj|rror" | cut -c1-150
timeout 150 python3 -m k3lab.cli bench trunk --ops proj_group --backends triton,cute --grid preset=tp8 \
  --grid batch=1 --grid wdtype=bf16 --grid group=kda_in,mla_in,moe_in --skip torch_compile,reference \
  --reps 30 --deadline 120 --name proj_group_chain65 --out "$OUT/q" 2>&1 | grep -E "^proj_group|rror" | cut -c1-150
