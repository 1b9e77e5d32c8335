#!/usr/bin/env bash
# The batch-32 / 64 projections (issue 13's "ours / cuBLAS < 1" rows), one device call, no .gpu/ archive needed:
# the split-K tile's partials summed by its last program in pieces of RCH batch columns (this code) against the whole
# tile at once (the code of the commit before, carried as ab_old/: `git archive <rev> k3lab kernels data
# pyproject.toml | tar -x -C ab_old`, kernels/ renamed k3lab_kernels/), the same grid in the same call; then ncu of
# shared_w1 at batch 64 (ours, ours on tma at 8 warps, cuBLAS).
# Paths and warps: the default and tma, 4 and 8 warps (the old code: default and tma). Bundles proj_rchunk{,_old} under $OUT/proj_b64.
set -uo pipefail
export PYTHONUNBUFFERED=1
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
mkdir -p "$OUT/proj_b64"
nvidia-smi --query-gpu=name --format=csv,noheader
K="python3 -m k3lab.cli bench trunk --ops proj --backends triton --no-variants --skip torch_compile,reference
   --reps ${REPS:-20} --grid preset=tp8 --grid batch=32,64 --grid wdtype=bf16
   --grid proj=shared_w1,kda_q,kda_o,mla_dkv,moe_router"
case "${PART:-1}" in
1)
  timeout 230 $K --name proj_rchunk --out "$OUT/proj_b64" --deadline 200 --grid path=null,tma --grid num_warps=null,8 \
    2>&1 | tail -n 3
  if [ -d ab_old/k3lab ]; then
    (cd ab_old && PYTHONPATH=$PWD:$PYTHONPATH timeout 130 $K --name proj_rchunk_old --out "$OUT/proj_b64" --no-peers \
       --deadline 100 --grid path=null,tma 2>&1 | tail -n 3)
  fi ;;
2)
  # the pipelines' depth: tma at 6 stages (every chunk of a 6-chunk K range in flight) and 64-column chunks; dot at
  # 4 / 6 stages; dot with BN 64
  timeout 200 $K --name proj_stages_tma --out "$OUT/proj_b64" --deadline 170 --grid path=tma --grid num_stages=null,6 \
    --grid block_k=null,64 2>&1 | tail -n 3
  timeout 130 $K --name proj_stages_dot --out "$OUT/proj_b64" --deadline 100 --no-peers --grid num_stages=null,4,6 \
    2>&1 | tail -n 3
  # dot with 64-row W tiles (x read from L2 half as often) at the default and two fixed K splits
  timeout 130 $K --name proj_bn64_dot --out "$OUT/proj_b64" --deadline 100 --no-peers --grid block_n=64 \
    --grid split_k=null,8,11 2>&1 | tail -n 3 ;;
3)
  # the forty-third session's stage rule (tma 6 stages to batch 32, dot 4 at batch 17..32) against the stages before
  # (tma 4, dot 3), batch 32, two rounds in turn
  for r in 1 2; do
    timeout 100 $K --name proj_stages_b32_r$r --out "$OUT/proj_b64" --deadline 80 --grid batch=32 \
      --grid num_stages=null,3,4 2>&1 | tail -n 1
  done ;;
4)
  # the partials summed by a second kernel launched with PDL (experiments/proj_b64/split2.py, git history at 53779a6), against the production
  # projection and cuBLAS on the same inputs
  timeout 280 python3 experiments/proj_b64/split2.py "$OUT/proj_b64/split2.json" 2>&1 | tail -n 100 ;;
5)
  # the partials summed by a second kernel under PDL in production (reduce "kernel" from a batch tile of 64, dot tiles
  # of 64 W rows, one program an SM) at batch 48 / 64 and the K splits around the rule, against the code before
  # (ab_old/: the last program behind a counter) and cuBLAS
  timeout 150 $K --name proj_reduce --out "$OUT/proj_b64" --deadline 120 --grid batch=48,64 --grid split_k=null,11,16,22 \
    2>&1 | tail -n 1
  if [ -d ab_old/k3lab ]; then
    (cd ab_old && PYTHONPATH=$PWD:$PYTHONPATH timeout 80 $K --name proj_reduce_old --out "$OUT/proj_b64" --no-peers \
       --deadline 60 --grid batch=48,64 2>&1 | tail -n 1)
  fi ;;
6)
  # the next H200 call (docs/NOTES_step.md at a0adff0, forty-third section): issue 13's batch-32 / 64 rows of the projections that
  # trailed cuBLAS, TP8 and TP16, bf16 and fp8, the current rules (stage rule, second-kernel reduction) beside cuBLAS;
  # the bundle joins issue 13's "against cuBLAS" entry in data/targets.json
  timeout 280 $K --name proj_b32_b64 --out "$OUT/proj_b64" --deadline 250 --grid preset=tp8,tp16 --grid wdtype=bf16,fp8 \
    --grid proj=shared_w1,kda_q,kda_o,mla_dkv,moe_router,kda_b 2>&1 | tail -n 1 ;;
esac
[ "${NCU:-0}" = 1 ] && OUT="$OUT/proj_b64" timeout 200 bash experiments/proj_b64/ncu.sh shared_w1
# the short table: every row of the bundles written, us
python3 experiments/proj_b64/table.py "$OUT/proj_b64"
