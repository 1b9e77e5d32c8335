"""The projections' `stream` peer (how fast the harness reads a projection's weight bytes at all) as a program a
tile (k3lab_kernels.triton.bw_probe.stream_sum, the tile shapes the peer picked: a partial last wave at some sizes)
against the grid-sized `stream_grid` (a few configurations), at every TP8 / TP16 projection's and fused group's
weight bytes (bf16 and fp8) and at 2 GiB (the read probe's scale), graph replay with the buffers rotated past L2
(k3lab.harness.timing), each read's sum checked.
Run: python experiments/stream_peer/compare.py $OUT   (JSON $OUT/stream_peer.json, a table last; ONLY=mla_in,kda_in
GRIDS=2 keeps the rows whose label holds one of the words and the first grid configurations)."""
import json
import os
import sys

import torch

from k3lab.harness import env, timing
from k3lab.ops import trunk
from k3lab_kernels.triton import bw_probe as bw

OUT = sys.argv[1] if len(sys.argv) > 1 else "/tmp"
SMS = torch.cuda.get_device_properties(0).multi_processor_count
GRID = (bw.GRID_CONFIG, (2048, 4, 8, 4), (2048, 8, 4, 4), (4096, 4, 4, 8), (2048, 2, 16, 4))  # the first: the peer's

sizes = {}
for preset in ("tp8", "tp16"):
    sh = trunk.proj_shapes(preset)
    for name, (n, k) in sh.items():
        for wd, e in (("bf16", 2), ("fp8", 1)):
            sizes[f"{preset} {name} {wd}"] = n * k * e
    for g, parts in trunk.GROUPS.items():
        sizes[f"{preset} {g} bf16"] = sum(sh[p][0] * sh[p][1] for p in parts) * 2
sizes = dict(sorted(sizes.items(), key=lambda kv: kv[1]))
seen, uniq = set(), {}
for k, v in sizes.items():  # one row a byte count
    if v not in seen and v >= 2**20:
        seen.add(v)
        uniq[k] = v

uniq["read probe's size (2 GiB)"] = 2 * 2**30  # where the probe measures the read bandwidth (4 GiB there)
if os.environ.get("ONLY"):  # a short call: the rows whose label contains one of ONLY's comma-separated words
    uniq = {k: v for k, v in uniq.items() if any(w in k for w in os.environ["ONLY"].split(","))}
    GRID = GRID[:int(os.environ.get("GRIDS", len(GRID)))]
pr = timing.probes("cuda")
ENV = {**env.fingerprint(), **env.git_state()}  # the shared environment record (a bundle's `env`)
rows = []
for label, nbytes in uniq.items():
    n = nbytes // 2
    sets_n = timing.rotation_count(nbytes, timing.l2_bytes())
    xs = [torch.randn(n, device="cuda").to(torch.bfloat16) for _ in range(max(2, sets_n))]
    want = float(xs[0].double().sum())
    row = dict(label=label, bytes=nbytes, floor_us=nbytes / (pr["read_tbps"] * 1e12) * 1e6, sets=len(xs))
    cfg = bw.fit_config(n)  # the stream peer's tile
    variants = [("tile", cfg)] if cfg else []
    variants += [("grid", c) for c in GRID]
    for kind, c in variants:
        if kind == "tile":
            part = torch.empty(n // (c[0] * c[1]), dtype=torch.float32, device="cuda")
            fn = (lambda x, p=part, c=c: bw.stream_sum(x, p, c))
        else:
            part = torch.empty(bw.grid_programs(n, SMS, c), dtype=torch.float32, device="cuda")
            fn = (lambda x, p=part, c=c: bw.stream_grid(x, p, c))
        fn(xs[0])
        got = float(part.double().sum())
        ok = abs(got - want) <= 1e-3 * float(xs[0].double().abs().sum())
        t = timing.bench_gpu(fn, input_sets=[(x,) for x in xs], reps=30)
        row[f"{kind} {c}"] = dict(median_us=t.median_us, p10_us=t.p10_us, p90_us=t.p90_us, ok=ok,
                                  samples_us=t.samples_us)
        print(label, kind, c, round(t.median_us, 2), ok, flush=True)
    rows.append(row)
    del xs
    torch.cuda.empty_cache()
    json.dump(dict(probes=pr, sms=SMS, gpu=torch.cuda.get_device_name(), env=ENV, rows=rows),
              open(f"{OUT}/stream_peer.json", "w"), indent=1)

keys = [k for k in rows[0] if k.startswith(("tile", "grid"))]
print("%-28s %8s %7s" % ("bytes", "MB", "floor") + "".join(" %9s" % ("tile" if k.startswith("tile") else "g" + str(i))
                                                            for i, k in enumerate(keys)))
for r in rows:
    cells = []
    for k in [k for k in r if k.startswith(("tile", "grid"))]:
        cells.append("%9.2f" % r[k]["median_us"] + ("" if r[k]["ok"] else "!"))
    print("%-28s %8.1f %7.2f" % (r["label"], r["bytes"] / 1e6, r["floor_us"]) + "".join(cells))
print("grid configs:", [str(c) for c in GRID])
