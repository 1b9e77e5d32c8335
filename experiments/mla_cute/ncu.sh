#!/bin/bash
# ncu of the CuTe MLA decode kernel (the third call of each configuration), stall reasons and throughput:
#   bash experiments/mla_cute/ncu.sh OUT ctx P cluster stages [...]
out=$1; shift
ncu --clock-control none --kernel-name regex:MLADecode --launch-skip 2 --launch-count 1 \
    --section SpeedOfLight --section WarpStateStats --section SchedulerStats --section LaunchStats --section Occupancy \
    --section MemoryWorkloadAnalysis python experiments/mla_cute/ncu_one.py "$@" > "$out" 2>&1
