"""GPU: the MXFP4 simt experts kernel at small sizes (the tiny stack's latent 32 / intermediate 32 failed on the
H200), through the shared checker, with tile variants; and the simt decode at narrow rows."""

import torch

from k3lab import mxfp4, registry
from k3lab.harness import checker
from k3lab_kernels.triton import moe_experts as M

OP = registry.get("moe_experts")
rows = []
for lat, inter in ((32, 32), (64, 32), (32, 64), (64, 64), (128, 64), (64, 128), (256, 256), (512, 256)):
    for batch in (1, 3):
        for opts in ({}, dict(block_t=1), dict(persist=0), dict(block_n=16, block_l=32)):
            o = dict(path="simt", **opts)
            try:
                c = OP.case(dtype="mxfp4", batch=batch, latent=lat, inter=inter, tp=1, n_experts=16, top_k=4)
                r = checker.check(OP, c, backend="triton", options=o, seed=0)
                msg = "ok" if r.ok else "; ".join(r.failures)[:150]
            except Exception as e:  # noqa: BLE001
                msg = f"{type(e).__name__}: {e}"[:150]
            rows.append((lat, inter, batch, str(opts), msg))
            print(lat, inter, batch, opts, msg, flush=True)
for C in (32, 64, 128, 512):
    R = 8
    vals = torch.randint(0, 256, (R, C // 2), dtype=torch.uint8)
    sc = torch.randint(100, 140, (R, C // 32), dtype=torch.uint8)
    want = mxfp4.unpack_mxfp4(vals, sc, torch.float32)
    words = mxfp4.to_kernel_layout(vals) if hasattr(mxfp4, "to_kernel_layout") else None
    try:
        dev = "cuda" if torch.cuda.is_available() else "cpu"
        got = M.mxfp4_dequant_simt(words.to(dev), sc.to(dev)).cpu()
        print("dequant C", C, "max abs diff", float((got - want).abs().max()),
              "nonfinite", int((~got.isfinite()).sum()))
    except Exception as e:  # noqa: BLE001
        print("dequant C", C, type(e).__name__, str(e)[:200])
bad = [r for r in rows if r[-1] != "ok"]
print(f"\n{len(bad)} of {len(rows)} failed")
for r in bad[:40]:
    print(*r)
