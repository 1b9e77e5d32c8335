#!/usr/bin/env bash
# fp8 weights at batch 32 (issue 13's "ours / cuBLAS < 1" rows: the H200's proj_fp8_47 has mla_uq at 1.47-1.55x
# cuBLAS, shared_w2 / kda_o / moe_down at 1.04-1.10x; mla_uq takes 8.0-8.2 us at batch 32 against 4.9-5.8 at 16),
# one device call on any GPU, no .gpu/ archive: each launch knob of the dot path varied alone from the default (split-K
# ranges, W rows a tile, warps, stages, the reduce, path tma, f16 MMAs), the default beside cuBLAS in every bundle.
# Bundles fp8_b32_<knob> under $OUT/fp8_b32, packed into $OUT/fp8_b32.tgz; a short table last.
set -uo pipefail
. experiments/device_setup.sh fp8_b32
K="python3 -m k3lab.cli bench trunk --ops proj --backends triton --no-variants --skip torch_compile,reference,stream
   --reps ${REPS:-20} --grid preset=tp8,tp16 --grid batch=${BATCH:-32} --grid wdtype=fp8
   --grid proj=${PROJS:-mla_uq,kda_o,shared_w2,moe_down} --out $OUT/fp8_b32"
run() {  # name, seconds, grid flags...
  local n=$1 s=$2; shift 2
  timeout $((s + 20)) $K --name "fp8_b32_$n" --deadline "$s" "$@" 2>&1 | tail -n 1
}
run split 70 --grid split_k=null,1,2,4,6
run bn 50 --no-peers --grid block_n=16,64
run warps 50 --no-peers --grid num_warps=2,8
run stages 50 --no-peers --grid num_stages=2,3,6
run path 50 --no-peers --grid path=tma --grid reduce=null,kernel
run f16 40 --no-peers --grid f16=true
python3 experiments/proj_b64/table.py "$OUT/fp8_b32" > "$OUT/fp8_b32/table.txt"
tar czf "$OUT/fp8_b32.tgz" -C "$OUT" fp8_b32 && rm -rf "${OUT:?}/fp8_b32"
tar xzf "$OUT/fp8_b32.tgz" -O fp8_b32/table.txt | awk '/^==/ {print; next} {printf "%s %s %s %s %s %s\n", $1, $2, $4, $6, $7, substr($0, index($0, "{"))}' | cut -c1-110
