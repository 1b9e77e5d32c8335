#!/usr/bin/env bash
# The MLA decode on this tree against older trees in one run, arms alternating (ROUNDS, default 2): "." and each
# directory of TREES (default "ab_mid ab_old") that exists, each made by
#   git archive REV k3lab kernels data pyproject.toml | tar -x -C DIR && mv DIR/kernels DIR/k3lab_kernels
# and carried (list DIR in .git/info/exclude). Fiftieth session: ab_old = b0537fe~1 (the merge kernel's own body,
# the split dividing a value at a time), ab_mid = b0537fe (the shared _merge_unit), "." the split's reciprocal.
# Bundles $OUT/ab/<arm>_r<round> (rounds R0+1..R0+ROUNDS), packed into $OUT/ab_r<R0+1>.tgz; a table of medians last. Any GPU; nothing else carried.
set -uo pipefail
export PYTHONUNBUFFERED=1
O="$OUT/ab"; mkdir -p "$O"
nvidia-smi --query-gpu=name --format=csv,noheader
B="python3 -m k3lab.cli bench mla --ops mla_decode --backends triton --no-peers --no-variants
   --skip torch_compile,reference --reps ${REPS:-30} --grid heads=12"
G=${GRID:---grid batch=1 --grid context=1024,8192,32768}
G2=${GRID2:---grid batch=8,32 --grid context=8192}
for r in $(seq $((${R0:-0} + 1)) $((${R0:-0} + ${ROUNDS:-2}))); do
  for a in . ${TREES:-ab_mid ab_old}; do
    [ "$a" = . ] || [ -d "$a/k3lab" ] || continue
    n=$( [ "$a" = . ] && echo new || echo "$a" )
    (cd "$a" && PYTHONPATH=$PWD:${PYTHONPATH:-} timeout 75 $B $G --name "${n}_r${r}" --out "$O" --deadline 55 \
      >/dev/null 2>&1; PYTHONPATH=$PWD:${PYTHONPATH:-} timeout 75 $B $G2 --name "${n}_b_r${r}" --out "$O" \
      --deadline 55 >/dev/null 2>&1)
    echo "arm $n round $r done"
  done
done
python3 - "$O" <<'PY'
import glob, gzip, json, os, sys
rows = {}
for f in sorted(glob.glob(os.path.join(sys.argv[1], "**", "*.json*"), recursive=True)):
    op = gzip.open if f.endswith(".gz") else open
    try:
        d = json.load(op(f, "rt"))
    except Exception:
        continue
    arm = os.path.basename(f).split(".")[0].rsplit("_r", 1)[0].replace("_b", "")
    for row in d.get("rows", []):
        if row.get("backend") != "triton" or "median_us" not in row:
            continue
        rows.setdefault(row.get("name", "?").split("[", 1)[-1].replace("dcp=1,dcp_layout=interleave,fp8_scale=tensor,heads=12,kv_dtype=bf16,pad_heads=0,page_size=64,", ""), {}).setdefault(arm, []).append(row["median_us"])
arms = sorted({a for v in rows.values() for a in v})
print("case".ljust(60), *(a.rjust(16) for a in arms))
for c, v in rows.items():
    print(c[:60].ljust(60), *(("/".join(f"{x:.2f}" for x in v.get(a, []))).rjust(16) for a in arms))
PY
# the device returns a bounded number of files a call: one archive holds every bundle (PACK=0 leaves them as they are)
[ "${PACK:-1}" = 1 ] && tar czf "$OUT/ab_r$((${R0:-0} + 1)).tgz" -C "$OUT" ab && rm -rf "${O:?}"
exit 0
