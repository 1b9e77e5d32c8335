#!/usr/bin/env bash
# The sixty-fourth session's first call (carry .gpu/cute):
#   1. experiments/kda_overlap/probe.py (Triton stand-in: does storing the KDA state in column chunks, each behind its
#      own sums, beat storing it after the whole state's sums at batch 8..64?);
#   2. experiments/kda_overlap/chunks.py (the CuTe decode's CHUNKS 1 / 2 / 4 / 8, plain and pdl, batch 4..64).
# Ran once (docs/NOTES_kda.md, sixty-fourth section); CHUNKS was removed after it: run at 8314089.
# Device: bash experiments/queue64/a.sh    (everything under $OUT)
set -uo pipefail
eval "$(bash .gpu/cute/unpack.sh)"
. experiments/device_setup.sh ov
BATCHES=16,8,24,64,12,32,4 timeout 330 python3 experiments/kda_overlap/chunks.py "$OUT/ov" 30 2>&1 | grep -v "^probes" | tail -n 70
timeout 100 python3 experiments/kda_overlap/probe.py "$OUT/ov" 2>&1 | tail -n 40
