# fp8 projections at batch 33 / 64 (batch tile 64): the dot path's MMA orientation (xa) x W rows a tile, and the tma
# path for fp8 (W [BN, BK] e4m3 through the copy engine, widened in registers); rows beside cuBLAS. GRID overrides.
export PYTHONPATH=$PWD:$PYTHONPATH NCCL_NVLS_ENABLE=0
pip install -q --no-deps --no-build-isolation -e . >/dev/null 2>&1
K="python3 -m k3lab.cli"
timeout ${TMO:-280} $K bench trunk --ops proj --backends triton --no-variants --skip torch_compile,reference,stream --reps 20 \
  --out $OUT/xa --grid preset=tp8,tp16 --grid wdtype=fp8 --grid batch=64,33 \
  --grid proj=kda_o,shared_w2,mla_o,kda_q,moe_down,mla_dkv,shared_w1,moe_router,mla_uq,kda_b \
  ${GRID:---grid xa=null,false --grid block_n=null,16,64} --name ${NAME:-fp8_xa} --deadline ${DL:-260} 2>&1 \
  | grep -E "^proj" | cut -c1-125 > $OUT/${NAME:-fp8_xa}.txt
tail -n 3 $OUT/${NAME:-fp8_xa}.txt
