#!/usr/bin/env bash
# The sixty-sixth session's first call on whatever GPU comes (carry .gpu/cute): CuTe DSL unpacked into /root/k3site
# (kept on the warm machine for the next call, queue64/b.sh with .gpu/fi), then, on an H200 only, the queue's H200
# items (experiments/queue65/h200.sh: issue 14's bf16 stages, issue 13's chained projections and groups).
# Device: bash experiments/queue66/first.sh    (everything under $OUT/q)
set -uo pipefail
eval "$(bash .gpu/cute/unpack.sh)"
nvidia-smi --query-gpu=name --format=csv,noheader
bash experiments/queue65/h200.sh
