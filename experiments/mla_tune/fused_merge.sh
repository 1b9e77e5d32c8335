#!/usr/bin/env bash
# The merge inside the split (`fuse_merge`, kernels/triton/mla_decode.py `_tail_merge`) against the two launches
# (split + merge kernel), both forms in one run: its GPU tests (NOTEST=1 skips them), batch 1 at 1K..128K and
# BATCHES (default 2..32) at 8K / 32K, then batch 1's partition counts PARTS under FUSE (default both forms).
# NCU=1 adds ncu of batch 1 / 8K both ways. Any GPU; nothing carried. Bundles under $OUT/fused/<gpu>/.
set -uo pipefail
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/k3out}; mkdir -p "$OUT/fused"
[ -z "${NOTEST:-}" ] && timeout 200 python3 -m pytest -q -m gpu tests/test_mla_triton.py -k "fused" 2>&1 | tail -n 4
B="python3 -m k3lab.cli bench mla --ops mla_decode --backends triton --no-peers --no-variants
   --skip torch_compile,reference --reps ${REPS:-30} --out $OUT/fused --grid heads=12"
F="--grid fuse_merge=${FUSE:-null,true}"
timeout 120 $B --grid batch=1 --grid context=1024,8192,32768,131072 $F --name mla_fused_b1 --deadline 100 2>&1 \
  | grep -E "^mla_decode" | cut -c1-110
timeout 250 $B --grid batch=${BATCHES:-2,4,8,16,32} --grid context=8192,32768 $F --name mla_fused_mid \
  --deadline 230 2>&1 | grep -E "^mla_decode" | cut -c1-110
[ -n "${PARTS:-}" ] && timeout 150 $B --grid batch=1 --grid context=1024,8192,32768 --grid partitions=$PARTS $F \
  --name mla_fused_parts --deadline 130 2>&1 | grep -E "^mla_decode" | cut -c1-110
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
exit 0
