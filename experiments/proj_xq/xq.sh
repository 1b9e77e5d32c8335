#!/usr/bin/env bash
# Option xq (kernels/triton/proj_gemv.py): fp8 weights times x split into two e4m3 terms, e4m3 MMAs, nothing widened,
# against the default (weights widened to f16 / bf16 in registers) and cuBLAS on the bf16 dequantized weights, one
# device call on any GPU, no .gpu/ archive. Every row is checked against fp64 before it is timed.
#   base  the default path with xq off / on, peers cuBLAS and the stream (TP8, batch 1 / 8 / 32 / 64)
#   bn64  xq on 64-row W tiles (warpgroup MMAs where the default tile is 16 / 32 rows)
#   tma   xq on path tma (W and the split x through the copy engine)
#   tp16  TP16's short projections, default and xq
# Bundles xq_<name> under $OUT/xq; a short table last.
set -uo pipefail
. experiments/device_setup.sh xq
K="python3 -m k3lab.cli bench trunk --ops proj --backends triton --no-variants --skip torch_compile,reference
   --reps ${REPS:-20} --grid wdtype=fp8 --grid batch=${BATCH:-1,8,32,64} --out $OUT/xq"
run() {  # name, seconds, grid flags...
  local n=$1 s=$2; shift 2
  timeout $((s + 30)) $K --name "xq_$n" --deadline "$s" "$@" 2>&1 | grep -E "rror|Traceback" | head -5
}
P8=${PROJS:-kda_q,kda_o,mla_uq,moe_down,shared_w2,mla_dkv}
run base 170 --grid preset=tp8 --grid proj=$P8 --grid xq=null,true
run bn64 80 --no-peers --grid preset=tp8 --grid proj=$P8 --grid xq=true --grid block_n=64
run tma 80 --no-peers --grid preset=tp8 --grid proj=$P8 --grid xq=true --grid path=tma
run tp16 90 --grid preset=tp16 --grid proj=mla_uq,kda_o,shared_w2 --grid xq=null,true
python3 experiments/proj_b64/table.py "$OUT/xq" > "$OUT/xq/table.txt"
awk '/^==/ {print; next} {printf "%s %s %s %s %s %s\n", $1, $2, $4, $5, $6, $7 " " substr($0, index($0, "{"))}' \
  "$OUT/xq/table.txt" | cut -c1-100
