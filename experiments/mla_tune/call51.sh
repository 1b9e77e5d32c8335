#!/usr/bin/env bash
# The fifty-first session's H200 call (.gpu/base, fi, fijit carried): issue 13's fp8 projection rows under the rules of
# this tree (mla_uq's 16-row tiles at batch 32), then issue 12's mid-batch MLA rows beside FlashInfer fa3 with the
# fused merge (bundles proj_fp8_47, mla_parts_h200: the names issue 12 / 13's targets read); a short budget, so
# deadlines of 150 / 210 s. Elsewhere (an H100): the MLA rows beside fa3 alone (bundle mla_parts_fa3; until the
# fifty-third session this branch timed the fp8 split rule at batch 2 / 4 / 16 and experiments/proj_b64/xasm.py, git history at 53779a6).
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
  # (fifty-third session: the split rule and xasm ran here; now) issue 12's mid-batch rows beside fa3 on this GPU, as
  # a proxy of the H200 branch's second bundle
  for a in base fi fijit; do eval "$(bash .gpu/$a/unpack.sh)"; done
  timeout 230 python3 -m k3lab.cli bench mla --ops mla_decode --backends triton --no-variants \
    --skip torch_compile,reference,flashinfer_fa2 --reps 30 --grid heads=12 --grid batch=8,16,32 \
    --grid context=8192,32768 --name mla_parts_fa3 --out "$OUT/q" --deadline ${D2:-210} 2>&1 | grep -E "^mla_decode" \
    | cut -c1-120 | tail -n 18
fi
cd "$OUT" && tar czf q.tgz q && rm -rf q
