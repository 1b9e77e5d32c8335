#!/usr/bin/env bash
# Where a batch-1 projection loses time against a plain read of its weight bytes (issue 13's ">= 16 MB at 85 %" and
# "smaller within 2 us of their floor" rows, docs/NOTES_trunk.md): the stream peer as a program a tile against the
# grid-sized read (experiments/stream_peer/compare.py, short form), then TP8 bf16 batch 1 projections of 8-26 MB on
# the default path and on the rows path (a program owns whole rows, no split-K, no shared memory) beside cuBLAS and
# both stream peers in the same run (bundle proj_rows61). Nothing carried. Device: bash experiments/queue61/b.sh
set -uo pipefail
. experiments/device_setup.sh q
mkdir -p "$OUT/sp"
ONLY=mla_in,kda_in,moe_in,moe_down,kda_q,mla_dkv,GiB GRIDS=3 timeout 170 python3 experiments/stream_peer/compare.py \
  "$OUT/sp" 2>&1 | tail -n 25
timeout 300 python3 -m k3lab.cli bench trunk --ops proj --backends triton --grid preset=tp8 --grid batch=1 \
  --grid wdtype=bf16 --grid proj=kda_q,mla_dkv,kda_o,moe_down,shared_w1 --grid residual=False \
  --grid path=null,rows --no-variants --skip torch_compile,reference --reps 30 --deadline 260 --name proj_rows61 \
  --out "$OUT/q" 2>&1 | grep -E "^proj|rror" | cut -c1-170
