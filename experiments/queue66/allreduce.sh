#!/usr/bin/env bash
# The decode step's all-reduce measured on a multi-GPU kind (nothing carried): every GPU of the host as the TP group
# (nvidia-h100-x8: TP8's 8 ranks; x2 / x4 smaller groups), batches 1 / 8 / 64 tokens, NCCL eager and captured and
# symmetric memory's one-shot, multicast off (the study forces NCCL_NVLS_ENABLE=0, TORCH_SYMM_MEM_DISABLE_MULTICAST=1,
# NVSHMEM_DISABLE_NVLS=1 in every rank). Bundle allreduce_x<N>; then `k3lab publish` it and give the step
# `-p allreduce_bundle profiles/<gpu>/allreduce_x<N>.json.gz`.
# Device (kind nvidia-h100-x8 or x2): bash experiments/queue66/allreduce.sh    (everything under $OUT/ar)
set -uo pipefail
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
. experiments/device_setup.sh ar
nvidia-smi topo -m 2>&1 | head -12
timeout 300 python3 -m k3lab.studies.allreduce "$OUT/ar" --batches 1,8,64 --reps 50 2>&1 | tail -n 20
