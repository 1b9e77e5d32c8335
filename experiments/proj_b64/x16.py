"""Does the fp8 dot path at batch 32 / 64 spend its time converting x? The same Triton kernel (`proj_gemv.proj`,
default tiles) timed with x given in bf16 (the kernel rounds every x tile to f16 in each program, as it runs today),
with x already in f16 (rounded once outside the timed call: the kernel's `.to(float16)` is then a no-op; the values
multiplied are identical), and with x rounded by a torch cast inside the timed call (one extra launch), beside cuBLAS
on the bf16 dequantized weights. Graph replays, inputs rotated past L2 (k3lab.harness.timing). Each arm's output is
compared with the bf16 arm's (bit-equal expected: the same products in the same order).
Device: [PROJS=a,b] [BATCHES=1,4] [NAME=proj_x16] python3 experiments/proj_b64/x16.py $OUT   (writes
$OUT/NAME.json, prints a table; defaults: kda_o, shared_w2, kda_q, moe_down at batch 16 / 32 / 64)"""
import json
import os
import sys

import torch

from k3lab import registry
from k3lab.harness import timing
from k3lab_kernels.triton import proj_gemv as pg

OUT = sys.argv[1] if len(sys.argv) > 1 else "/tmp"
OP = registry.get("proj")
rows = []
pr = timing.probes("cuda")
for preset in ("tp8", "tp16"):
    for proj in os.environ.get("PROJS", "kda_o,shared_w2,kda_q,moe_down").split(","):
        for batch in [int(b) for b in os.environ.get("BATCHES", "16,32,64").split(",")]:
            case = OP.case(preset=preset, proj=proj, batch=batch, wdtype="fp8", residual=False, prologue="none")
            n_sets = timing.rotation_count(OP.nbytes(case), timing.l2_bytes()) + 1
            sets = [OP.make_inputs(case, 100 + i, "cuda") for i in range(n_sets)]
            for s in sets:
                s["x16"] = s["x"].to(torch.float16)
                s["out16"] = torch.empty_like(s["y0"])
                s["wdq"] = (s["w"].to(torch.float32) * s["w_scale"][:, None]).to(torch.bfloat16)
            arms = {
                "x_bf16": lambda s: pg.proj(s["x"], s["w"], [s["y0"]], w_scale=s["w_scale"]),
                "x_f16": lambda s: pg.proj(s["x16"], s["w"], [s["out16"]], w_scale=s["w_scale"]),
                "x_f16_cast": lambda s: pg.proj(s["x"].to(torch.float16), s["w"], [s["out16"]], w_scale=s["w_scale"]),
                "cublas": lambda s: torch.nn.functional.linear(s["x"], s["wdq"]),
            }
            ref = None
            for name, fn in arms.items():
                fn(sets[0])
                torch.cuda.synchronize()
                if name == "x_bf16":
                    ref = sets[0]["y0"].clone()
                same = None if name == "cublas" else bool(torch.equal(
                    ref, sets[0]["y0"] if name == "x_bf16" else sets[0]["out16"]))
                nb = OP.nbytes(case)
                t = timing.bench_gpu(fn, input_sets=[(s,) for s in sets], reps=20, bytes_per_call=nb)
                rows.append(dict(preset=preset, proj=proj, batch=batch, arm=name, median_us=t.median_us,
                                 samples_us=t.samples_us, bit_equal=same,
                                 floor_us=nb / (pr["read_tbps"] * 1e12) * 1e6))
                print(f"{preset:5s} {proj:10s} {batch:3d} {name:11s} {t.median_us:8.2f} us  equal={same}", flush=True)
            json.dump(dict(probes=pr, rows=rows, env=dict(torch=torch.__version__, gpu=torch.cuda.get_device_name())),
                      open(f"{OUT}/{os.environ.get('NAME', 'proj_x16')}.json", "w"), indent=1)
