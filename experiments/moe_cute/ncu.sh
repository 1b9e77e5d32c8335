#!/usr/bin/env bash
# ncu of the CuTe DSL MoE experts of one token (both launches of the third call) at TP (default 8): speed of light,
# occupancy, launch statistics, warp states, scheduler and instruction statistics and the source counters (the SASS
# lines with the most stalls) of each kernel, in $OUT/ncu_moe_cute_tp$TP.txt.
# Device (CuTe DSL unpacked): bash experiments/moe_cute/ncu.sh [TP]
set -uo pipefail
TP=${1:-8}
export PYTHONPATH=$PWD:${PYTHONPATH:-}
ncu --clock-control none -f -o "$OUT/moe_cute_tp$TP" --section SpeedOfLight --section Occupancy \
    --section LaunchStats --section WarpStateStats --section SchedulerStats --section MemoryWorkloadAnalysis \
    --section InstructionStats --section SourceCounters \
    -k regex:MoE --launch-skip 4 --launch-count 2 \
    python3 experiments/moe_simt/ncu_one.py 1 cute "$TP" > "$OUT/ncu_log_tp$TP.txt" 2>&1
ncu --import "$OUT/moe_cute_tp$TP.ncu-rep" --page details --print-details all > "$OUT/ncu_moe_cute_tp$TP.txt" 2>&1
rm -f "$OUT/moe_cute_tp$TP.ncu-rep"
grep -iE "^  [a-z_]+.*MoE|Duration|DRAM Throughput|Memory Throughput|Achieved Occupancy|Registers Per|Issue Slots Busy|Eligible Warps|Active Warps Per|Warp Cycles Per Issued|Stall" "$OUT/ncu_moe_cute_tp$TP.txt" | head -60
tail -5 "$OUT/ncu_log_tp$TP.txt"
