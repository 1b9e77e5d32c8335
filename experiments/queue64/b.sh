#!/usr/bin/env bash
# The sixty-fourth session's second call, warm after a.sh (carry .gpu/fi; CuTe DSL still unpacked in /root/k3site from
# a.sh, or carry .gpu/cute): issue 16's decode rows beside FlashInfer's fused decode, the command of
# profiles/h200/kda_decode_fi.json.gz (bundle kda_decode_fi) with the code as it stands.
# Device: bash experiments/queue64/b.sh    (everything under $OUT/rows)
set -uo pipefail
if [ -d .gpu/cute ]; then eval "$(bash .gpu/cute/unpack.sh)"; else
  export PYTHONPATH=/root/k3site:/root/k3site/nvidia_cutlass_dsl/dsl_packages${PYTHONPATH:+:$PYTHONPATH}; fi
eval "$(bash .gpu/fi/unpack.sh)"
. experiments/device_setup.sh rows
timeout 400 python3 -m k3lab.cli bench kda --ops kda_decode --backends cute,triton --grid heads=12 \
  --grid batch=1,2,4,8,16,32,64 --grid tile_v=16,128 --reps 30 --deadline 340 --skip torch_compile \
  --name kda_decode_fi --out "$OUT/rows" 2>&1 | grep -E "kda_decode" | cut -c1-150 | tail -n 40
