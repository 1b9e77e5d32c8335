#!/usr/bin/env bash
# Issue 13's bf16 small-batch rows again on an H200 (.gpu/cute carried): the thirtieth session's grid (proj_cute30:
# TP8 / TP16, batch 1 / 2, eight projections, Triton and cute beside cuBLAS and the stream peer) under today's rules,
# as profiles/h200/proj_cute30b.json.gz, which data/targets.json reads in place of proj_cute30 once it exists (its
# kda_b at batch 2, Triton 7.47 us there, is 3.43 on an H100 under today's default path: fifty-fourth session).
# Device: [D=180] bash experiments/proj_b64/bf16_small_h200.sh   (D: its deadline in s; the bundle under $OUT/q/<gpu>/, a short table last)
set -uo pipefail
. experiments/device_setup.sh q
eval "$(bash .gpu/cute/unpack.sh)"
timeout $(( ${D:-180} + 20 )) python3 -m k3lab.cli bench trunk --ops proj --backends triton,cute --no-variants \
  --skip torch_compile,reference --reps 20 --grid preset=tp8,tp16 --grid batch=1,2 --grid wdtype=bf16 \
  --grid proj=kda_q,kda_o,kda_b,mla_dkv,moe_router,shared_w1,shared_w2,moe_down --out "$OUT/q" --name proj_cute30b \
  --deadline ${D:-180} 2>&1 | tail -n 1
python3 experiments/proj_b64/table.py "$OUT/q" | cut -c1-70
