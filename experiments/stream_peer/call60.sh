#!/usr/bin/env bash
# The projections' stream peer as a program a tile against the grid-sized read (experiments/stream_peer/compare.py,
# every projection's and group's weight bytes), then the fused input groups at batch 1 beside both peers (cute,
# triton, cuBLAS; bundle proj_group_stream60). Device, carry .gpu/cute: bash experiments/stream_peer/call60.sh
set -uo pipefail
eval "$(bash .gpu/cute/unpack.sh)"
. experiments/device_setup.sh sp
timeout 200 python3 experiments/stream_peer/compare.py "$OUT" 2>&1 | tail -n 40
timeout 150 python3 -m k3lab.cli bench trunk --ops proj_group --backends triton,cute --grid preset=tp8 --grid batch=1 \
  --grid wdtype=bf16 --grid group=kda_in,mla_in,moe_in --no-variants --skip torch_compile,reference,cublas_parts \
  --reps 30 --deadline 110 --name proj_group_stream60 --out "$OUT/q" 2>&1 | grep -E "^proj_group|rror" | cut -c1-170
