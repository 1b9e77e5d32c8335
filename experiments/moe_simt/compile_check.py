"""Compile the MXFP4 simt experts kernel for sm_90a without a GPU and report what the step loop costs: layout
conversions (TTGIR), shared-memory stores and barriers (PTX), registers and spills (ptxas -v). Use the device's
Triton to see what the device compiles (H200 image: Triton 3.6):

    pip download --no-deps triton==3.6.0 -d /tmp/t36whl && python -m zipfile -e /tmp/t36whl/triton-3.6.0-*.whl /tmp/t36
    chmod +x /tmp/t36/triton/backends/nvidia/bin/*
    PYTHONPATH=/tmp/t36 python experiments/moe_simt/compile_check.py

Prints one line per (tokens a pass, register cap, batch-1 groups of one, leaders) at K3's TP8 tiles (the 2D word
loads are the only path since the twelfth session; `compile_check_t36.txt` is the eleventh's output, both loads)."""
import os
import re
import subprocess
import sys
import tempfile

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))
import k3lab  # noqa: E402,F401  (registers k3lab_kernels)
import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

from k3lab_kernels.triton import moe_experts as M  # noqa: E402

SIG = {"z": "*i32", "idx": "*i64", "wk": "*fp32", "w1": "*i32", "w3": "*i32", "w2": "*i32",
       "s1": "*u8", "s3": "*u8", "s2": "*u8", "y": "*fp32", "act": "*fp16", "acti": "*i32", "ws": "*i32",
       "lead": "*i32", "B": "i32", "NA": "i32", "NITEMS": "i32", "NPROG": "i32"}
PTXAS = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "ptxas")


def build(const: dict, opts: dict, ptxas_args: tuple = ("-v",)):
    """The simt kernel compiled for sm_90a with `const` / `opts`: (compiled kernel, its PTX, ptxas's stderr, the
    cubin's bytes), through the bundled ptxas (shared with sass_loop.py). (The zpre and tma variants this
    compiled in the fifteenth and sixteenth sessions are in git history at 4426287.)"""
    k = triton.compile(ASTSource(fn=M._moe_simt_kernel, signature=dict(SIG, **{c: "constexpr" for c in const}),
                                 constexprs=const), target=GPUTarget("cuda", 90, 32), options=opts)
    ptx = re.sub(r"^\.version .*$", ".version 8.7", k.asm["ptx"], flags=re.M)  # the bundled ptxas reads 8.7
    with tempfile.TemporaryDirectory() as d:
        src, cub = os.path.join(d, "k.ptx"), os.path.join(d, "k.cubin")
        open(src, "w").write(ptx)
        err = subprocess.run([PTXAS, "-arch=sm_90a", *ptxas_args, src, "-o", cub], capture_output=True,
                             text=True).stderr
        return k, ptx, err, open(cub, "rb").read()


def compile_one(tb: int, maxnreg: int | None, one: bool, lead: bool = False, nw: int = 4) -> str:
    const = dict(L=3584, I=384, K=16, KP=16, BB=16, BN=16, NB=16, BL=128, NB2=4, TB=tb, B1=4.0, B2=25.0,
                 INTERP=False, NW=nw, ONE=one, LEAD=lead, PDL=False,
                 PER_EXPERT=os.environ.get("PER_EXPERT", "0") == "1")
    opts = {"num_warps": nw, "num_stages": 1, **({"maxnreg": maxnreg} if maxnreg else {})}
    k, ptx, out, _ = build(const, opts)
    regs = re.search(r"Used (\d+) registers", out)
    spill = re.search(r"(\d+) bytes spill stores", out)
    return (f"warps {nw}  tokens/pass {tb}  cap {str(maxnreg):4s}  groups-of-one {str(one):5s}  "
            f"leaders {str(lead):5s}  "
            f"convert_layout {k.asm['ttgir'].count('convert_layout'):3d}  st.shared {ptx.count('st.shared'):3d}  "
            f"bar.sync {ptx.count('bar.sync'):3d}  registers {regs.group(1) if regs else '?':>4s}  "
            f"spill stores {spill.group(1) if spill else '?'} B  "
            f"pack4 layouts {'ok' if not M.pack4_layout_problems(k.asm['ttgir']) else 'WRONG'}")


if __name__ == "__main__":
    print(f"triton {triton.__version__}")
    for tb, cap, one in ((1, None, True), (1, None, False), (2, None, False), (2, 128, False)):
        print(compile_one(tb, cap, one), flush=True)
    print(compile_one(2, 128, False, True), flush=True)
    print(compile_one(1, None, True, nw=8), flush=True)  # batch 1's default since the twelfth session
    print(compile_one(1, None, True, nw=2), flush=True)  # refused: the layout the H200 summed wrong
    lsig = {"idx": "*i64", "first": "*i32", "lead": "*i32", "P": "i32", "PB": "constexpr", "BIG": "constexpr"}
    lk = triton.compile(ASTSource(fn=M._simt_leaders_kernel, signature=lsig, constexprs=dict(PB=1024, BIG=M.LEAD_BIG)),
                        target=GPUTarget("cuda", 90, 32), options={"num_warps": 4})
    print(f"_simt_leaders_kernel (1024 pairs): compiled, {len(lk.asm['ptx'].splitlines())} PTX lines")
