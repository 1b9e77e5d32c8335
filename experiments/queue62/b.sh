#!/usr/bin/env bash
# The sixty-second session's second call (.gpu/base, fi, fijit carried): issue 12's one row behind FlashInfer fa3
# (batch 16 / 32K: Triton 156.94 us against fa3 156.67 in profiles/h200/mla_rule_sweep.json.gz, the rule's 16 pieces)
# with the partitions swept around the rule beside fa3 in the same run (bundle mla_parts62; batch 16 / 8 at 32K / 8K).
# Device: bash experiments/queue62/b.sh    (everything under $OUT/q)
set -uo pipefail
. experiments/device_setup.sh q
for a in base fi fijit; do eval "$(bash .gpu/$a/unpack.sh)"; done
timeout 300 python3 -m k3lab.cli bench mla --ops mla_decode --backends triton \
  --skip flashinfer_fa2,reference,torch_compile --reps 25 --grid batch=16 --grid context=32768,8192 \
  --grid partitions=auto,12,14,15,17,18,20 --out "$OUT/q" --name mla_parts62 --deadline 260 2>&1 \
  | grep -E "^mla_decode|rror" | cut -c1-150
