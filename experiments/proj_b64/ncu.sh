#!/usr/bin/env bash
# ncu of the batch-64 projections (issue 13's "ours / cuBLAS < 1" rows): ours (Triton default, and the tma path at
# 8 warps) against cuBLAS; speed of light, launch, occupancy, warp states, memory; every kernel of the call (cuBLAS
# may run a split-K reduction kernel of its own). Writes $OUT/proj_ncu.txt. WHOS (";"-separated) replaces the three
# arms, WDTYPE=fp8 profiles fp8 weights, SECTIONS adds ncu sections (e.g. "InstructionStats ComputeWorkloadAnalysis").
# BATCH (64) sets the batch; an arm "cute" needs .gpu/cute unpacked, "stream" is the read probe over the same bytes.
# Device (no archives needed): bash experiments/proj_b64/ncu.sh [PROJ ...]
set -uo pipefail
OUT=${OUT:-/tmp}
for P in ${@:-shared_w1 kda_q}; do
  IFS=";" read -ra ARMS <<< "${WHOS:-ours;ours path=tma num_warps=8;cublas}"
  for who in "${ARMS[@]}"; do
    set -- $who
    EXTRA=""
    for s in ${SECTIONS:-}; do EXTRA="$EXTRA --section $s"; done
    ncu --clock-control none --nvtx --nvtx-include "target/" --section SpeedOfLight --section Occupancy \
        --section LaunchStats --section WarpStateStats --section MemoryWorkloadAnalysis --section SchedulerStats $EXTRA \
        python3 experiments/proj_b64/one.py "$1" "$P" ${BATCH:-64} "${@:2}" > /tmp/ncu_one.txt 2>&1
    { echo "=== $who $P batch ${BATCH:-64} ${WDTYPE:-bf16}"; grep -vE "^==PROF==|^\s*$" /tmp/ncu_one.txt; } >> "$OUT/proj_ncu.txt"
  done
done
grep -E "===|^  [a-zA-Z_].*\(|Duration|DRAM Through|L2 Cache Through|Registers Per|Block Size|Grid Size|Achieved Occ|Warp Cycles Per Issued|Eligible|Dynamic Shared|Local Memory" "$OUT/proj_ncu.txt" | head -120
