#!/usr/bin/env bash
# The H200 evidence run, through the device tool (kind nvidia-h200). The archives do not all travel
# together (64 MiB a call), so the steps run back to back; a warm machine keeps what was unpacked
# (/root/k3site) and the ignored paths already sent for 30 s:
#   STEP=cute   carry [".gpu/cute"]            unpack CuTe DSL; GPU tests (TESTS, default the KDA and harness
#                                              ones); `k3lab check kda` on GPU over odd shapes (CHECK_GRID)
#   STEP=bench  carry [".gpu/base", ".gpu/fi"] (right after STEP=cute: CuTe stays unpacked) the sweep
#                                              `k3lab bench $COMPONENT $GRID` (bundle + report), then
#                                              `k3lab defaults` from it into $OUT/bench/defaults.json
#   STEP=fi     carry [".gpu/cute", ".gpu/fi"] the probes, then `k3lab bench kda --ops kda_decode` beside
#                                              FlashInfer's fused decode (no fla: .gpu/base does not fit beside),
#                                              then $EXTRA (a command line) if set
#   STEP=layer  carry [".gpu/base"]            the layer notebook at tp8, batch LAYER_BATCHES, 8K context
#   STEP=layerbench carry [".gpu/cute"]        its measurement without papermill (the bundle only)
#   STEP=pending carry [".gpu/cute"]           the kernels built without a device: PART=1 their GPU tests and the
#                                              dense experts' bench, PART=2 the projections' path "mma", PART=3
#                                              their settings, PART=4 the grouped experts' shared groups, PART=5
#                                              the projections' tiles at batch 32 / 64, PART=6 the AttnRes (one call
#                                              each)
#   STEP=ab     carry [".gpu/cute"] (PART=3: and ".gpu/fi")  the thirty-seventh session's A/B queue (PART=1..3,
#                                              docs/NOTES_step.md)
#   STEP=mla    carry [".gpu/base", ".gpu/fi", ".gpu/fijit"]  the MLA evidence: decode beside FlashInfer fa3/fa2
#                                              (batch 1 to 128K, batch 64 to 32K), verify T=4 by row tile, the combine
#                                              (the partition sweeps behind `auto`: experiments/mla_tune)
#   STEP=rows   carry [".gpu/cute", ".gpu/fi"]  PART=1..3, one call each (PART=1 also "ab_old/"): the current code's
#                                              rows of issue 14's bf16 / fp8 targets (batch 1, 16, 32, 64:
#                                              moe_b1_b64), the MXFP4 experts on the new decode
#                                              (moe_mxfp4_brev), the dense experts' grouped path at batch 1..4
#                                              against the one-token kernels (moe_dense_grouped_b1), and issue 16's
#                                              KDA decode beside FlashInfer (kda_decode_fi) (forty-first session)
#   STEP=q46    nothing carried               PART=1..2: the forty-sixth session's queue (fp8 short-K projections,
#                                              the MLA split's lazy rescale)
#   STEP=q47    nothing carried               PART=1: fp8 projections (the short-input rule; batch 32 / 64 tiles);
#                                              PART=2 (an H200): issue 13's fp8 rows under the new tiles; PART=3
#                                              (.gpu/base, fi, fijit): PART=2 again, the MLA partitions beside fa3; PART=4 fp8 warps
# Each step's outputs are packed into one archive under $OUT as soon as it ends, so a run cut short still
# returns them. Knobs: COMPONENT (kda), GRID (bench --grid flags), NAME (bundle name), DEADLINE (s), REPS.
set -uo pipefail
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
OUT=${OUT:-/tmp/k3out}; mkdir -p "$OUT"
pack() { tar czf "$OUT/$1.tgz" -C "$OUT" "$1" && rm -rf "${OUT:?}/$1"; }
install() {
  pip install -q --no-deps --no-build-isolation -e . >/tmp/pip.log 2>&1 || {
    echo "pip install -e . failed (running from the checkout):"; tail -3 /tmp/pip.log; }
  export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
}
unpack() { for a in "$@"; do [ -f ".gpu/$a/unpack.sh" ] && eval "$(bash .gpu/$a/unpack.sh)"; done; }
K="python3 -m k3lab.cli"
case "${STEP:-bench}" in
cute)
  unpack cute; install
  mkdir -p "$OUT/cute"
  python3 -m pytest -q -m gpu ${TESTS:-tests/test_kda_cute.py tests/test_kda_cute_api.py tests/test_kda_cute_prefill.py tests/test_kda_cute_prefill_api.py tests/test_harness.py tests/test_kda_component.py} \
    2>&1 | tee "$OUT/cute/pytest_gpu.log" | tail -n 8
  $K check kda --backends cute,triton ${CHECK_GRID:---grid heads=1,6,12 --grid batch=1,3,64 --grid T=1,2,5,8 --grid ragged=false,true} \
    2>&1 | tee "$OUT/cute/check.log" | tail -n 4
  pack cute ;;
