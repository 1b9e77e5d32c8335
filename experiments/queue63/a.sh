#!/usr/bin/env bash
# The sixty-third session's H200 call (carry .gpu/base, .gpu/fi, .gpu/fijit): queue62/b.sh (issue 12's batch 16 / 32K
# row beside fa3, partitions swept around the rule; bundle mla_parts62), then queue59/a.sh (issue 14's bf16 grouped
# stages at batch 64 / 16; bundle moe_bf16_tiles59). Both want an H200; on another GPU only the first runs.
# Device: bash experiments/queue63/a.sh    (everything under $OUT/q)
set -uo pipefail
bash experiments/queue62/b.sh
if nvidia-smi --query-gpu=name --format=csv,noheader | grep -q H200; then
  bash experiments/queue59/a.sh
fi
