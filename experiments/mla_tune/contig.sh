#!/usr/bin/env bash
# The MLA split on the contiguous cache (the decode step's): its block loop has no page index to wait on, yet runs the
# paged-without-preload tiles (64 positions from batch 16, two stages); an H100 had it 5-12 % behind page 64 from
# batch 16 (profiles/h100-80gb-hbm3/mla_tma_r2.json.gz,
# git history at 5196fe5). One device call on any GPU, nothing carried: block_n x stages
# on the contiguous cache, then page 64's defaults in the same run; T = 1, 12 heads, batch 1 / 8 / 16 / 32, 8K / 32K.
# Bundles mla_contig, mla_contig_p64 under $OUT/mla_contig, packed into $OUT/mla_contig.tgz; a short table last.
# EXTRA adds grid flags to both (e.g. EXTRA="--grid T=4" for the verify, which keeps the old tiles: unmeasured), NAME
# replaces the bundles' stem.
set -uo pipefail
. experiments/device_setup.sh mla_contig
B="python3 -m k3lab.cli bench mla --ops mla_decode --backends triton --no-variants --no-peers --reps 20 --grid heads=12
   --grid batch=${BATCHES:-1,8,16,32} --grid context=8192,32768 --out $OUT/mla_contig ${EXTRA:-}"
timeout 300 $B --grid page_size=0 --grid block_n=null,32 --grid num_stages=null,3 --name ${NAME:-mla_contig} --deadline 280 \
  2>&1 | tail -n 1
timeout 100 $B --grid page_size=64 --name ${NAME:-mla_contig}_p64 --deadline 80 2>&1 | tail -n 1
python3 - "$OUT/mla_contig" > "$OUT/mla_contig/table.txt" <<'PY'
import glob, json, sys
for f in sorted(glob.glob(sys.argv[1] + "/*/*.json")):
    d = json.load(open(f))
    print("==", f.split("/")[-1], d["env"].get("gpu"))
    for r in d["rows"]:
        e = r["extra"]
        o = {k: v for k, v in (e.get("options") or {}).items() if v is not None}
        print(f"b{e['batch']:<3d} T{e['T']} {e['context']:6d} page {e['page_size']:2d} {r['median_us']:8.2f} us "
              f"{r.get('pct_of_bw') or 0:5.1f} % ok {(r.get('error') or {}).get('ok')} {o} {e['ran'].get('notes', '')[-60:]}")
PY
tar czf "$OUT/mla_contig.tgz" -C "$OUT" mla_contig && tar xzf "$OUT/mla_contig.tgz" -O mla_contig/table.txt \
  && rm -rf "${OUT:?}/mla_contig"
