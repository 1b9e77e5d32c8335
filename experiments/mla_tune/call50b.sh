#!/usr/bin/env bash
# The fiftieth session's second call. On an H200 (.gpu/base, fi, fijit carried): issue 12's mid-batch MLA rows beside
# FlashInfer fa3 with the fused merge (q47 PART=3's MLA half, bundle mla_parts_h200). Elsewhere: the split's
# reciprocal with the merge kernel's own body back against b0537fe~1 (ab_trees.sh, TREES=ab_old, two rounds), unless
# H200_ONLY is set (then nothing). MLA_GRID / DEADLINE narrow the H200 half for a short budget.
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
G=$(nvidia-smi --query-gpu=name --format=csv,noheader); echo "$G"
pip install -q --no-deps --no-build-isolation -e . >/dev/null 2>&1
if echo "$G" | grep -q H200; then
  for a in base fi fijit; do eval "$(bash .gpu/$a/unpack.sh)"; done
  timeout 230 python3 -m k3lab.cli bench mla --ops mla_decode --backends triton --no-variants \
    --skip torch_compile,reference,flashinfer_fa2 --reps 30 --grid heads=12 ${MLA_GRID:---grid batch=8,16,32 --grid context=8192,32768} \
    --name mla_parts_h200 --out "$OUT/q50" --deadline ${DEADLINE:-200} 2>&1 | grep -E "^mla_decode" | cut -c1-120 | tail -n 18
elif [ -z "${H200_ONLY:-}" ]; then
  TREES=ab_old ROUNDS=2 timeout 400 bash experiments/mla_tune/ab_trees.sh 2>&1 | tail -n 8
fi
