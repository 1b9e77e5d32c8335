#!/usr/bin/env bash
# The next H200 call in one command (carry .gpu/cute). On any other GPU it prints the GPU's name and stops at once,
# so an ask that comes back as an H100 costs seconds. On an H200: issue 14's bf16 grouped stages at batch 64 / 16
# (queue59/a.sh, bundle moe_bf16_tiles59), then issue 13's projections and input groups with the chained rows
# (queue65/a.sh, bundles proj_chain65 and proj_group_chain65: the groups' target bundle, proj_group_cute.json.gz, is the
# seventeenth session's). After it, warm: queue64/b.sh (carry .gpu/fi); then queue63/a.sh's first part (.gpu/base, fi,
# fijit).
# Device: bash experiments/queue65/h200.sh    (everything under $OUT/q)
set -uo pipefail
gpu=$(nvidia-smi --query-gpu=name --format=csv,noheader | head -1)
case "$gpu" in *H200*) ;; *) echo "$gpu: not an H200, nothing run"; exit 0 ;; esac
bash experiments/queue59/a.sh
bash experiments/queue65/a.sh
