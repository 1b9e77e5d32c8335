#!/usr/bin/env bash
# The fifty-seventh session's second call (.gpu/base, fi, fijit carried) on the machine a.sh warmed (CuTe DSL still
# unpacked in /root/k3site): issue 12's decode rows under this tree's rules, Triton / CuTe / FlashInfer fa3 at batch
# 1..64 x 8K / 32K (queue56/b.sh's command: bundle mla_rule_sweep, the name issue 12's targets read).
# Device: bash experiments/queue57/b.sh    (everything under $OUT/q)
set -uo pipefail
. experiments/device_setup.sh q
for a in base fi fijit; do eval "$(bash .gpu/$a/unpack.sh)"; done
[ -d /root/k3site/nvidia_cutlass_dsl ] && export PYTHONPATH=/root/k3site/nvidia_cutlass_dsl/dsl_packages:$PYTHONPATH \
  || echo "CuTe DSL not unpacked here (run a.sh first): the cute rows will be refused"
timeout $(( ${D:-330} + 30 )) python3 -m k3lab.cli bench mla --ops mla_decode --backends triton,cute \
  --skip flashinfer_fa2,reference,torch_compile --reps 25 --grid batch=1,8,16,32,64 --grid context=8192,32768 \
  --out "$OUT/q" --name mla_rule_sweep --deadline ${D:-330} 2>&1 | grep -E "^mla_decode|rror" | cut -c1-120
