#!/usr/bin/env bash
# Issue 14's same16 row (MXFP4, batch 8, every token on the same 16 experts, <= 1.2x batch 1) on one device call,
# carry .gpu/cute: MODE=... bash experiments/moe_grouped/same16_59.sh   (JSON / text under $OUT; tables last)
#   variants  the grouped kernels' module settings at batch 8 same16 beside batch 1's default (the one-token kernels)
#   split     each kernel's device time (eager, torch.profiler): one-token at batch 1, grouped at batch 8 same16
#   ncu       ncu of the same two pairs of kernels (third call)
#   unroll    UP_UNROLL (blocks of L an up step) 8 / 16 / 28 at batch 8 same16 and batch 64 uniform
#   lsplit    UP_LSPLIT (a shared group's up CTAs by parts of L, joined in global memory) off / on at batch 8 same16
#             and batch 16 / 64 uniform
#   (the sixtieth session's modes chunks / cap ran code that is gone: git history at 37d2bf7)
set -uo pipefail
eval "$(bash .gpu/cute/unpack.sh)"
. experiments/device_setup.sh b1
mkdir -p "$OUT/b8" "$OUT/b64"
case "${MODE:-variants}" in
variants)
  BATCHES=1 ROUTINGS=same16 VARIANTS='[{}]' timeout 150 python3 experiments/moe_grouped/variants.py "$OUT/b1" 20 \
    2>&1 | tail -n 2
  # (its run also timed {"UP_MEMBERS": 4}: that setting is removed, git history at 90ac0dc)
  V='[{}, {"UP_UNROLL": 4}, {"DOWN_TILES": 2}, {"DOWN_TILES": 1}, {"SHARE_FROM": 2}]'
  BATCHES=8 ROUTINGS=same16 VARIANTS="${VARIANTS:-$V}" timeout 380 python3 experiments/moe_grouped/variants.py \
    "$OUT/b8" 20 2>&1 | tail -n 10 ;;
split)
  KERNEL=moe_experts REPS=30 timeout 120 python3 experiments/moe_cute/kernel_split.py "$OUT/b1" 2>&1 | tail -n 4
  KERNEL=moe_grouped BATCH=8 ROUTING=same16 REPS=30 timeout 150 python3 experiments/moe_cute/kernel_split.py "$OUT/b8" \
    2>&1 | tail -n 4 ;;
ncu)
  for B in 8 1; do
    K=moe_grouped; [ "$B" = 1 ] && K=moe_experts
    ROUTING=same16 ncu --clock-control none -f -o "$OUT/ncu_b$B" --section SpeedOfLight --section Occupancy \
      --section LaunchStats --section WarpStateStats --section SchedulerStats --section MemoryWorkloadAnalysis \
      --section InstructionStats -k "regex:$K" --launch-skip 4 --launch-count 2 \
      python3 experiments/moe_simt/ncu_one.py "$B" cute 8 > "$OUT/ncu_log_b$B.txt" 2>&1
    ncu --import "$OUT/ncu_b$B.ncu-rep" --page details --print-details all > "$OUT/ncu_same16_b$B.txt" 2>&1
    rm -f "$OUT/ncu_b$B.ncu-rep"
    grep -iE "Duration|DRAM Throughput|Achieved Occupancy|Registers Per|Grid Size|Eligible Warps" \
      "$OUT/ncu_same16_b$B.txt" | head -20
  done ;;
unroll)
  V='[{}, {"UP_UNROLL": 16}, {"UP_UNROLL": 28}]'
  BATCHES=8 ROUTINGS=same16 VARIANTS="$V" timeout 200 python3 experiments/moe_grouped/variants.py "$OUT/b8" 20 \
    2>&1 | tail -n 4
  BATCHES=64 ROUTINGS=uniform VARIANTS="$V" timeout 250 python3 experiments/moe_grouped/variants.py "$OUT/b64" 15 \
    2>&1 | tail -n 4 ;;
lsplit)
  V='[{}, {"UP_LSPLIT": true}]'
  BATCHES=8 ROUTINGS=same16 VARIANTS="$V" timeout 150 python3 experiments/moe_grouped/variants.py "$OUT/b8" 20 \
    2>&1 | tail -n 3
  BATCHES=16,64 ROUTINGS=uniform VARIANTS="$V" timeout 200 python3 experiments/moe_grouped/variants.py "$OUT/b64" 15 \
    2>&1 | tail -n 6 ;;
esac
