#!/usr/bin/env bash
# The sixty-fifth session's ncu call (carry .gpu/cute; any GPU): what bounds the fp8 one-token experts (issue 14's
# batch-1 fp8 row, 67.6 % of read on the H200 where bf16 reads 88.6 %) and the fp8 CuTe GEMV (moe_down 61 % against
# bf16 75 %): speed of light, pipe utilization, warp states, against their bf16 twins. $OUT/ncu65.txt.
# Device: [WHO="moe_fp8 ..."] bash experiments/queue65/ncu.sh
set -uo pipefail
eval "$(bash .gpu/cute/unpack.sh)"
. experiments/device_setup.sh q
for who in ${WHO:-moe_fp8 moe_bf16 proj_fp8 proj_bf16}; do
  timeout 120 ncu --clock-control none --nvtx --nvtx-include "target/" --section SpeedOfLight --section Occupancy \
      --section LaunchStats --section WarpStateStats --section SchedulerStats --section ComputeWorkloadAnalysis \
      --section InstructionStats python3 experiments/queue65/one.py "$who" > "/tmp/ncu_$who.txt" 2>&1
  { echo "=== $who"; grep -vE "^==PROF==|^\s*$" "/tmp/ncu_$who.txt"; } >> "$OUT/q/ncu65.txt"
done
grep -E "===|  [a-z_]+.*\(|Duration|DRAM Through|Registers Per|Block Size|Grid Size|Achieved Occ|Warp Cycles Per Issued|Issued Ipc|Eligible|Executed Ipc|Pipe|Stall" "$OUT/q/ncu65.txt" | cut -c1-130 | head -90
