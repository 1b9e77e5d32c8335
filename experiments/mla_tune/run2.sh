#!/usr/bin/env bash
# Second MLA sweep (after ptxas showed the split kernel at 254 registers a thread, 1-2 CTAs an SM, and the
# loop unpipelined: num_stages changed nothing): more pieces (partitions up to 512) against the register
# prefetch of the next block (with 8 warps: 4 warps spill), at batch 1; block_n x prefetch x warps at 64.
set -uo pipefail
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0
pip install -q --no-deps --no-build-isolation -e . >/dev/null 2>&1; export PYTHONPATH=$PWD
K="python3 -m k3lab.cli bench mla --backends triton --no-peers --reps ${REPS:-20} --out $OUT/tune"
$K --ops mla_decode --name dec2_b1 --grid batch=1 --grid context=1024,8192,32768,131072 --grid partitions=32,64,128,256,512 \
   --grid prefetch=false,true --grid num_warps=4,8 --deadline 200 2>&1 | tail -n 82
$K --ops mla_decode --name dec2_b64 --grid batch=64 --grid context=8192,32768 --grid block_n=32,64 \
   --grid prefetch=false,true --grid num_warps=4,8 --deadline 100 2>&1 | tail -n 18
