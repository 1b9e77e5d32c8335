#!/usr/bin/env bash
# Projections that trail cuBLAS at batch 1..64 (issue 13's "ours / cuBLAS < 1" rows on the forty-fourth session's H100
# run, profiles/h100-80gb-hbm3/proj_b32_b64.json.gz): the KDA beta (12 / 6 outputs over K 7168: the x read dominates)
# and the KDA output projection at batch 32 / 64. One device call, nothing carried but ab_old/ (the code before the
# summing kernel's tiles followed N: `git archive <rev> k3lab kernels data pyproject.toml | tar -x -C ab_old`,
# kernels/ renamed k3lab_kernels/). Bundles under $OUT/proj_skinny; the short table last.
set -uo pipefail
export PYTHONUNBUFFERED=1
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
O="$OUT/proj_skinny"
mkdir -p "$O"
nvidia-smi --query-gpu=name --format=csv,noheader
B="python3 -m k3lab.cli bench trunk --ops proj --backends triton --no-variants --skip torch_compile,reference
   --reps ${REPS:-20} --out $O --grid preset=tp8 --grid wdtype=bf16,fp8"
# 1. the beta at batch 1 / 8 / 32 / 64 (TP8): the default, 16-row W tiles, 64-column K chunks (more, shorter K ranges), with cuBLAS
timeout 130 $B --name beta_tiles --deadline 100 --grid proj=kda_b --grid batch=1,8,32,64 \
  --grid block_n=null,16 --grid block_k=null,64 2>&1 | tail -n 1
# 2. batch 1: the rows path with the whole K a chunk (one round trip)
timeout 45 $B --name beta_b1 --deadline 30 --no-peers --grid proj=kda_b --grid batch=1 --grid path=rows \
  --grid block_k=4096,8192 --grid num_warps=null,8 --grid wdtype=bf16 2>&1 | tail -n 1
# 3. the KDA output projection (7168 outputs over K 1536) at batch 64: wider W tiles (x re-read from L2
# once a tile), a K split of 2
timeout 55 $B --name kda_o_tiles --deadline 40 --no-peers --grid proj=kda_o --grid batch=64 \
  --grid block_n=null,128 --grid split_k=null,2 2>&1 | tail -n 1
# 4. the summing kernel's tiles (this code) against the fixed [32, 16] (ab_old/) where they differ: the beta and the
# shared w1 (TP16: 384 outputs) at batch 64
S="--grid proj=kda_b,shared_w1 --grid preset=tp8,tp16 --grid batch=64 --grid wdtype=bf16"
timeout 40 $B --name sum_tiles_new --deadline 25 --no-peers $S 2>&1 | tail -n 1
if [ -d ab_old/k3lab ]; then
  (cd ab_old && PYTHONPATH=$PWD:$PYTHONPATH timeout 40 $B --name sum_tiles_old --deadline 25 --no-peers $S 2>&1 | tail -n 1)
fi
python3 experiments/proj_b64/table.py "$O"
