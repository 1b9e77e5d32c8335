#!/usr/bin/env bash
# The MLA option sweep on the H200 (through the device tool, no archives carried): decode at batch 1 over
# block_n x num_stages x pdl, at batch 64 over block_n x num_stages x num_warps; the combine over pdl, block_r,
# block_v. Bundles under $OUT/tune/<gpu>/; the chosen defaults go into the kernels (docs/NOTES_mla.md).
set -uo pipefail
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0
pip install -q --no-deps --no-build-isolation -e . >/dev/null 2>&1; export PYTHONPATH=$PWD
K="python3 -m k3lab.cli bench mla --backends triton --no-peers --reps ${REPS:-20} --out $OUT/tune"
$K --ops mla_decode --name dec_b1 --grid batch=1 --grid context=1024,8192,32768 --grid block_n=32,64 \
   --grid num_stages=2,3 --grid pdl=false,true --deadline 100 2>&1 | tail -n 26
$K --ops mla_decode --name dec_b64 --grid batch=64 --grid context=8192,32768 --grid block_n=32,64 \
   --grid num_stages=2,3,4 --grid num_warps=4,8 --deadline 100 2>&1 | tail -n 26
$K --ops mla_combine --name comb --grid heads=12 --grid batch=1 --grid partitions=8,16,32 --grid pdl=false,true \
   --deadline 30 2>&1 | tail -n 8
$K --ops mla_combine --name comb64 --grid heads=12 --grid batch=64 --grid partitions=4,16 --grid block_r=16,32,64 \
   --grid block_v=32,64 --deadline 40 2>&1 | tail -n 14
