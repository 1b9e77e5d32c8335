#!/usr/bin/env bash
# Issue 15 on the H200: notebooks/06_decode_step.ipynb headless at tp8, context 8192, MXFP4 experts (the full
# 896-expert pools), batch 1 and batch 64. Through the device tool (kind nvidia-h200) with carry [".gpu/base"]
# (plotly, papermill, ipykernel, nsight-python; no CuTe: the KDA auto rule falls back to Triton):
#     bash scripts/gpu_step.sh
# batch 1: every section (per-component / per-layer / whole-step timing, launches and the trace, each switch
#          toggled alone, the reference and torch.compile steps, numerics of the tiny stack on the GPU, nsight-python
#          metrics of layer 1).
# batch 64: the step, its layers and components, the two comparison steps and the estimate; no toggles, no
#          profiled step (the reference MoE at batch 64 launches ~10^5 kernels a step), no nsight, no numerics.
# Each run writes $OUT/step/b<B>/ (report, executed notebook, trace, bundle), packed into $OUT/step/b<B>.tgz;
# its bundle is also copied to $OUT/step/ as plain JSON; the bundle is checkpointed after each phase, so a run
# cut short by RUN_S keeps what it measured. A table of the issue's target figures is printed last.
# Knobs: BATCHES ("1 64"; run "1" and "64" as two calls if one call's limit is short; empty: no step run),
# RUN_S (per run, 420),
# REPS (5), EXPERT_DTYPE (mxfp4 | fp8), COMPARE (reference,torch_compile), NSIGHT_LAYER (1; -1 = none),
# PREFLIGHT=1 (first the GPU test of the step: tp8, 32 experts, 1K context), DEPTH=1 (then notebooks/07_draft_depth at
# tp8, context 8192, batch DEPTH_BATCHES "1", depths DEPTH_DEPTHS "0,1,3": $OUT/step/depth.tgz and its bundle).
set -uo pipefail
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0
OUT=${OUT:-/tmp/k3out}
mkdir -p "$OUT/step"
eval "$(bash .gpu/base/unpack.sh)"
pip install -q --no-deps --no-build-isolation -e . >/tmp/pip.log 2>&1 || {
  echo "pip install -e . failed (running from the checkout):"; tail -3 /tmp/pip.log; }
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
nvidia-smi --query-gpu=name,memory.used,memory.total --format=csv,noheader
python3 -c "import nsight" 2>/dev/null && echo "nsight-python: yes" || echo "nsight-python: no"
command -v ncu >/dev/null || ls /opt/nvidia/nsight-compute/*/ncu 2>/dev/null | tail -1 || echo "ncu: not found"
if [ "${PREFLIGHT:-0}" = 1 ]; then
  timeout 200 python3 -m pytest -q -m gpu tests/test_step.py -x 2>&1 | tail -n 15
fi
for B in ${BATCHES-1 64}; do
  if [ "$B" = 1 ]; then
    EXTRA="-p toggles true -p nsight_layer ${NSIGHT_LAYER:-1} -p numerics_steps 4"
  else
    EXTRA="-p toggles false -p profile false -p nsight_layer -1 -p numerics_steps 0"
  fi
  t0=$(date +%s)
  # shellcheck disable=SC2086
  timeout -k 15 "${RUN_S:-420}" python3 -m k3lab.cli run notebooks/06_decode_step.ipynb -p preset tp8 -p batch "$B" \
    -p context 8192 -p expert_dtype "${EXPERT_DTYPE:-mxfp4}" -p reps "${REPS:-5}" -p warmup 1 \
    -p compare "${COMPARE:-reference,torch_compile}" $EXTRA --out "$OUT/step/b$B" 2>&1 | tail -n 45
  echo "batch $B: exit ${PIPESTATUS[0]} after $(( $(date +%s) - t0 )) s"
  cp "$OUT"/step/b"$B"/*/decode_step-*.json "$OUT/step/" 2>/dev/null || echo "batch $B: no bundle written"
  tar czf "$OUT/step/b$B.tgz" -C "$OUT/step" "b$B" && rm -rf "${OUT:?}/step/b$B"