bench)
  unpack cute base fi; install
  $K env > "$OUT/env.json"
  $K bench ${COMPONENT:-kda} ${GRID:---grid heads=12 --grid batch=1,64,8,2,4,16,32 --grid T=1,4,2,8} \
     --reps ${REPS:-30} --deadline ${DEADLINE:-420} --name ${NAME:-kda_sweep} --out "$OUT/bench" 2>&1 \
     | tee "$OUT/bench.log" | tail -n 40
  $K defaults ${COMPONENT:-kda} "$OUT"/bench/*/"${NAME:-kda_sweep}".json --write "$OUT/bench/defaults.json" 2>&1 | tail -n 2
  pack bench ;;
fi)
  unpack cute fi; install
  mkdir -p "$OUT/fi"
  $K probes | tee "$OUT/fi/probes.json"
  $K bench kda --ops kda_decode --backends cute,triton ${GRID:---grid heads=12 --grid batch=1,2,4,8,16,32,64 --grid tile_v=16,128} \
     --reps ${REPS:-30} --deadline ${DEADLINE:-200} --name ${NAME:-kda_decode_fi} --out "$OUT/fi" 2>&1 | tee "$OUT/fi/bench.log" | tail -n 30
  if [ -n "${EXTRA:-}" ]; then bash -c "$EXTRA" 2>&1 | tee "$OUT/fi/extra.log" | tail -n 30; fi
  pack fi ;;
layer)
  unpack base; install
  for B in ${LAYER_BATCHES-1 64}; do
    # LAYER_EXPERT_DTYPE=mxfp4: the MoE rows on the whole 896-expert pool of one layer (issue 14)
    $K run notebooks/01_decode_layer.ipynb -p preset tp8 -p batch $B -p context 8192 \
       -p expert_dtype ${LAYER_EXPERT_DTYPE:-bf16} \
       -p backends ${LAYER_BACKENDS:-reference,torch_compile,triton} -p reps 10 --out "$OUT/layer_b$B" 2>&1 | tail -n 4
    pack layer_b$B
  done ;;
layerbench)
  # the layer notebook's measurement without papermill (bench_layers, then the bundle; `k3lab report BUNDLE` makes
  # its page here): fits beside `.gpu/cute` in one call, where STEP=layer needs `.gpu/base`
  unpack cute; install
  mkdir -p "$OUT/layerbench"
  for B in ${LAYER_BATCHES-1}; do
    timeout ${LAYER_TIMEOUT:-240} python3 - "$OUT/layerbench" "$B" "${LAYER_EXPERT_DTYPE:-bf16}" \
      "${LAYER_BACKENDS:-reference,torch_compile,triton}" <<'PY' 2>&1 | tail -n 60
import sys
from k3lab.config import preset
from k3lab.harness.layerbench import bench_layers, bundle_name
out, batch, dtype, backends = sys.argv[1], int(sys.argv[2]), sys.argv[3], sys.argv[4]
view = preset("tp8", batch=batch, context=8192, expert_dtype=dtype)
b = bench_layers(view, backends=backends, reps=10, name=bundle_name("tp8", view))
b.notes.append("run by scripts/h200_run.sh STEP=layerbench (notebooks/01_decode_layer.ipynb's measurement, headless)")
print("bundle:", b.save(out))
PY
  done
  pack layerbench ;;
mla)
  unpack base fi fijit; install
  mkdir -p "$OUT/mla"
  B="$K bench mla --reps ${REPS:-30} --out $OUT/mla"
  $B --backends triton --ops mla_decode --name mla_decode --grid heads=12 --grid batch=1 --grid context=1024,8192,32768,131072 \
     --deadline 100 2>&1 | tee "$OUT/mla/decode_b1.log" | tail -n 4
  $B --backends triton --ops mla_decode --name mla_decode_b64 --grid heads=12 --grid batch=64 --grid context=1024,8192,32768 \
     --deadline 100 2>&1 | tee "$OUT/mla/decode_b64.log" | tail -n 4
  $B --backends triton --no-peers --ops mla_decode --name mla_verify --grid heads=12 --grid batch=1 --grid context=32768 \
     --grid T=1,4 --grid block_m=16,32,64 --deadline 40 2>&1 | tail -n 8
  $B --backends triton --no-peers --ops mla_combine --name mla_combine --grid heads=12 --grid batch=1,64 \
     --grid partitions=1,4,33,132,264 --deadline 40 2>&1 | tail -n 3
  pack mla ;;
pending)
  # the kernels built without a device (docs/NOTES_moe.md, NOTES_trunk.md, thirty-third and thirty-fourth sessions),
  # in parts that each fit one call: PART=1 their GPU tests and the dense experts' bench, PART=2 the projections'
  # path "mma" benches, PART=3 the settings (experiments/*/variants.py), PART=7 the projections chained under pdl,
  # PART=8 the bf16 grouped experts' tiles, PART=9 the projections' tiles and warps at batch 32 / 64; bundles under
  # $OUT/pending/<gpu>/
  unpack cute; install
  mkdir -p "$OUT/pending"
  B="$K bench --out $OUT/pending --no-variants --skip torch_compile,reference --reps ${REPS:-20}"
  case "${PART:-1}" in
  1)
    timeout 240 python3 -m pytest -q -m gpu tests/test_moe_cute.py tests/test_proj_cute.py \
      -k "dense or w2_tail or overlap or mma or l2_prefetch" 2>&1 | tee "$OUT/pending/pytest_gpu.log" | tail -n 6
    timeout 300 $B moe --ops moe_experts --backends triton,cute --name moe_dense --deadline 260 \
      --grid dtype=bf16,fp8 --grid batch=1,8,16,64 --grid tp=8 --grid routing=uniform,same16 --grid latent=3584 \
      --grid inter=3072 --grid n_experts=896 --grid top_k=16 2>&1 | tail -n 30 ;;
  2)
    timeout 330 $B trunk --ops proj --backends triton,cute --name proj_mma --deadline 300 --grid preset=tp8 \
      --grid batch=1,2,4,8,16 --grid wdtype=bf16,fp8 --grid proj=kda_q,kda_o,moe_down,mla_dkv --grid path=null,mma \
      2>&1 | tail -n 30
    timeout 200 $B trunk --ops proj_group --backends triton,cute --name proj_group_mma --deadline 180 \
      --grid preset=tp8 --grid batch=1,4,8 --grid group=kda_in,mla_in,moe_in --grid path=null,mma 2>&1 | tail -n 20 ;;
  3)
    PROJS=kda_q,moe_down WDTYPES=bf16,fp8 BATCHES=8 TILES=null,16,64 timeout 280 \
      python3 experiments/proj_mma/variants.py "$OUT/pending" 2>&1 | tail -n 40
    KERNEL=moe_dense timeout 280 python3 experiments/moe_cute/variants.py "$OUT/pending" 2>&1 | tail -n 25 ;;
  4)
    # the grouped MXFP4 experts' shared groups (thirty-fifth session): GPU tests, the settings, the target's sweep
    timeout 150 python3 -m pytest -q -m gpu tests/test_moe_cute.py -k "grouped and not dense" 2>&1 \
      | tee "$OUT/pending/pytest_gpu_grouped.log" | tail -n 4
    BATCHES=8,64 ROUTINGS=same16,uniform VARIANTS='[{}, {"UP_SHARE": 1, "DOWN_SHARE": 1}, {"UP_SHARE": 2},
      {"DOWN_SHARE": 8}, {"SHARE_FROM": 2}, {"UP_MEMBERS": 4}]' timeout 200 python3 experiments/moe_grouped/variants.py "$OUT/pending" 10 \
      2>&1 | tail -n 25
    timeout 200 $B moe --ops moe_experts --backends triton,cute --name moe_grouped_share --deadline 180 --no-peers \
      --grid dtype=mxfp4 --grid batch=1,2,8,16,32,64 --grid tp=8 --grid routing=uniform,same16 --grid latent=3584 \
      --grid inter=3072 --grid n_experts=896 --grid top_k=16 2>&1 | tail -n 30 ;;
  5)
    # the Triton projections' tiles at batch 32 / 64, where cuBLAS leads by 2-28 % (the defaults were explored at
    # batch 1 and 8 only: docs/NOTES_trunk.md); a winning set becomes proj_gemv.config's rule above SMALL_BATCH
    timeout 420 $B trunk --ops proj --backends triton --name proj_large_tiles --deadline 390 --grid preset=tp8 \
      --grid batch=32,64 --grid wdtype=bf16 --grid proj=kda_q,shared_w1,mla_dkv,moe_router,kda_o \
      --grid path=null,tma,dot --grid block_n=null,128 2>&1 | tail -n 40 ;;
  9)
    # the forty-second session: the Triton projections at batch 32 / 64, where cuBLAS leads by up to 28 % (issue 13;
    # no .gpu/ archive needed). Read offline then (sm_90, Triton 3.6, without the launcher's specialization: an
    # artifact, docs/NOTES_trunk.md forty-third section) the default there took 255 registers and a stack; tma at 8
    # warps held BN 64 in 119 registers and BN 128 in 207, no stack. So: tma at 8 warps over BN 64 / 128
    # and the K ranges, and dot at 8 warps. Run on an H100: none is ahead of cuBLAS at batch 64 (docs/NOTES_trunk.md);
    # the batch tile option block_m, timed in the same call (proj_block_m), lost and was removed (git history 40b9515)
    P="--grid preset=tp8 --grid batch=32,64 --grid wdtype=bf16 --grid proj=shared_w1,kda_q,kda_o,mla_dkv,moe_router"
    timeout 180 $B trunk --ops proj --backends triton --name proj_tma8 --deadline 150 $P --grid path=tma \
      --grid num_warps=8 --grid block_n=64,128 --grid split_k=null,4 2>&1 | tail -n 40
    timeout 110 $B trunk --ops proj --backends triton --name proj_dot8 --deadline 80 $P --grid path=dot \
      --grid num_warps=8 --grid block_n=null,64 2>&1 | tail -n 20 ;;
  7)
    # the fortieth session: the projections chained as the step runs them (rows triton_pdl / cute_pdl, the pdl knob)
    # beside the plain calls, cuBLAS and the stream peer (variants on: $B passes --no-variants, so the command is whole)
    timeout 330 $K bench trunk --ops proj --backends triton,cute --name proj_pdl --deadline 300 --out "$OUT/pending" \
      --skip torch_compile,reference --reps ${REPS:-20} --grid preset=tp8 --grid batch=1,8 --grid wdtype=bf16,fp8 \
      --grid proj=kda_q,kda_o,moe_down 2>&1 | tail -n 40 ;;
  8)
    # the bf16 grouped experts' tiles at batch 16 / 32 (issue 14's 95 %: 91.5 % at 16, 97.9 % at 64 with one tile)
    timeout 400 $B moe --ops moe_experts --backends triton --name moe_bf16_tiles --deadline 380 --no-peers \
      --grid dtype=bf16 --grid batch=16,32 --grid tp=8 --grid routing=uniform --grid latent=3584 --grid inter=3072 \
      --grid n_experts=896 --grid top_k=16 --grid path=grouped --grid block_n=32,64,128 --grid num_stages=3,4 \
      2>&1 | tail -n 20 ;;
  6)
    # the CuTe AttnRes: its GPU tests, then the options by batch beside fla: alpha "twopass" (thirty-sixth
    # session) at clusters 2 / 4 / 8, vec 4 / 8
    timeout 150 python3 -m pytest -q -m gpu tests/test_attnres_cute.py -k "large" 2>&1 \
      | tee "$OUT/pending/pytest_gpu_attnres.log" | tail -n 4
    timeout 300 $B trunk --ops attnres_norm --backends cute --name attnres_twopass --deadline 280 --grid batch=1,16,32,64 \
      --grid n_blocks=9 --grid update=add --grid dim=7168 --grid alpha=twopass --grid cluster=2,4,8 --grid vec=4,8 \
      2>&1 | tail -n 50 ;;
  esac
  pack pending ;;
