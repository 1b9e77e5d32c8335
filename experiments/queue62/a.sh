#!/usr/bin/env bash
# The sixty-second session's first call (carry .gpu/cute): on an H200 first issue 14's bf16 grouped stages
# (experiments/queue59/a.sh, ~4 min); on any GPU then the batch-1 decode step with the CuTe GEMV's long inputs at
# several UNROLL / PRE, arm against arm in one build (experiments/step_folds/step_ab.py long_k; ARMS, default
# u8p8,u16p8,u8p16: which of the two knobs cost the step when 16 / 16 ran, ~47 us on an H100 with
# ARMS=u16p16,u8p8,u12p12, profiles/h100-80gb-hbm3/long_k62_step_ab.json.gz, git history at 5085684).
# Device: bash experiments/queue62/a.sh        (bundles under $OUT/q, the step A/B as $OUT/q/long_k_step_ab.json)
set -uo pipefail
eval "$(bash .gpu/cute/unpack.sh)"
. experiments/device_setup.sh q
if nvidia-smi --query-gpu=name --format=csv,noheader | grep -q H200; then
  bash experiments/queue59/a.sh
fi
ARMS=${ARMS:-u8p8,u16p8,u8p16} timeout 330 python3 experiments/step_folds/step_ab.py "$OUT/q" long_k 2>&1 | tail -n 12
