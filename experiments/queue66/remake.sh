#!/usr/bin/env bash
# Another GPU's targets page, a few issues a call: the bundles of the targets that are failing or not measured in
# profiles/<this gpu>/ (`k3lab targets --commands --failing --profiles`), remade under their names by the bench
# commands their committed H200 bundles record, each capped at DEADLINE seconds, into $OUT/t/<gpu>/; then the page of
# those issues off them. Whatever of .gpu/cute, .gpu/base, .gpu/fi, .gpu/fijit is carried is unpacked; CuTe DSL also
# from a warm machine's /root/k3site (cute alone fills a call's 64 MiB: carry it first, then base + fi + fijit).
# A peer or backend not installed is skipped by bench with the reason, and its target reads "not measurable there".
# ONLY=name1,name2: just those bundles (one large sweep a call, e.g. ONLY=proj_fp8_47 DEADLINE=480).
# Device: ISSUES="16 14" DEADLINE=150 bash experiments/queue66/remake.sh    (everything under $OUT/t)
set -uo pipefail
for p in cute base fi fijit; do [ -f .gpu/$p/unpack.sh ] && eval "$(bash .gpu/$p/unpack.sh)"; done
[ -d /root/k3site/nvidia_cutlass_dsl ] && export PYTHONPATH=/root/k3site:/root/k3site/nvidia_cutlass_dsl/dsl_packages${PYTHONPATH:+:$PYTHONPATH}
. experiments/device_setup.sh t
gpu=$(python3 -c "import torch; from k3lab.harness.env import gpu_slug; print(gpu_slug(torch.cuda.get_device_name()))")
mkdir -p "profiles/$gpu"  # (a GPU without committed bundles: every target not measured there)
sel=(); for i in ${ISSUES:-16}; do sel+=(--issue "$i"); done
python3 -m k3lab.cli targets --commands --failing --profiles "$gpu" "${sel[@]}" --out "$OUT/t" > "$OUT/t/commands.sh"
cat "$OUT/t/commands.sh" | cut -c1-200
grep '^python -m k3lab.cli bench ' "$OUT/t/commands.sh" | sed 's/  #.*//' | while read -r line; do
  name=$(sed -E 's/.* --name ([^ ]+) .*/\1/' <<< "$line")
  if [ -n "${ONLY:-}" ] && [[ ",$ONLY," != *",$name,"* ]]; then continue; fi
  echo "== $line" | cut -c1-160
  eval "timeout $(( ${DEADLINE:-150} + 60 )) $line --deadline ${DEADLINE:-150}" 2>&1 | grep -E "^bundle|rror|skipped" | cut -c1-200
done
python3 -m k3lab.cli targets --profiles "$OUT/t/$gpu" "${sel[@]}" | cut -c1-260