done
if [ "${DEPTH:-0}" = 1 ]; then
  t0=$(date +%s)
  timeout -k 15 "${DEPTH_S:-200}" python3 -m k3lab.cli run notebooks/07_draft_depth.ipynb -p preset tp8 -p context 8192 \
    -p expert_dtype "${EXPERT_DTYPE:-mxfp4}" -p batches "${DEPTH_BATCHES:-1}" -p depths "${DEPTH_DEPTHS:-0,1,3}" \
    -p components false -p reps 3 --out "$OUT/step/depth" 2>&1 | tail -n 25
  echo "draft depth: exit ${PIPESTATUS[0]} after $(( $(date +%s) - t0 )) s"
  cp "$OUT"/step/depth/*/draft_depth-*.json "$OUT/step/" 2>/dev/null || echo "draft depth: no bundle written"
  tar czf "$OUT/step/depth.tgz" -C "$OUT/step" depth && rm -rf "${OUT:?}/step/depth"
fi
python3 - "$OUT/step" <<'EOF'
import glob, json, sys
from k3lab.harness.bundle import load
from k3lab.step import targets
print(f"{'batch':>5} {'fused us':>10} {'kind':>9} {'ref us':>10} {'compile us':>10} {'x compile':>9} "
      f"{'floor us':>9} {'x floor':>7} {'launch/L':>8} {'sum/whole':>9} {'est tok/s':>9} {'/GPU':>7} {'floor tok/s':>11} "
      f"{'peak GB':>7}")
for p in sorted(glob.glob(sys.argv[1] + "/decode_step-*.json")):
    b = load(p)
    rows = {(r.name, r.backend): r for r in b.rows}
    f, ref, tc = rows.get(("step", "fused")), rows.get(("step", "reference")), rows.get(("step", "torch_compile"))
    e = rows.get(("estimate:93_layers", "fused"))
    if f is None:
        print(p, "has no fused step row"); continue
    x = f.extra
    mem = x.get("memory", {})
    est = e.extra if e else {}
    print(f"{b.config['view']['batch']:>5} {f.median_us:>10.1f} {f.kind:>9} {getattr(ref, 'median_us', float('nan')):>10.1f} "
          f"{getattr(tc, 'median_us', float('nan')):>10.1f} {(tc.median_us / f.median_us) if tc else float('nan'):>9.2f} "
          f"{f.floor_us:>9.1f} {f.distance:>7.2f} {x.get('launches_per_layer') or 0:>8.1f} "
          f"{x.get('layer_sum_ratio', float('nan')):>9.2f} {est.get('tokens_per_s') or 0:>9.1f} "
          f"{est.get('tokens_per_s_per_gpu') or 0:>7.1f} {est.get('floor_tokens_per_s') or 0:>11.1f} "
          f"{mem.get('peak_gb', 0):>7.1f}")
    print("   capture:", str(x.get("capture"))[:200])
    print("   backends:", b.switches["backend"], "| targets:", json.dumps(targets(b)))
    gaps = sorted(((r.name, r.median_us, r.floor_us) for r in b.rows if r.backend == "fused" and r.name.count(".") == 2),
                  key=lambda t: -(t[1] - (t[2] or 0)))[:5]
    print("   largest gaps to floor:", ", ".join(f"{n} {m:.0f}/{fl:.0f} us" for n, m, fl in gaps))
    nums = [r for r in b.rows if r.name.startswith("numerics:")]
    if nums:
        print("   numerics (tiny stack on the GPU, rel err after the last step):",
              ", ".join(f"{r.name[9:]} " + (f"{r.error['rel_norm']:.3g}" if r.error.get("rel_norm") is not None
                                            else "non-finite") for r in nums))
    print("   notes:", [n for n in b.notes if "capture" in n or "nsight" in n or "numerics" in n][:3])
EOF
du -sh "$OUT/step"; ls -la "$OUT/step"
