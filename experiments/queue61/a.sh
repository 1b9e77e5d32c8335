#!/usr/bin/env bash
# The sixty-first session's first device call (carry .gpu/cute): on an H200 the fifty-ninth's queue item
# (experiments/queue59/a.sh) then the stream-peer comparison's short form; on any other GPU the whole
# stream-peer call (experiments/stream_peer/call60.sh). Device: bash experiments/queue61/a.sh
set -uo pipefail
if nvidia-smi --query-gpu=name --format=csv,noheader | grep -q H200; then
  bash experiments/queue59/a.sh
  mkdir -p "$OUT/sp"
  ONLY=mla_in,kda_in,moe_in,moe_down,GiB GRIDS=3 timeout 200 python3 experiments/stream_peer/compare.py "$OUT/sp" 2>&1 | tail -n 25
else
  bash experiments/stream_peer/call60.sh
fi
