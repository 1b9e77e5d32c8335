#!/usr/bin/env bash
# fp8 projections at batch 1 / 8 on the Triton dot path with more programs than the default's ~1.7 an SM: ncu
# (ncu_small.sh, profiles/h100-80gb-hbm3/ncu_fp8_small.txt.gz, git
# history at 5196fe5) had moe_down's 224 programs at 10 % occupancy issuing
# every 4.7 cycles a warp, instruction-latency bound on few warps. K split 2..28 ways and 16-row W tiles, TP8 moe_down
# / kda_q / kda_o / mla_dkv, the default in each bundle; no archive needed.
# Device: bash experiments/proj_b64/fp8_split_small.sh   ($OUT/fp8_split_small/<gpu>/*.json, a short table last)
set -uo pipefail
. experiments/device_setup.sh fp8_split_small
K="python3 -m k3lab.cli bench trunk --ops proj --backends triton --no-variants --no-peers --reps 20 --grid preset=tp8
   --grid batch=1,8 --grid wdtype=fp8 --grid proj=moe_down,kda_q,kda_o,mla_dkv --out $OUT/fp8_split_small"
timeout 170 $K --grid split_k=null,2,4,8,14,28 --name fp8_split_small --deadline 150 2>&1 | tail -n 1
timeout 60 $K --grid block_n=16 --grid split_k=null,4 --name fp8_bn16_small --deadline 45 2>&1 | tail -n 1
python3 experiments/proj_b64/table.py "$OUT/fp8_split_small" | cut -c1-80
