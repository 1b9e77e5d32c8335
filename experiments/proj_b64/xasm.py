"""x widened bf16 -> f16 in three instructions a pair on the fp8 dot path (docs/NOTES_trunk.md, fifty-second section):
the production kernel (kernels/triton/proj_gemv.py, `xt.to(tl.float16)`: four a pair, 64 of a small-batch K step's 157
SASS instructions a warp) against a copy of the module whose F16 branch widens x by inline PTX (shl / and /
cvt.rn.f16x2.f32: the same round-to-nearest-even of the same f32 values, so the outputs must be bit-equal; 141
instructions offline). The copy is written to a temporary file and imported under another name; production is not
touched. Both timed through their own `proj` on the same inputs (graph replays, inputs rotated past L2,
k3lab.harness.timing), default configuration, fp8 weights, TP8 / TP16, batch 1..16 (and 32).
Device (no archive): python3 experiments/proj_b64/xasm.py $OUT   ($OUT/proj_xasm.json, a table last)
Offline (no GPU; Triton 3.6 on PYTHONPATH, its ptxas on PATH): python3 experiments/proj_b64/xasm.py --sass"""
import importlib.util
import json
import os
import sys
import tempfile

import torch

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..")
OLD = "acc += tl.dot(wt.to(tl.float16), tl.trans(xt.to(tl.float16)))"
PTX = "{ .reg .b32 a, b; shl.b32 a, $1, 16; and.b32 b, $1, 0xFFFF0000; cvt.rn.f16x2.f32 $0, b, a; }"
NEW = ("acc += tl.dot(wt.to(tl.float16), tl.trans(tl.inline_asm_elementwise(\"" + PTX + "\", \"=r,r\", [xt], "
       "dtype=tl.float16, is_pure=True, pack=2)))")


def patched(package: str):
    """The projection module with x's widening replaced, imported as <package>.proj_gemv_xasm from a temporary file
    (Triton reads a kernel's source from its file)."""
    src = open(os.path.join(ROOT, "kernels", "triton", "proj_gemv.py")).read()
    assert src.count(OLD) == 1, "the F16 branch of proj_gemv changed: update experiments/proj_b64/xasm.py"
    path = os.path.join(tempfile.mkdtemp(prefix="k3lab_xasm_"), "proj_gemv_xasm.py")
    open(path, "w").write(src.replace(OLD, NEW))
    spec = importlib.util.spec_from_file_location(f"{package}.proj_gemv_xasm", path)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod
    spec.loader.exec_module(mod)
    return mod


if __name__ == "__main__" and "--sass" in sys.argv:
    sys.path.insert(0, ROOT)
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    import sass_check

    for name, mod in (("production", sass_check.pg), ("xasm", patched("kernels.triton"))):
        sass_check.pg = mod
        info, loops, _ = sass_check.compile_proj(4, 4, False, BM=16, BN=32, BK=128, SPLIT=2, FP8=True, F16=True)
        print(name, " ".join(line.strip() for line in info.splitlines() if "registers" in line),
              [d["instructions"] for d in loops])
    sys.exit(0)

if __name__ == "__main__":
    from k3lab import registry
    from k3lab.harness import timing
    from k3lab_kernels.triton import proj_gemv as pg

    OUT = sys.argv[1] if len(sys.argv) > 1 else "/tmp"
    px = patched("k3lab_kernels.triton")
    OP = registry.get("proj")
    pr = timing.probes("cuda")
    rows = []
    for preset in ("tp8", "tp16"):
        for proj in os.environ.get("PROJS", "kda_q,kda_o,moe_down,mla_dkv,shared_w1").split(","):
            for batch in [int(b) for b in os.environ.get("BATCHES", "1,2,4,8,16,32").split(",")]:
                case = OP.case(preset=preset, proj=proj, batch=batch, wdtype="fp8", residual=False, prologue="none")
                nb = OP.nbytes(case)
                sets = [OP.make_inputs(case, 100 + i, "cuda")
                        for i in range(timing.rotation_count(nb, timing.l2_bytes()) + 1)]
                for s in sets:
                    s["y_x"] = torch.empty_like(s["y0"])
                ref = None
                for arm, mod, out in (("production", pg, "y0"), ("xasm", px, "y_x")):
                    def fn(s, mod=mod, out=out):
                        mod.proj(s["x"], s["w"], [s[out]], w_scale=s["w_scale"])
                    fn(sets[0])
                    torch.cuda.synchronize()
                    if ref is None:
                        ref = sets[0]["y0"].clone()
                    same = bool(torch.equal(ref, sets[0][out]))
                    t = timing.bench_gpu(fn, input_sets=[(s,) for s in sets], reps=20, bytes_per_call=nb)
                    rows.append(dict(preset=preset, proj=proj, batch=batch, arm=arm, median_us=t.median_us,
                                     samples_us=t.samples_us, bit_equal=same,
                                     floor_us=nb / (pr["read_tbps"] * 1e12) * 1e6))
                    print(f"{preset:5s} {proj:10s} {batch:3d} {arm:10s} {t.median_us:8.2f} us  equal={same}",
                          flush=True)
                json.dump(dict(probes=pr, rows=rows, env=dict(torch=torch.__version__,
                                                              gpu=torch.cuda.get_device_name())),
                          open(f"{OUT}/proj_xasm.json", "w"), indent=1)