ab)
  # the thirty-seventh session's queue (docs/NOTES_step.md), one call a part, `.gpu/cute` carried (PART=3 also
  # `.gpu/fi`): PART=1 the AttnRes form inside the batch-1 step; PART=2 the same A/B at batch 64; PART=3 the one-token
  # experts' GPU tests, KDA's decode beside FlashInfer, the AttnRes hot in L2; PART=4 the dense one-token experts' rows
  # a CTA; PART=5 MLA at 128K / 1M (1 and 3..5 ran on an H100 in the thirty-ninth session; the grouped experts' L2
  # requests PART=1 also timed then were removed, having lost); PART=6 the shared-expert stream at batch 1 and 8
  unpack cute; [ "${PART:-1}" = 3 ] && unpack fi; install
  mkdir -p "$OUT/ab"
  case "${PART:-1}" in
  1)
    timeout 200 python3 experiments/step_folds/step_ab.py "$OUT/ab" attnres_form 2>&1 | tail -n 16 ;;
  2)
    # the rule's form against the other two candidates (ARMS: step_ab.py's arm filter)
    BATCH=64 ARMS=${ARMS:-rule,threads_c8v8,twopass_c8v4} timeout 540 python3 experiments/step_folds/step_ab.py \
      "$OUT/ab" attnres_form 2>&1 | tail -n 16 ;;
  3)
    timeout 120 python3 -m pytest -q -m gpu tests/test_moe_cute.py -k test_k3_pool 2>&1 \
      | tee "$OUT/ab/pytest_gpu_token.log" | tail -n 3
    $K probes | tee "$OUT/ab/probes.json"
    timeout 240 $K bench kda --ops kda_decode --backends cute,triton --grid heads=12 --grid batch=1,2,4,8,16,32,64 \
      --grid tile_v=16,128 --reps 30 --deadline 220 --skip torch_compile --name kda_decode_fi --out "$OUT/ab" 2>&1 \
      | tail -n 30
    timeout 150 $K bench trunk --ops attnres_norm --backends cute --hot --grid batch=1,8,64 --grid n_blocks=9 \
      --grid update=add --grid dim=7168 --grid alpha=threads,twopass --grid cluster=8 --grid vec=4,8 --no-peers \
      --no-variants --reps 30 --deadline 130 --name attnres_hot --out "$OUT/ab" 2>&1 | tail -n 14 ;;
  4)
    # the dense one-token experts' rows a CTA (UP_ROWS / DOWN_ROWS, never swept on a GPU): bf16 and fp8 at TP8 / TP16
    KERNEL=moe_dense timeout 540 python3 experiments/moe_cute/variants.py "$OUT/ab" 20 2>&1 | tail -n 26 ;;
  6)
    # the shared-expert stream's bounded launch inside the batch-1 step (thirty-ninth session), then BATCH=8
    timeout 280 python3 experiments/step_folds/step_ab.py "$OUT/ab" shared_stream 2>&1 | tail -n 12
    mv "$OUT/ab/shared_stream_step_ab.json" "$OUT/ab/shared_stream_b1_step_ab.json" 2>/dev/null
    BATCH=8 timeout 280 python3 experiments/step_folds/step_ab.py "$OUT/ab" shared_stream 2>&1 | tail -n 12 ;;
  5)
    # the MLA decode's GPU shapes, 128K bf16 and 1M fp8 (per-position scales) at batch 1 among them (issue 12)
    timeout 500 python3 -m pytest -q -m gpu tests/test_mla_triton.py -k gpu_shapes 2>&1 \
      | tee "$OUT/ab/pytest_gpu_mla_long.log" | tail -n 4 ;;
  esac
  pack ab ;;
