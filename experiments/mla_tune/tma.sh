#!/usr/bin/env bash
# The MLA split's cache blocks through tensor descriptors (option `tma`, off by default until this runs) against the
# pointer loads, one device call on any GPU, no .gpu/ archive: T = 1, 12 heads, batch 1 / 16 / 32 at 8K and 32K, the
# contiguous cache (the step's) and page 64 (page indices preloaded, as the pointer loop takes them); two rounds.
# Bundles mla_tma_r<N> under $OUT/mla_tma, packed into $OUT/mla_tma.tgz; a short table last.
set -uo pipefail
export PYTHONUNBUFFERED=1
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
pip install -q --no-deps --no-build-isolation -e . >/dev/null 2>&1
mkdir -p "$OUT/mla_tma"
nvidia-smi --query-gpu=name --format=csv,noheader
for r in ${ROUNDS:-1 2}; do
  timeout ${LIMIT:-200} python3 -m k3lab.cli bench mla --ops mla_decode --backends triton --no-variants --no-peers \
    --reps 20 --grid heads=12 --grid batch=${BATCHES:-1,16,32} --grid context=8192,32768 --grid page_size=0,64 \
    --grid tma=null,true --name "mla_tma_r$r" --out "$OUT/mla_tma" --deadline $((${LIMIT:-200} - 20)) 2>&1 | tail -n 1
done
python3 - "$OUT/mla_tma" > "$OUT/mla_tma/table.txt" <<'PY'
import glob, json, sys
for f in sorted(glob.glob(sys.argv[1] + "/*/*.json")):
    d = json.load(open(f))
    print("==", f.split("/")[-1], d["env"].get("gpu"))
    for r in d["rows"]:
        e = r["extra"]
        tma = (e.get("options") or {}).get("tma")
        print(f"b{e['batch']:<3d} ctx {e['context']:6d} page {e['page_size']:2d} tma {str(tma):5s} "
              f"{r['median_us']:8.2f} us  {r.get('pct_of_bw') or 0:5.1f} %  ok {(r.get('error') or {}).get('ok')}")
PY
tar czf "$OUT/mla_tma.tgz" -C "$OUT" mla_tma && tar xzf "$OUT/mla_tma.tgz" -O mla_tma/table.txt && rm -rf "${OUT:?}/mla_tma"
