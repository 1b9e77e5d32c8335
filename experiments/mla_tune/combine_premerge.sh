#!/usr/bin/env bash
# The Triton MLA combine over many partials with the split's merge kernel first (`premerge`, fifty-fourth session,
# unmeasured): its rows path merges a row block's partials one at a time and repeats that per column block (batch 16
# over 33 partials 38.00 us on an H100 against cute's 16.58: mla_combine_parts.json.gz); the merge kernel spreads the
# partials over every row and column block first, then the combine reads one. Triton default / premerge / cute at
# batch 8..64 over 4..64 partials, one run (bundle mla_combine_premerge). .gpu/cute carried.
# Device: bash experiments/mla_tune/combine_premerge.sh   (the bundle under $OUT/q/<gpu>/, a short table last)
set -uo pipefail
. experiments/device_setup.sh q
eval "$(bash .gpu/cute/unpack.sh)"
timeout $(( ${D:-200} + 20 )) python3 -m k3lab.cli bench mla --ops mla_combine --backends triton,cute --no-variants \
  --skip torch_compile,reference --reps 20 --grid heads=12 --grid batch=8,16,32,64 --grid partitions=4,8,16,33,64 \
  --grid premerge=null,true --out "$OUT/q" --name mla_combine_premerge --deadline ${D:-200} 2>&1 | grep -E "^mla_combine" \
  | cut -c1-110
