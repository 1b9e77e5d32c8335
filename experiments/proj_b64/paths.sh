# fp8 projections from a batch tile of 32 / 64 / 128 on each path beside cuBLAS: the rule (null), dot and tma, over the
# projections the tma rule takes or leaves (FP8_TMA_MIN_BATCH, docs/NOTES_trunk.md). GRID / PROJS / BATCHES / NAME
# PRESETS / REPS override; the dot path's x @ W^T orientation (knob xa, lost) ran here at aabf688 (git history).
#   bash experiments/proj_b64/paths.sh          ->  $OUT/paths/<gpu>/$NAME.json, $OUT/$NAME.txt (the table's rows)
export PYTHONPATH=$PWD:$PYTHONPATH NCCL_NVLS_ENABLE=0
pip install -q --no-deps --no-build-isolation -e . >/dev/null 2>&1
K="python3 -m k3lab.cli"
NAME=${NAME:-fp8_paths}
timeout ${TMO:-280} $K bench trunk --ops proj --backends triton --no-variants --skip torch_compile,reference,stream --reps ${REPS:-20} \
  --out $OUT/paths --grid preset=${PRESETS:-tp8,tp16} --grid wdtype=fp8 --grid batch=${BATCHES:-32,33,64,128} \
  --grid proj=${PROJS:-moe_down,moe_up,kda_q,mla_dq,mla_gate,moe_router,kda_o} ${GRID:---grid path=null,dot,tma} \
  --name $NAME --deadline ${DL:-260} 2>&1 | grep -E "^proj" | cut -c1-125 > $OUT/$NAME.txt
tail -n 3 $OUT/$NAME.txt
