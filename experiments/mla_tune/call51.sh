#!/usr/bin/env bash
# The fifty-first session's H200 call (.gpu/base, fi, fijit carried): issue 13's fp8 projection rows under the rules of
# this tree (mla_uq's 16-row tiles at batch 32), then issue 12's mid-batch MLA rows beside FlashInfer fa3 with the
# fused merge (bundles proj_fp8_47, mla_parts_h200: the names issue 12 / 13's targets read); a short budget, so
# deadlines of 150 / 210 s. Elsewhere (an H100): the fp8 batch-32 rule against 32-row tiles, mla_uq and kda_fb;
# page 64's preloaded indices 16 / 64 / 128 a step at batch 8 / 16 / 32.
# Everything under $OUT/q, packed into $OUT/q.tgz.
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
G=$(nvidia-smi --query-gpu=name --format=csv,noheader); echo "$G"
pip install -q --no-deps --no-build-isolation -e . >/dev/null 2>&1
mkdir -p "$OUT/q"
P="python3 -m k3lab.cli bench trunk --ops proj --backends triton --no-variants --skip torch_compile,reference,stream
   --reps 20 --out $OUT/q --grid wdtype=fp8"
if echo "$G" | grep -q H200; then
  for a in base fi fijit; do eval "$(bash .gpu/$a/unpack.sh)"; done
  timeout 170 $P --grid preset=tp8,tp16 --grid batch=1,8,16,32,64 \
    --grid proj=shared_w1,kda_q,kda_o,mla_dkv,mla_uq,moe_router,kda_b,moe_down,shared_w2 --name proj_fp8_47 \
    --deadline ${D1:-150} 2>&1 | tail -n 1
  timeout 230 python3 -m k3lab.cli bench mla --ops mla_decode --backends triton --no-variants \
    --skip torch_compile,reference,flashinfer_fa2 --reps 30 --grid heads=12 --grid batch=8,16,32 \
    --grid context=8192,32768 --name mla_parts_h200 --out "$OUT/q" --deadline ${D2:-210} 2>&1 | grep -E "^mla_decode" \
    | cut -c1-120 | tail -n 18
else
  timeout 100 $P --grid preset=tp8,tp16 --grid batch=32 --grid proj=mla_uq,kda_fb --grid block_n=null,16,32 \
    --name fp8_b32_rule --deadline 80 2>&1 | grep -E "^proj" | cut -c1-120
  # page 64's preloaded indices a step (16 by default): each outer step drains the block loop's pipeline
  timeout 200 python3 -m k3lab.cli bench mla --ops mla_decode --backends triton --no-variants --no-peers --reps 20 \
    --grid heads=12 --grid batch=8,16,32 --grid context=8192,32768 --grid page_size=64 \
    --grid preload_pages=null,64,128 --name mla_npg --out "$OUT/q" --deadline 180 2>&1 | grep -E "^mla_decode" \
    | cut -c1-120
fi
cd "$OUT" && tar czf q.tgz q && rm -rf q
