#!/usr/bin/env bash
# The fifty-fourth session's H100 call (.gpu/cute carried), the decisions first:
# (1) bf16 kda_b (12 / 6 rows over the model width) at batch 1..8 on the Triton rows path against its default path and
#     the cute GEMV (bundles kda_b_rows / kda_b_None; issue 13's worst bf16 small row is kda_b at batch 2 on cute, 6.00
#     us on the H200, where the rows path takes 3.73 at batch 1);
# (2) fp8 moe_up / moe_up_shared (the routed up-projection, K = 3,584 / 4,352, 7,168 rows) at batch 1 / 2, cute against
#     triton: the batch-1 fp8 rule (>= 768 rows) covers them unmeasured (bundle fp8_moe_up);
# (3) the MLA combine at batch 16 / 32 / 64 over 4..64 partials, triton against cute (bundle mla_combine_parts: the
#     sixteenth session's H200 had cute at 27.97 against 45.31 us at batch 64 over 33 partials, while `auto` runs
#     triton for every combine; a rule by partials needs the crossover);
# (4) fp8 projections at batch 1..8 with x handed over in f16 against the production bf16 x (experiments/proj_b64/
#     x16.py: does the small-batch dot path's x widening, a third of its instructions offline, cost time?).
# Device: bash experiments/proj_b64/call54.sh   (everything under $OUT/q)
set -uo pipefail
. experiments/device_setup.sh q
eval "$(bash .gpu/cute/unpack.sh)"
B="python3 -m k3lab.cli bench"
S="--no-variants --skip torch_compile,reference --reps 20 --out $OUT/q"
for path in rows None; do
  g=(); [[ $path == rows ]] && g=(--grid path=rows)
  timeout 80 $B trunk --ops proj --backends triton$([[ $path == None ]] && echo ,cute) $S --grid preset=tp8,tp16 \
    --grid batch=1,2,4,8 --grid wdtype=bf16 --grid proj=kda_b "${g[@]}" --name kda_b_$path --deadline 60 2>&1 | tail -n 1
done
timeout 80 $B trunk --ops proj --backends triton,cute $S --grid preset=tp8,tp16 --grid batch=1,2 --grid wdtype=fp8 \
  --grid proj=moe_up,moe_up_shared --name fp8_moe_up --deadline 60 2>&1 | tail -n 1
python3 experiments/proj_b64/table.py "$OUT/q" | cut -c1-90
timeout 130 $B mla --ops mla_combine --backends triton,cute $S --grid heads=12 --grid batch=16,32,64 \
  --grid partitions=4,8,16,33,64 --name mla_combine_parts --deadline 110 2>&1 | grep -E "^mla_combine" | cut -c1-110
PROJS=kda_q,kda_o,moe_down,moe_router BATCHES=1,2,4,8 NAME=proj_x16_small timeout 140 \
  python3 experiments/proj_b64/x16.py "$OUT/q" | grep -v cublas | awk '{printf "%s ", $0; if (NR%3==0) print ""}'
