"""Print the rows of MLA decode bundles: python experiments/mla_cute/table.py BUNDLE [BUNDLE ...]"""
import sys

from k3lab.harness import bundle

for path in sys.argv[1:]:
    bd = bundle.load(path)
    print(f"# {path}  ({'; '.join(n for n in bd.notes if not n.startswith('winners'))[:200]})")
    for r in bd.rows:
        x, e = r.extra or {}, r.error or {}
        opts = ",".join(f"{k}={v}" for k, v in (x.get("options") or {}).items() if v is not None)
        print(f"B{x.get('batch'):<3} ctx {x.get('context')!s:>6} page {x.get('page_size')!s:>2}"
              f" P {x.get('partitions')!s:>4} {r.backend:<7} {opts:<24} {r.median_us:8.2f} us"
              f"  floor {r.floor_us:6.2f} ({r.floor_bw})"
              f" {r.pct_of_bw:5.1f} %  err {e.get('rel_norm', float('nan')):.1e} ok {e.get('ok')}")
