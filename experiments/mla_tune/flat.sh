# The MLA split's flattened pieces (option flat) against the classic grid at batch 8 / 16 / 32, 8K / 32K, beside
# FlashInfer fa3 / fa2 (carry .gpu/base, fi, fijit); the flat GPU tests first (compiled, not interpreted).
#   bash experiments/mla_tune/flat.sh   ->  $OUT/flat/<gpu>/mla_flat.json
export PYTHONPATH=$PWD:$PYTHONPATH NCCL_NVLS_ENABLE=0
for a in base fi fijit; do eval "$(bash .gpu/$a/unpack.sh)"; done
pip install -q --no-deps --no-build-isolation -e . >/dev/null 2>&1
nvidia-smi --query-gpu=name --format=csv,noheader
timeout 150 python3 -m pytest -q -x tests/test_mla_triton.py -k "flat or small_histories or page_sizes or verify_T" 2>&1 \
  | tail -3
timeout 380 python3 -m k3lab.cli bench mla --ops mla_decode --backends triton --no-variants --skip torch_compile,reference \
  --reps 30 --grid heads=12 --grid batch=${BATCHES:-8,16,32} --grid context=8192,32768 --grid flat=null,false \
  --name ${NAME:-mla_flat} --out $OUT/flat --deadline 360 2>&1 | grep -E "^mla_decode" | cut -c1-125
