#!/usr/bin/env bash
# The cute path "mma" (kernels/cute/proj_mma.py: weights straight into m16n8k16 fragments, no layout copy) on fp8
# weights at batch 1 / 8, where the Triton dot path executes ~5 thread instructions a weight (ncu_small.sh): timed
# beside the Triton default, the cute GEMV and the stream peer, its clusters varied; then ncu of it at batch 1.
# .gpu/cute carried. Device: bash experiments/proj_b64/mma_small.sh   ($OUT/mma_small.tgz)
set -uo pipefail
. experiments/device_setup.sh mma_small
eval "$(bash .gpu/cute/unpack.sh)"
O=$OUT; export OUT=$O/mma_small
B="python3 -m k3lab.cli bench trunk --ops proj --no-variants --skip torch_compile,reference,cublas --reps 20
   --grid preset=tp8 --grid batch=${BATCHES:-1,8} --grid wdtype=fp8 --grid proj=${PROJS:-kda_q,kda_o,moe_down} --out $OUT"
timeout 100 $B --backends triton,cute --name mma_base --deadline 80 2>&1 | tail -n 1
timeout 160 $B --backends cute --no-peers --grid path=mma --grid cluster=null,1,2,4 --grid tile_m=null,16,32 \
  --name mma_grid --deadline 140 2>&1 | tail -n 1
SECTIONS="InstructionStats ComputeWorkloadAnalysis" WDTYPE=fp8 BATCH=1 WHOS="cute path=mma" \
  bash experiments/proj_b64/ncu.sh moe_down kda_q > /dev/null
python3 experiments/proj_b64/table.py "$OUT" | cut -c1-90
grep -E "===|Duration|DRAM Through|Registers Per|Grid Size|Cluster Size|Achieved Occ|Warp Cycles Per Issued|Executed Ipc A|Executed Instructions  |Dynamic Shared" \
  "$OUT/proj_ncu.txt" | cut -c1-100
tar czf "$O/mma_small.tgz" -C "$O" mma_small && rm -rf "${O:?}/mma_small"
