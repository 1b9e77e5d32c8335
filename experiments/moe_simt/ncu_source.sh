#!/usr/bin/env bash
# Per-instruction (SASS) warp-stall samples of the simt experts kernel at batch BATCH (default 1), for the study in
# README.md: writes $OUT/simt_b$BATCH.ncu-rep, $OUT/src_b$BATCH.csv (the source page) and $OUT/stalls_b$BATCH.txt
# (the warp-state details). Device: bash experiments/moe_simt/ncu_source.sh [BATCH]
set -uo pipefail
B=${1:-1}
export PYTHONPATH=$PWD
ncu --clock-control none -f -o "$OUT/simt_b$B" --section SourceCounters --section WarpStateStats \
    --section SchedulerStats -k regex:_moe_simt --launch-skip 2 --launch-count 1 \
    python3 experiments/moe_simt/ncu_one.py "$B" > "$OUT/ncu_log_b$B.txt" 2>&1
ncu --import "$OUT/simt_b$B.ncu-rep" --page source --csv --print-source sass > "$OUT/src_b$B.csv" 2>&1
ncu --import "$OUT/simt_b$B.ncu-rep" --page details --print-details all > "$OUT/stalls_b$B.txt" 2>&1
head -c 600 "$OUT/src_b$B.csv"; echo; grep -iE "stall|issue|eligible|active warps" "$OUT/stalls_b$B.txt" | head -40