rows)
  # three calls (PART=1..3), each under the 10-minute limit
  unpack cute fi; install
  mkdir -p "$OUT/rows"
  M="$K bench moe --ops moe_experts --no-variants --skip torch_compile,reference --reps 20 --out $OUT/rows --grid tp=8
     --grid latent=3584 --grid inter=3072 --grid n_experts=896 --grid top_k=16 --grid routing=uniform"
  case "${PART:-1}" in
  1)
    # the MXFP4 experts on the forty-first session's decode (7 operations a word, brev; 13 before): issue 14's MXFP4
    # rows on moe_grouped_l1's grid, then the same cases on the code of 566f3c7 (the 13-operation decode) when the
    # call carries it as ab_old/ (`git archive 566f3c7 k3lab kernels data pyproject.toml | tar -x -C ab_old`,
    # kernels/ renamed k3lab_kernels/): the same-run A/B
    timeout 230 $M --backends triton,cute --no-peers --grid dtype=mxfp4 --grid batch=1,2,8,16,32,64 \
      --grid routing=uniform,same16 --name moe_mxfp4_brev --deadline 200 2>&1 | grep -E "moe_experts" | cut -c1-150 \
      | tail -n 24
    if [ -d ab_old/k3lab ]; then
      (cd ab_old && PYTHONPATH=$PWD:$PYTHONPATH timeout 150 $M --backends cute --no-peers --grid dtype=mxfp4 \
        --grid batch=1,8,16,64 --grid routing=uniform,same16 --name moe_mxfp4_13ops --deadline 120 2>&1 \
        | grep -E "moe_experts" | cut -c1-150 | tail -n 12)
    fi ;;
  2)
    timeout 250 $M --backends triton,cute --no-peers --grid dtype=bf16,fp8 --grid batch=1,16,32,64 --name moe_b1_b64 \
      --deadline 220 2>&1 | tee "$OUT/rows/moe.log" | grep -E "moe_experts" | cut -c1-150 | tail -n 20
    timeout 150 $M --backends cute --no-peers --grid dtype=bf16,fp8 --grid batch=1,2,4 --grid path=null,grouped \
      --name moe_dense_grouped_b1 --deadline 120 2>&1 | grep -E "moe_experts" | cut -c1-150 | tail -n 12 ;;
  3)
    timeout 300 $K bench kda --ops kda_decode --backends cute,triton --grid heads=12 --grid batch=1,2,4,8,16,32,64 \
      --grid tile_v=16,128 --reps 30 --deadline 250 --skip torch_compile --name kda_decode_fi --out "$OUT/rows" 2>&1 \
      | tee "$OUT/rows/kda.log" | grep -E "kda_decode" | cut -c1-150 | tail -n 30 ;;
  esac
  pack rows ;;
