#!/usr/bin/env bash
# The `moe_tile_n` switch in the decode step: notebooks/06_decode_step.ipynb headless at tp8, 8K, batch BATCH (8),
# EXPERT_DTYPE (fp8) experts on the triton backend (the backend whose experts take a tile; every other component
# auto), toggling moe_tile_n alone (auto -> 32); no comparison steps, no profiled step, no nsight, no numerics.
# Device, carry .gpu/base: bash experiments/step_folds/tile_toggle.sh  (bundle and report under $OUT/tile)
set -uo pipefail
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0
eval "$(bash .gpu/base/unpack.sh)"
pip install -q --no-deps --no-build-isolation -e . >/dev/null 2>&1
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
nvidia-smi --query-gpu=name --format=csv,noheader
timeout -k 15 "${RUN_S:-500}" python3 -m k3lab.cli run notebooks/06_decode_step.ipynb -p preset tp8 \
  -p batch "${BATCH:-8}" -p context 8192 -p expert_dtype "${EXPERT_DTYPE:-fp8}" -p backend_moe triton \
  -p toggles moe_tile_n -p compare "" -p components false -p nsight_layer -1 -p numerics_steps 0 -p profile false \
  -p panel false -p reps "${REPS:-5}" --out "$OUT/tile" 2>&1 | tail -n 12
python3 - "$OUT/tile" <<'PY'
import glob, sys
from k3lab.harness.bundle import load
for p in glob.glob(sys.argv[1] + "/*/decode_step-*.json"):
    b = load(p)
    for r in b.rows:
        if r.name == "step" or r.name.startswith("toggle:"):
            print(f"{r.name:40s} {r.backend:8s} {r.median_us:10.1f} us  p10 {r.p10_us:10.1f}  p90 {r.p90_us:10.1f}")
    print([n for n in b.notes if "toggle" in n])
PY
