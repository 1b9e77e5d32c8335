"""Compile the Triton projection kernel (`proj_gemv._proj_kernel`, the dot path) for sm_90a here (no GPU) and print
ptxas's registers / spills and each SASS loop's instructions an iteration and opcodes (kernels/cute/compile_offline.py's
loop_mix): what one K step of a tile costs a warp, bf16 against fp8 weights (the batch-64 fp8 rows run 5.7x the
instructions of bf16 in ncu: docs/NOTES_trunk.md, forty-seventh section). Usage:
    PYTHONPATH=<a pip --target of triton==3.6.0>:$PWD python experiments/proj_b64/sass_check.py [KEY=VALUE ...]
(constexpr overrides, e.g. BM=64 BN=32 FP8=True F16=True; num_warps=, num_stages=; XF16=True types x as f16;
DUMP=path writes the TTGIR)."""
from __future__ import annotations

import os
import subprocess
import sys
import tempfile

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))
from kernels.triton import proj_gemv as pg  # noqa: E402
from kernels.cute.compile_offline import loop_mix  # noqa: E402


def compile_proj(num_warps=4, num_stages=3, xf16=False, **over):
    fn = pg._proj_kernel
    consts = dict(NSEG=1, SPLIT=1, BM=64, BN=32, BK=128, FP8=True, RES=False, EVEN_K=True, DOT_F32=False, TMA=False,
                  PRO=0, TOPK=0, EP=1, KP=1, KXP=1, RR=1, PDL=False, F16=True, RCH=16, RED=False, PDL2=False)
    consts.update(over)
    sig = {}
    for i, name in enumerate(fn.arg_names):
        if fn.params[i].is_constexpr:
            sig[name] = "constexpr"
        elif name == "x":
            sig[name] = "*fp16" if xf16 else "*bf16"
        elif name == "w":
            sig[name] = "*fp8e4nv" if consts["FP8"] else "*bf16"
        elif name in ("scale", "ws", "rbias", "rwts", "rscale"):
            sig[name] = "*fp32"
        elif name in ("cnt", "ridx", "rcnt"):
            sig[name] = "*i32"
        elif name in ("res", "pw", "x2") or (name[0] == "o" and name[1:].isdigit()):
            sig[name] = "*bf16"
        elif name in ("b1", "b2", "eps"):
            sig[name] = "fp32"
        else:
            sig[name] = "i32"
    # pointers and the sizes / strides the JIT sees divisible by 16 at K3's shapes (without them no load vectorizes)
    div = {"M", "N", "K", "s_xm", "KSPLIT", "s0", "e0"}
    attrs = {(i,): [["tt.divisibility", 16]] for i, (n, v) in enumerate(sig.items()) if v.startswith("*") or n in div}
    ck = triton.compile(ASTSource(fn, sig, {k: v for k, v in consts.items()}, attrs),
                        target=GPUTarget("cuda", 90, 32), options=dict(num_warps=num_warps, num_stages=num_stages))
    nv = os.path.join(os.path.dirname(triton.backends.nvidia.__file__), "bin")
    with tempfile.TemporaryDirectory() as tmp:
        open(os.path.join(tmp, "k.ptx"), "w").write(ck.asm["ptx"].replace(".version 9.4", ".version 8.8"))
        r = subprocess.run([os.path.join(nv, "ptxas"), "-arch=sm_90a", "-v", os.path.join(tmp, "k.ptx"), "-o",
                            os.path.join(tmp, "k.cubin")], capture_output=True, text=True, check=True)
        sass = subprocess.run([os.path.join(nv, "cuobjdump"), "-sass", os.path.join(tmp, "k.cubin")],
                              capture_output=True, text=True).stdout
    return r.stderr, loop_mix(sass), ck.asm["ttgir"]


if __name__ == "__main__":
    over = {}
    for a in sys.argv[1:]:
        k, v = a.split("=")
        over[k] = int(v) if v.lstrip("-").isdigit() else {"True": True, "False": False}.get(v, v)
    nw, ns, xf16 = over.pop("num_warps", 4), over.pop("num_stages", 3), over.pop("XF16", False)
    info, loops, ttgir = compile_proj(nw, ns, xf16, **over)
    print(" ".join(line.strip() for line in info.splitlines() if "registers" in line or "spill" in line))
    for d in loops:
        print(f"  loop {d['start']:#x}-{d['end']:#x}: {d['instructions']} instructions; "
              + ", ".join(f"{k} {v}" for k, v in list(d["mix"].items())[:14]))
    if os.environ.get("DUMP"):
        open(os.environ["DUMP"], "w").write(ttgir)
