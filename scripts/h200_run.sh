#!/usr/bin/env bash
# The H200 evidence run (device tool, kind nvidia-h200, carry .gpu/base): the KDA sweep (issue #3)
# and the layer notebook at tp8, batch 1 and 64, context 8K (issue #2). Each step's outputs are
# packed into one archive under $OUT as soon as it ends, so a run cut short still returns them.
set -uo pipefail
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
eval "$(bash .gpu/base/unpack.sh)"
pip install -q --no-deps --no-build-isolation -e . >/tmp/pip.log 2>&1 || { tail -3 /tmp/pip.log; export PYTHONPATH=$PWD:$PYTHONPATH; }
OUT=${OUT:-/tmp/k3out}; mkdir -p "$OUT"
K="python3 -m k3lab.cli"
pack() { tar czf "$OUT/$1.tgz" -C "$OUT" "$1" && rm -rf "${OUT:?}/$1"; }
$K env > "$OUT/env.json"
$K bench kda --heads ${HEADS:-12,6} --batches ${BATCHES:-1,64,8,2,4,16,32} --T ${TS:-1,4,2,8} \
   --tiles 4,8,16,32,64,128 --reps 30 --deadline ${DEADLINE:-170} --out "$OUT/bench" 2>&1 | tee "$OUT/bench.log" | tail -n 25
pack bench
for B in ${LAYER_BATCHES-1 64}; do
  $K run notebooks/01_decode_layer.ipynb -p preset tp8 -p batch $B -p context 8192 \
     -p backends reference,torch_compile -p reps 10 --out "$OUT/layer_b$B" 2>&1 | tail -n 4
  pack layer_b$B
done
ls -la "$OUT"
