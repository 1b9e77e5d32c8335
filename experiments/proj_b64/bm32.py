"""fp8 projections over short inputs (K <= 2048) at batch 33..64: the rule's one 64-row batch tile against two 32-row
batch tiles that take the batch-32 rule's tiles (64 W rows in one K range where they fill half the SMs; the second
batch tile re-reads its W tile mostly from L2), beside cuBLAS on the bf16 dequantized weights. The 32-row arm runs the
same kernel with `proj_gemv.config` asked for min(batch, 32) rows (the launch still covers every row). Graph replays,
inputs rotated past L2 (k3lab.harness.timing); each arm's output checked against the fp64 dequantized product.
Device: python3 experiments/proj_b64/bm32.py $OUT   (writes $OUT/proj_bm32.json, prints a table)"""
import json
import sys

import torch

from k3lab import registry
from k3lab.harness import timing
from k3lab_kernels.triton import proj_gemv as pg

OUT = sys.argv[1] if len(sys.argv) > 1 else "/tmp"
OP = registry.get("proj")
CONFIG = pg.config


def config32(M, N, K, device, **kw):
    return CONFIG(min(M, 32), N, K, device, **kw)


rows = []
pr = timing.probes("cuda")
for preset in ("tp8", "tp16"):
    for proj in ("kda_o", "mla_o", "shared_w2", "mla_uq"):
        for batch in (33, 48, 64):
            case = OP.case(preset=preset, proj=proj, batch=batch, wdtype="fp8", residual=False, prologue="none")
            n_sets = timing.rotation_count(OP.nbytes(case), timing.l2_bytes()) + 1
            sets = [OP.make_inputs(case, 100 + i, "cuda") for i in range(n_sets)]
            for s in sets:
                s["wdq"] = (s["w"].to(torch.float32) * s["w_scale"][:, None]).to(torch.bfloat16)
            s0 = sets[0]
            ref = s0["x"].double() @ (s0["w"].double() * s0["w_scale"].double()[:, None]).T
            arms = {
                "rule": (CONFIG, lambda s: pg.proj(s["x"], s["w"], [s["y0"]], w_scale=s["w_scale"])),
                "bm32": (config32, lambda s: pg.proj(s["x"], s["w"], [s["y0"]], w_scale=s["w_scale"])),
                "cublas": (CONFIG, lambda s: torch.nn.functional.linear(s["x"], s["wdq"])),
            }
            for name, (cfg, fn) in arms.items():
                pg.config = cfg
                try:
                    s0["y0"].fill_(float("nan"))
                    y = fn(s0)
                    torch.cuda.synchronize()
                    y = y if name == "cublas" else s0["y0"]
                    err = float((y.double() - ref).norm() / ref.norm())
                    nb = OP.nbytes(case)
                    t = timing.bench_gpu(fn, input_sets=[(s,) for s in sets], reps=20, bytes_per_call=nb)
                finally:
                    pg.config = CONFIG
                rows.append(dict(preset=preset, proj=proj, batch=batch, arm=name, median_us=t.median_us,
                                 samples_us=t.samples_us, rel_err=err, floor_us=nb / (pr["read_tbps"] * 1e12) * 1e6))
                print(f"{preset:5s} {proj:10s} {batch:3d} {name:7s} {t.median_us:8.2f} us  err {err:.1e}", flush=True)
            json.dump(dict(probes=pr, rows=rows, env=dict(torch=torch.__version__, gpu=torch.cuda.get_device_name())),
                      open(f"{OUT}/proj_bm32.json", "w"), indent=1)
