"""The SASS stall table of `ncu_source.sh`: python experiments/moe_simt/stall_top.py src_b1.csv[.gz] [N]: the share
of executed instructions and of warp-stall samples by opcode, then the N instructions with the most samples."""
import csv
import gzip
import io
import sys
from collections import Counter

path = sys.argv[1]
n_top = int(sys.argv[2]) if len(sys.argv) > 2 else 25
lines = (gzip.open(path, "rt") if path.endswith(".gz") else open(path)).read().splitlines()
start = next(k for k, line in enumerate(lines) if line.startswith('"Address"'))
rows = list(csv.reader(io.StringIO("\n".join(lines[start:]))))
hdr, data = rows[0], rows[1:]
ia, isrc = hdr.index("Address"), hdr.index("Source")
iall, iexe = hdr.index("Warp Stall Sampling (All Samples)"), hdr.index("Instructions Executed")


def num(x: str) -> float:
    try:
        return float(x.replace(",", ""))
    except ValueError:
        return 0.0


def opcode(src: str) -> str:
    parts = src.split()
    if parts and parts[0].startswith("@"):
        parts = parts[1:]
    return parts[0].split(".")[0] if parts else ""


samples = sum(num(r[iall]) for r in data)
executed = sum(num(r[iexe]) for r in data)
ex, st = Counter(), Counter()
for r in data:
    ex[opcode(r[isrc])] += num(r[iexe])
    st[opcode(r[isrc])] += num(r[iall])
print(f"{len(data)} SASS instructions, {executed:.0f} warp instructions executed, {samples:.0f} stall samples")
print("opcode      executed %  stall samples %")
for op, v in ex.most_common(20):
    print(f"{op:10s} {100 * v / executed:10.1f} {100 * st[op] / samples:16.1f}")
print(f"\nthe {n_top} instructions with the most samples (% of samples, address, SASS, times executed by a warp):")
for r in sorted(data, key=lambda r: -num(r[iall]))[:n_top]:
    print(f"{100 * num(r[iall]) / samples:5.1f}  {r[ia]}  {r[isrc][:80]:80s}  {r[iexe]}")
