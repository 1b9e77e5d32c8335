#!/usr/bin/env bash
# The merge inside the split (`fuse_merge`, kernels/triton/mla_decode.py `_tail_merge`) against the two launches
# (split + merge kernel): its GPU tests, then batch 1 at 1K..128K and batch 2..16 at 8K / 32K, both forms in one run.
# Any GPU; nothing carried. Bundles under $OUT/fused/<gpu>/.
set -uo pipefail
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/k3out}; mkdir -p "$OUT/fused"
timeout 200 python3 -m pytest -q -m gpu tests/test_mla_triton.py -k "fused" 2>&1 | tail -n 4
B="python3 -m k3lab.cli bench mla --ops mla_decode --backends triton --no-peers --no-variants
   --skip torch_compile,reference --reps ${REPS:-30} --out $OUT/fused --grid heads=12"
timeout 150 $B --grid batch=1 --grid context=1024,8192,32768,131072 --grid fuse_merge=null,true --name mla_fused_b1 \
  --deadline 130 2>&1 | grep -E "^mla_decode" | cut -c1-110
timeout 150 $B --grid batch=2,4,8,16 --grid context=8192,32768 --grid fuse_merge=null,true --name mla_fused_mid \
  --deadline 130 2>&1 | grep -E "^mla_decode" | cut -c1-110
# the partition count under the fused merge at batch 1 (the rule was swept with the merge kernel)
timeout 150 $B --grid batch=1 --grid context=1024,8192,32768 --grid partitions=16,32,64,128 --grid fuse_merge=true \
  --name mla_fused_parts --deadline 130 2>&1 | grep -E "^mla_decode" | cut -c1-110
# NCU=1: the split kernel alone at batch 1 / 8K, merge kernel after it or inside (durations, warp states)
if [ -n "${NCU:-}" ]; then
  for o in "" "fuse_merge=true"; do
    ncu --clock-control none --kernel-name regex:_mla_ --launch-skip 4 --launch-count 2 --section SpeedOfLight \
        --section Occupancy --section LaunchStats --section WarpStateStats --section MemoryWorkloadAnalysis \
        python3 experiments/mla_tune/ncu_split.py 1 8192 $o > /tmp/ncu_mla.txt 2>&1
    { echo "=== batch 1 8K $o"; grep -vE "^==PROF==|^\s*$" /tmp/ncu_mla.txt; } >> "$OUT/fused/ncu_b1.txt"
  done
  grep -E "===|^  [a-zA-Z_].*\(|Duration|DRAM Through|Registers Per|Grid Size|Achieved Occ|Warp Cycles Per Issued|Eligible" \
    "$OUT/fused/ncu_b1.txt" | head -60
fi
