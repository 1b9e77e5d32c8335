#!/usr/bin/env bash
# (The follow-up bench lines of the forty-fourth session, which set the rule of 8717b5e, are in
# profiles/h100-80gb-hbm3/README.md: beta_rule(_old) (git history at 4fcff70), beta_small, beta_bk (retired for room, git history at 4275497), small_reduce (git history at 1c9f81d).)
# Projections that trail cuBLAS at batch 1..64 (issue 13's "ours / cuBLAS < 1"; the forty-fourth session's H100 run,
# profiles/h100-80gb-hbm3/proj_b32_b64.json.gz, retired for room, git history at 1248da0): the KDA beta (12 / 6 outputs over K 7168: the x read dominates) and
# the KDA output projection at batch 64. One device call, nothing carried but ab_old/ (the code before the few-outputs
# rule and the summing kernel's tiles: `git archive 9b887b7 k3lab kernels data pyproject.toml | tar -x -C ab_old`,
# kernels/ renamed k3lab_kernels/). Bundles under $OUT/proj_skinny; the short table last.
set -uo pipefail
export PYTHONUNBUFFERED=1
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
O="$OUT/proj_skinny"
mkdir -p "$O"
nvidia-smi --query-gpu=name --format=csv,noheader
B="python3 -m k3lab.cli bench trunk --ops proj --backends triton --no-variants --skip torch_compile,reference
   --reps ${REPS:-20} --out $O --grid preset=tp8 --grid wdtype=bf16,fp8"
OLD() { [ -d ab_old/k3lab ] && (cd ab_old && PYTHONPATH=$PWD:$PYTHONPATH "$@"); }
# 1. the beta under this code's rule beside cuBLAS, then the rule before (ab_old/) on the same grid (forty-fourth
# session: the candidate of 29ffb8b, 64-column K ranges, against 9b887b7)
G="--grid proj=kda_b --grid batch=1,8,32,64"
timeout 70 $B --name beta_rule --deadline 50 $G 2>&1 | tail -n 1
OLD timeout 60 $B --name beta_rule_old --deadline 40 --no-peers $G 2>&1 | tail -n 1
# 2. the rule's parts alone: 128-column K ranges; the last program summing (batch 32 / 64); batch 1: 2048 / 4096
# columns a chunk, 8 warps
timeout 50 $B --name beta_parts --deadline 30 --no-peers --grid proj=kda_b --grid batch=8,32,64 --grid wdtype=bf16 \
  --grid block_k=null,128 --grid reduce=null,last 2>&1 | tail -n 1
if [ "${FULL:-1}" = 1 ]; then  # FULL=0: the rule and the summing tiles only (about 4 minutes)
timeout 40 $B --name beta_b1 --deadline 25 --no-peers --grid proj=kda_b --grid batch=1 --grid wdtype=bf16 \
  --grid path=rows --grid block_k=2048,4096,8192 --grid num_warps=null,8 2>&1 | tail -n 1
# 3. the KDA output projection (7168 outputs over K 1536) at batch 64: 128-row W tiles (x re-read from L2 half as
# often), a K split of 2
timeout 55 $B --name kda_o_tiles --deadline 40 --no-peers --grid proj=kda_o --grid batch=64 \
  --grid block_n=null,128 --grid split_k=null,2 2>&1 | tail -n 1
fi
# 4. the summing kernel's tiles (this code) against the fixed [32, 16] (ab_old/): the shared w1 (TP16: 384 outputs, 48
# summing programs before) at batch 64
S="--grid proj=shared_w1 --grid preset=tp8,tp16 --grid batch=64 --grid wdtype=bf16"
timeout 35 $B --name sum_tiles_new --deadline 20 --no-peers $S 2>&1 | tail -n 1
OLD timeout 35 $B --name sum_tiles_old --deadline 20 --no-peers $S 2>&1 | tail -n 1
python3 experiments/proj_b64/table.py "$O"
