#!/usr/bin/env bash
# The sixty-second session's first call (carry .gpu/cute): on an H200 first issue 14's bf16 grouped stages
# (experiments/queue59/a.sh, ~4 min); on any GPU then the batch-1 decode step with the CuTe GEMV's long inputs at
# UNROLL / PRE 16 / 16 (the default since the sixty-first session, measured alone on an H100) against 8 / 8 (the
# default before) and 12 / 12, arm against arm in one build (experiments/step_folds/step_ab.py long_k).
# Device: bash experiments/queue62/a.sh        (bundles under $OUT/q, the step A/B as $OUT/q/long_k_step_ab.json)
set -uo pipefail
eval "$(bash .gpu/cute/unpack.sh)"
. experiments/device_setup.sh q
if nvidia-smi --query-gpu=name --format=csv,noheader | grep -q H200; then
  bash experiments/queue59/a.sh
fi
ARMS=u16p16,u8p8,u12p12 timeout 330 python3 experiments/step_folds/step_ab.py "$OUT/q" long_k 2>&1 | tail -n 12
