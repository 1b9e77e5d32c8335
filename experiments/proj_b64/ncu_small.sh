#!/usr/bin/env bash
# Why fp8 projections at batch 1..8 run at 1.6-1.7x the stream peer (H200 proj_fp8_47 / proj_cute_fp8: TP8 moe_down
# batch 1 triton 13.56, cute 9.55, stream 7.80 us; kda_q 8.33 / 7.17 / 5.13) while bf16 runs at 1.15x: ncu of ours
# (Triton dot path), cute and the stream peer at batch 1, ours at batch 8, and bf16 at batch 1 for reference; then the
# timing rows of the same shapes (batch 1 / 2 / 4 / 8) beside cuBLAS. .gpu/cute carried.
# Device: bash experiments/proj_b64/ncu_small.sh   ($OUT/ncu_small.tgz: proj_ncu.txt and the bundle)
set -uo pipefail
. experiments/device_setup.sh ncu_small
eval "$(bash .gpu/cute/unpack.sh)"
O=$OUT; export OUT=$O/ncu_small SECTIONS="InstructionStats ComputeWorkloadAnalysis"
WDTYPE=fp8 BATCH=1 WHOS="ours;cute;stream" bash experiments/proj_b64/ncu.sh moe_down kda_q > /dev/null
WDTYPE=fp8 BATCH=8 WHOS="ours" bash experiments/proj_b64/ncu.sh moe_down > /dev/null
WDTYPE=bf16 BATCH=1 WHOS="ours;stream" bash experiments/proj_b64/ncu.sh moe_down > /dev/null
timeout 150 python3 -m k3lab.cli bench trunk --ops proj --backends triton,cute --no-variants \
  --skip torch_compile,reference --reps 20 --grid preset=tp8 --grid batch=1,2,4,8 --grid wdtype=fp8 \
  --grid proj=kda_q,kda_o,moe_down --out "$OUT" --name fp8_small --deadline 130 2>&1 | tail -n 1
python3 experiments/proj_b64/table.py "$OUT" | cut -c1-60
grep -E "===|Duration|DRAM Through|Registers Per|Grid Size|Achieved Occ|Warp Cycles Per Issued|Executed Ipc A|Issue Slots Busy" \
  "$OUT/proj_ncu.txt" | cut -c1-100
tar czf "$O/ncu_small.tgz" -C "$O" ncu_small && rm -rf "${O:?}/ncu_small"
