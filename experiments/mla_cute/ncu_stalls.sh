#!/bin/bash
# Warp stall reasons of the CuTe MLA decode kernel (third call of one configuration; ncu_one.py's arguments):
#   bash experiments/mla_cute/ncu_stalls.sh OUT ctx P cluster stages
out=$1; shift
m=smsp__average_warp_latency_issue_stalled
ms=""
for r in barrier long_scoreboard short_scoreboard mio_throttle math_pipe_throttle wait sleeping membar lg_throttle \
         dispatch_stall no_instruction selected not_selected tex_throttle drain branch_resolving misc imc_miss; do
  ms="$ms,smsp__average_warps_issue_stalled_${r}_per_issue_active.ratio"
done
ncu --clock-control none --kernel-name regex:MLADecode --launch-skip 2 --launch-count 1 \
    --metrics "gpu__time_duration.sum,smsp__issue_active.avg.per_cycle_active,dram__throughput.avg.pct_of_peak_sustained_elapsed${ms}" \
    python experiments/mla_cute/ncu_one.py "$@" > "$out" 2>&1
