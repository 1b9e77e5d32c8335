"""The short table of the projection experiments' run.sh scripts: every row of the bundles under DIR, us.

    python3 experiments/proj_b64/table.py DIR
"""
import glob
import json
import sys

for f in sorted(glob.glob(sys.argv[1] + "/*/*.json")):
    d = json.load(open(f))
    if not any("proj" in r["extra"] for r in d["rows"]):  # another component's bundle of the same call
        continue
    print("==", f.split("/")[-1], d.get("env", {}).get("gpu"))
    for r in d["rows"]:
        e = r["extra"]
        o = {k: v for k, v in (e.get("options") or {}).items() if v is not None}
        ok = (r.get("error") or {}).get("ok")
        print(f"{r['backend']:7s} {e.get('preset')} {e.get('wdtype')} {e.get('proj'):10s} {e.get('batch'):3d} "
              f"{r['median_us']:7.2f} {ok} {o}")
