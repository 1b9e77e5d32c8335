#!/usr/bin/env bash
# The H200 evidence run, through the device tool (kind nvidia-h200). Two calls back to back, because
# the two archives do not travel together (a warm machine keeps what was unpacked for 30 s):
#   STEP=cute  carry [".gpu/cute"]  unpack CuTe DSL; check + time the CuTe KDA kernels
#   STEP=main  carry [".gpu/base"]  the KDA sweep bundle + report (every backend, torch, torch.compile,
#                                   fla) and the layer notebook at tp8, batch 1 and 64, context 8K
#   STEP=tests carry [".gpu/base"]  the GPU-marked tests (several minutes)
#   STEP=tune  carry [".gpu/base"]  the Triton KDA tile x warps x stages tuner (kernels/triton/tune_kda.py)
#   STEP=b64   carry [".gpu/cute"]  the B = 64 decode candidates (check_kda.py ${EXP:---exp-b64}; EXP=--exp-chunk
#                                   runs the verify chunk study first, --exp-lat the latency knobs, none
#                                   nothing), ncu of one call of
#                                   each NCU_SPECS entry ("" for none), the GPU tests of TESTS (files) if set
# Each step's outputs are packed into one archive under $OUT as soon as it ends, so a run cut short
# still returns them (the tool brings back at most 8 files). Knobs: HEADS, BATCHES, TS, DEADLINE,
# NAME (the sweep bundle's name, default kda_sweep), LAYER_BATCHES (empty: skip the layer notebook),
# CUTE_TILES and CUTE_ARGS (check_kda.py flags, e.g. "--verify-only --lean").
set -uo pipefail
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
OUT=${OUT:-/tmp/k3out}; mkdir -p "$OUT"
pack() { tar czf "$OUT/$1.tgz" -C "$OUT" "$1" && rm -rf "${OUT:?}/$1"; }
install() {
  pip install -q --no-deps --no-build-isolation -e . >/tmp/pip.log 2>&1 || {
    echo "pip install -e . failed (running from the checkout):"; tail -3 /tmp/pip.log; }
  export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
}
K="python3 -m k3lab.cli"
case "${STEP:-main}" in
cute)
  eval "$(bash .gpu/cute/unpack.sh)"; install
  mkdir -p "$OUT/cute"
  OUT="$OUT/cute" python3 kernels/cute/check_kda.py --tiles=${CUTE_TILES:-128,64,32,16} ${CUTE_ARGS:-} 2>&1 | tee "$OUT/cute/check.log" | tail -n 40
  pack cute ;;
main)
  eval "$(bash .gpu/base/unpack.sh)"; install
  $K env > "$OUT/env.json"
  $K bench kda --heads ${HEADS:-12,6} --batches ${BATCHES:-1,64,8,2,4,16,32} --T ${TS:-1,4,2,8} \
     --tiles 4,8,16,32,64,128 --reps 30 --deadline ${DEADLINE:-240} --name ${NAME:-kda_sweep} --out "$OUT/bench" 2>&1 \
     | tee "$OUT/bench.log" | tail -n 30
  pack bench
  for B in ${LAYER_BATCHES-1 64}; do
    $K run notebooks/01_decode_layer.ipynb -p preset tp8 -p batch $B -p context 8192 \
       -p backends reference,torch_compile,triton -p reps 10 --out "$OUT/layer_b$B" 2>&1 | tail -n 4
    pack layer_b$B
  done ;;
b64)
  # the B = 64 decode candidates (check_kda.py --exp-b64), then ncu on one call of each NCU_SPECS entry
  # (check_kda.py --ncu-launch=...; the default: the CuTe decode and torch's in-place scale of the state)
  eval "$(bash .gpu/cute/unpack.sh)"; install
  mkdir -p "$OUT/b64"
  if [ "${EXP:-}" != none ]; then  # EXP=none: only the ncu specs and the tests
    OUT="$OUT/b64" python3 kernels/cute/check_kda.py ${EXP:---exp-b64} 2>&1 | tee "$OUT/b64/exp.log" | tail -n 60
  fi
  for spec in ${NCU_SPECS-64,12,128 inplace,64,12}; do
    tag=$(echo "$spec" | tr ',' '_')
    ncu --clock-control none --cache-control none --profile-from-start off --launch-skip 4 --launch-count 1 \
        --set full --metrics dram__bytes_read.sum,dram__bytes_write.sum -f -o "$OUT/b64/ncu_$tag" \
        python3 kernels/cute/check_kda.py --ncu-launch="$spec" > "$OUT/b64/ncu_$tag.log" 2>&1
    ncu --import "$OUT/b64/ncu_$tag.ncu-rep" --page details > "$OUT/b64/ncu_$tag.txt" 2>&1
    grep -E "Duration|DRAM Throughput|dram__bytes|Memory Throughput|Registers Per|Achieved Occupancy|Theoretical Occupancy|L2 Hit|Warp Cycles Per Issued|Block Limit" "$OUT/b64/ncu_$tag.txt" | head -n 24
  done
  if [ -n "${TESTS:-}" ]; then  # e.g. TESTS=tests/test_kda_cute.py: those files' GPU tests
    python3 -m pytest -q -m gpu $TESTS --durations=15 2>&1 | tee "$OUT/b64/pytest_gpu.log" | tail -n 8
  fi
  pack b64 ;;
tests)
  eval "$(bash .gpu/base/unpack.sh)"; install
  python3 -m pytest -q -m gpu -x 2>&1 | tee "$OUT/pytest_gpu.log" | tail -n 30 ;;
tune)
  eval "$(bash .gpu/base/unpack.sh)"; install
  python3 kernels/triton/tune_kda.py ${TUNE_ARGS:-} 2>&1 | tee "$OUT/tune.log" | tail -n 40 ;;
*) echo "STEP must be cute, main, b64, tests or tune" >&2; exit 2 ;;
esac
ls -la "$OUT"
