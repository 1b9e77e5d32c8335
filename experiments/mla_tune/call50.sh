#!/usr/bin/env bash
# The fiftieth session's H100 call: the split's reciprocal and the shared merge body against the trees before them (ab_trees.sh, ab_old = b0537fe~1, ab_mid = b0537fe), then 8 warps (and 8 warps at 64 positions a step, 2 stages) against the rule.
export PYTHONPATH=$PWD:$PYTHONPATH; nvidia-smi --query-gpu=name --format=csv,noheader
pip install -q --no-deps --no-build-isolation -e . >/dev/null 2>&1
ROUNDS=1 OUT=$OUT timeout 280 bash experiments/mla_tune/ab_trees.sh 2>&1 | tail -n 14
B="python3 -m k3lab.cli bench mla --ops mla_decode --backends triton --no-peers --no-variants --skip torch_compile,reference --reps 30 --grid heads=12 --out $OUT/warps"
timeout 100 $B --grid batch=1 --grid context=1024,8192,32768 --grid num_warps=null,8 --name mla_warps8_b1 --deadline 80 2>&1 | grep -E "^mla_decode" | cut -c1-150
timeout 80 $B --grid batch=8,32 --grid context=8192 --grid num_warps=null,8 --name mla_warps8_mid --deadline 60 2>&1 | grep -E "^mla_decode" | cut -c1-150
timeout 80 $B --grid batch=1,8 --grid context=8192 --grid num_warps=8 --grid block_n=64 --grid num_stages=2 --name mla_warps8_bn64 --deadline 60 2>&1 | grep -E "^mla_decode" | cut -c1-150
R0=1 ROUNDS=1 TREES=ab_old OUT=$OUT timeout $((575 - SECONDS)) bash experiments/mla_tune/ab_trees.sh 2>&1 | tail -n 14
