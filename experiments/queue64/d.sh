#!/usr/bin/env bash
# The sixty-fourth session's GPU check of its cleanup (carry .gpu/cute): the grouped CuTe MoE experts after
# UP_MEMBERS' removal (the compile key and the up kernel's constructor changed), K3's pool at every grouped batch and
# routing the GPU tests hold, graph capture with new routing.
# Device: bash experiments/queue64/d.sh
set -uo pipefail
eval "$(bash .gpu/cute/unpack.sh)"
. experiments/device_setup.sh t
timeout 420 python3 -m pytest -q -m gpu tests/test_moe_cute.py -k "grouped or graph or repeated" -p no:cacheprovider \
  2>&1 | tail -n 15
