#!/usr/bin/env bash
# The fifty-eighth session's call (.gpu/cute and .gpu/fi carried): the CuTe KDA decode at tile 128 with 16 warps
# (num_warps 16: 512 threads, 8 state rows a thread, registers capped at 64 for two CTAs an SM; FlashInfer's occupancy)
# against the 8-warp default and FlashInfer's fused decode, batch 1..64 at 12 heads, plain and pdl (bundle kda_warps58).
# Device: bash experiments/kda_ncu/warps58.sh    (everything under $OUT/q)
set -uo pipefail
. experiments/device_setup.sh q
eval "$(bash .gpu/cute/unpack.sh)"
eval "$(bash .gpu/fi/unpack.sh)"
timeout ${D:-400} python3 -m k3lab.cli bench kda --ops kda_decode --backends cute --grid heads=12 \
  --grid batch=16,8,12,20,24,32,64,4,1 --grid tile_v=128 --grid num_warps=null,16 \
  --skip torch_compile,reference,fla_recurrence,fla_path,torch_copy --reps 30 \
  --out "$OUT/q" --name kda_warps58 --deadline $(( ${D:-400} - 40 )) 2>&1 | grep -E "rror" | cut -c1-160
python3 - "$OUT/q" <<'PY'
import json, sys, pathlib
for f in sorted(pathlib.Path(sys.argv[1]).rglob("kda_warps58*.json")):
    rows = json.load(open(f))["rows"]
    by = {}
    for r in rows:
        e = r["extra"]
        nw = e.get("options", {}).get("num_warps") or e.get("num_warps")
        tag = r["backend"] + (f"/w{nw}" if nw else "")
        by.setdefault(e.get("batch"), []).append(f"{tag}={r['median_us']:.2f}{'' if r['error']['ok'] else '!'}")
    for b in sorted(by):
        print(b, " ".join(by[b]))
PY
