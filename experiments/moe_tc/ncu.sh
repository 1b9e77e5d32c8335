#!/usr/bin/env bash
# ncu of the MXFP4 tc path at BATCH tokens (default 256; one launch of its third call): speed of light, occupancy,
# warp states, scheduler and memory workload, in $OUT/ncu_moe_tc_b$BATCH.txt. Device: bash experiments/moe_tc/ncu.sh [BATCH]
set -uo pipefail
B=${1:-256}
export PYTHONPATH=$PWD:${PYTHONPATH:-}
ncu --clock-control none -f -o "$OUT/moe_tc_b$B" --section SpeedOfLight --section Occupancy --section LaunchStats \
    --section WarpStateStats --section SchedulerStats --section MemoryWorkloadAnalysis \
    -k regex:_moe_tc_kernel --launch-skip 2 --launch-count 1 \
    python3 experiments/moe_simt/ncu_one.py "$B" triton 8 tc > "$OUT/ncu_log_tc_b$B.txt" 2>&1
ncu --import "$OUT/moe_tc_b$B.ncu-rep" --page details --print-details all > "$OUT/ncu_moe_tc_b$B.txt" 2>&1
rm -f "$OUT/moe_tc_b$B.ncu-rep"
grep -iE "Duration|DRAM Throughput|Achieved Occupancy|Registers Per|Issue Slots Busy|Eligible Warps|Warp Cycles Per Issued|Stall" \
    "$OUT/ncu_moe_tc_b$B.txt" | head -40
tail -5 "$OUT/ncu_log_tc_b$B.txt"