q46)
  # the forty-sixth session's queue (docs/NOTES_step.md), nothing carried, one call: PART=1 the fp8 projections with few
  # K chunks and many outputs, K split or not and 32-row tiles (a win becomes proj_gemv._split's rule for short K);
  # PART=2 the MLA split's lazy rescale at batch 1 / 16 / 32 / 64 (now the rule `default_lazy`; then `python
  # experiments/step_folds/step_ab.py $OUT mla_lazy` with `.gpu/cute`)
  install
  mkdir -p "$OUT/q46"
  case "${PART:-1}" in
  1)
    timeout 280 $K bench trunk --ops proj --backends triton --no-variants --skip torch_compile,reference --reps 20 \
      --grid preset=tp8,tp16 --grid wdtype=fp8 --grid batch=1,8,16,64 --grid proj=shared_w2,kda_o \
      --grid split_k=null,1 --grid block_n=null,32 --name fp8_short_k --out "$OUT/q46" --deadline 250 2>&1 | tail -n 2 ;;
  2)
    timeout 400 $K bench mla --ops mla_decode --backends triton --no-peers --no-variants --reps 20 \
      --grid batch=1,16,32,64 --grid context=8192,32768 --grid T=1,4,8 --grid lazy=null,true --name mla_lazy \
      --out "$OUT/q46" --deadline 330 2>&1 | grep -E "mla_decode" | cut -c1-150 | tail -n 48
    # (the CuTe decode's lazy form ran here with `.gpu/cute` on the code of 4088bad: level, since removed) ;;
  esac
  pack q46 ;;
