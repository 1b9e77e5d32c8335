#!/usr/bin/env bash
# ncu of the KDA decode at batch B (default 8), ours (CuTe, auto) against FlashInfer's fused decode: speed of light,
# occupancy, launch, warp-state and memory sections; writes $OUT/kda_ncu_b$B.txt (both, details page).
# Device (carry .gpu/cute and .gpu/fi): bash experiments/kda_ncu/ncu.sh [B]
set -uo pipefail
B=${1:-8}
for who in ours fi; do
  ncu --clock-control none --nvtx --nvtx-include "target/" --section SpeedOfLight --section Occupancy \
      --section LaunchStats --section WarpStateStats --section MemoryWorkloadAnalysis --section SchedulerStats \
      python3 experiments/kda_ncu/one.py "$who" "$B" > "/tmp/ncu_${who}_$B.txt" 2>&1
  { echo "=== $who batch $B"; grep -vE "^==PROF==|^\s*$" "/tmp/ncu_${who}_$B.txt"; } >> "$OUT/kda_ncu_b$B.txt"
done
grep -E "===|Duration|DRAM Through|Registers Per|Block Size|Grid Size|Achieved Occ|Theoretical Occ|Warp Cycles Per Issued|Issued Ipc|Eligible|Stall|Shared Memory Config|Dynamic Shared" "$OUT/kda_ncu_b$B.txt" | head -60