q47)
  # the forty-seventh session's queue (docs/NOTES_trunk.md), nothing carried: PART=1 the fp8 short-input rule's rows
  # (FP8_SHORT_K) beside cuBLAS at batch 1 / 8 / 16, the other fp8 projections with 32-row tiles at batch 1 / 8, and
  # fp8 at batch 32 / 64 with 64-row tiles in one K range and 8 warps (issue 13's worst row: kda_o fp8 batch 64)
  install
  mkdir -p "$OUT/q47"
  T="$K bench trunk --ops proj --backends triton --no-variants --skip torch_compile,reference --reps 20 --out $OUT/q47
     --grid preset=tp8,tp16 --grid wdtype=fp8"
  case "${PART:-1}" in
  1)
    timeout 120 $T --grid batch=1,8,16 --grid proj=kda_o,mla_o,shared_w2 --name fp8_short_rule --deadline 100 2>&1 \
      | tail -n 1
    timeout 200 $T --grid batch=1,8 --grid proj=kda_q,moe_down,mla_dkv,shared_w1,moe_router,mla_uq \
      --grid block_n=null,32 --name fp8_bn32 --deadline 180 2>&1 | tail -n 1
    timeout 200 $T --grid batch=32,64 --grid proj=kda_o,shared_w2,mla_o --grid block_n=null,64 --grid split_k=null,1 \
      --grid num_warps=null,8 --name fp8_b64_tiles --deadline 180 2>&1 | tail -n 1 ;;
  2)
    # on an H200: issue 13's fp8 rows under the new tiles, beside cuBLAS (no stream peer: the bundle stays small)
    timeout 400 $T --skip torch_compile,reference,stream --grid batch=1,8,16,32,64 \
      --grid proj=shared_w1,kda_q,kda_o,mla_dkv,mla_uq,moe_router,kda_b,moe_down,shared_w2 --name proj_fp8_47 \
      --deadline 380 2>&1 | tail -n 1 ;;
  3)
    # on an H200 with .gpu/base, fi, fijit: PART=2 again under the final tile rule, then the MLA decode's partition
    # rule (one program an SM from batch 8) beside FlashInfer fa3 / fa2 (issue 12's fa3 row)
    unpack base fi fijit
    timeout 200 $T --skip torch_compile,reference,stream --grid batch=1,8,16,32,64 \
      --grid proj=shared_w1,kda_q,kda_o,mla_dkv,mla_uq,moe_router,kda_b,moe_down,shared_w2 --name proj_fp8_47 \
      --deadline 180 2>&1 | tail -n 1
    timeout 300 $K bench mla --ops mla_decode --backends triton --no-variants --skip torch_compile,reference --reps 30 \
      --grid heads=12 --grid batch=8,16,32 --grid context=8192,32768 --name mla_parts_h200 --out "$OUT/q47" \
      --deadline 280 2>&1 | grep -E "mla_decode" | cut -c1-120 | tail -n 18 ;;
  4)
    # any GPU: fp8 on 2 warps (offline SASS: the batch-64 tile's warps [1, 2] widen W twice, not four times: 1,018
    # instructions a tile's K step against 1,248; docs/NOTES_trunk.md) and 8 at batch 1..16
    timeout 250 $T --skip torch_compile,reference,stream --grid batch=1,8,16,64 --grid proj=kda_o,kda_q,moe_down \
      --grid num_warps=null,2,8 --name fp8_warps --deadline 230 2>&1 | grep -E "^proj" | cut -c1-120 | tail -n 40 ;;
  esac
  pack q47 ;;
*) echo "STEP must be cute, bench, fi, layer, layerbench, mla, pending, ab, rows, q46 or q47" >&2; exit 2 ;;
esac
ls -la "$OUT"
