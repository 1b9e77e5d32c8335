"""Compile the MLA split kernel for sm_90a here (no GPU) and print ptxas's registers / spills, and whether the
block loop was software-pipelined (async copies or TMA in the TTGIR); LOOPS=1 also prints each loop of the SASS
(instructions an iteration a warp and its opcodes: kernels/cute/compile_offline.py's loop_mix). Usage:
    [LOOPS=1] python experiments/mla_tune/ptxas_check.py [KEY=VALUE ...]   (constexpr overrides, e.g. BN=64 KS=4;
    num_warps=, num_stages=, kernel=)
With the device's Triton (3.6) rather than this machine's: PYTHONPATH=<a pip --target of triton==3.6.0>:$PWD."""
from __future__ import annotations

import os
import re
import subprocess
import sys
import tempfile

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))
from kernels.triton import mla_decode as md  # noqa: E402


def compile_split(kernel=None, num_warps=4, num_stages=2, **over):
    fn = kernel or md._mla_split_kernel
    sig, consts = {}, {}
    defaults = dict(C=512, DR=64, CP=512, DRP=64, W=576, HR=12, BM=16, BN=32, PAGED=True, PAGE=64, SCALE_MODE=0,
                    CONTIG_SHARDS=False, DOT_F32=False, PAGE_ROWS=True, NPG=64, HOST_CHUNK=True, PDL=False, WAIT=False,
                    KS=1, LAZY=False, FUSE=False, ME=16, MKB=1)
    # the integer arguments' values at batch 1 / 8K (page 64, 12 heads, T = 1, 132 pieces of 64): the JIT makes a 1
    # a constant and marks multiples of 16 divisible (the strides: 16-byte query loads); INTS=0 compiles them unknown
    ints = dict(s_qb=6144, s_qt=6144, s_qh=512, s_rb=768, s_rt=768, s_rh=64, s_kvb=0, s_sb=0, s_btb=129, T=1, H=12,
                P=132, NS=1, G=1, CHUNK=64, MAXPG=129, NM=1)
    ints.update({k: over.pop(k) for k in list(over) if k in ints})
    spec = os.environ.get("INTS", "1") != "0"
    defaults.update(over)
    div16 = []
    for name in fn.arg_names:
        p = fn.params[fn.arg_names.index(name)]
        if spec and name in ints and ints[name] == 1:
            consts[name] = 1
            sig[name] = "constexpr"
        elif p.is_constexpr:
            consts[name] = defaults[name]
            sig[name] = "constexpr"
        elif name in ("q_lat", "q_rope", "kv"):
            sig[name] = "*bf16"
        elif name in ("kv_scale", "o_part", "lse_part", "o_lat", "lse_out", "o_out", "ws"):
            sig[name] = "*fp32"
        elif name in ("block_table", "lengths", "ticket", "tickets"):
            sig[name] = "*i32"
        elif name in ("qk_scale",):
            sig[name] = "fp32"
        elif name.startswith("desc"):
            raise SystemExit("descriptor args: compile on the GPU")
        else:
            sig[name] = "i32"
            if spec and name in ints and ints[name] % 16 == 0:
                div16.append(name)
    # pointers 16-byte aligned, as the JIT specializes them (without it no load is vectorized or pipelined)
    attrs = {(i,): [["tt.divisibility", 16]] for i, (k, v) in enumerate(sig.items()) if v.startswith("*") or k in div16}
    src = ASTSource(fn, sig, consts, attrs)
    ck = triton.compile(src, target=GPUTarget("cuda", 90, 32), options=dict(num_warps=num_warps,
                                                                            num_stages=num_stages))
    ptx = ck.asm["ptx"].replace(".version 9.4", ".version 8.8")
    ttgir = ck.asm["ttgir"]
    ptxas = os.path.join(os.path.dirname(triton.backends.nvidia.__file__), "bin", "ptxas")
    with tempfile.NamedTemporaryFile("w", suffix=".ptx", delete=False) as f:
        f.write(ptx)
    r = subprocess.run([ptxas, "-arch=sm_90a", "-v", f.name, "-o", "/dev/null"], capture_output=True, text=True)
    info = r.stderr
    regs = re.findall(r"Used (\d+) registers", info)
    spill = re.findall(r"(\d+) bytes spill stores", info)
    asyncs = len(re.findall(r"async_copy_global_to_local|async_tma_copy|ttng.async_tma", ttgir))
    return dict(regs=regs, spill_stores=spill, async_ops=asyncs, smem=ck.metadata.shared), ttgir, ptx


if __name__ == "__main__":
    over = {}
    for a in sys.argv[1:]:
        k, v = a.split("=")
        over[k] = int(v) if v.lstrip("-").isdigit() else {"True": True, "False": False}.get(v, v)
    nw = over.pop("num_warps", 4)
    ns = over.pop("num_stages", 2)
    kern = getattr(md, over.pop("kernel", "_mla_split_kernel"))
    res, ttgir, ptx = compile_split(kern, nw, ns, **over)
    print(res)
    if os.environ.get("LOOPS"):
        from k3lab_kernels.cute.compile_offline import loop_mix
        nv = os.path.join(os.path.dirname(triton.backends.nvidia.__file__), "bin")
        with tempfile.TemporaryDirectory() as tmp:
            open(os.path.join(tmp, "k.ptx"), "w").write(ptx)
            subprocess.run([os.path.join(nv, "ptxas"), "-arch=sm_90a", os.path.join(tmp, "k.ptx"), "-o",
                            os.path.join(tmp, "k.cubin")], check=True)
            sass = subprocess.run([os.path.join(nv, "cuobjdump"), "-sass", os.path.join(tmp, "k.cubin")],
                                  capture_output=True, text=True).stdout
        addrs = [int(a, 16) for a in re.findall(r"/\*([0-9a-f]{4,})\*/\s+[@A-Z]", sass)]
        loops = loop_mix(sass)
        end = max((d["end"] for d in loops), default=0)
        print(f"  SASS: {len(addrs)} instructions, {sum(a > end for a in addrs)} after the last loop")
        if os.environ.get("MIX"):  # the opcodes before the first loop and after the last one
            start = min((d["start"] for d in loops), default=0)
            ops = re.findall(r"/\*([0-9a-f]{4,})\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_.]*)", sass)
            for name, keep in (("before", lambda a: a < start), ("after", lambda a: a > end)):
                mix: dict[str, int] = {}
                for a, o in ops:
                    if keep(int(a, 16)):
                        mix[o] = mix.get(o, 0) + 1
                print(f"  {name}: " + ", ".join(f"{k} {v}" for k, v in sorted(mix.items(), key=lambda kv: -kv[1])))
        for d in loops:
            print(f"  loop {d['start']:#x}-{d['end']:#x}: {d['instructions']} instructions; "
                  + ", ".join(f"{k} {v}" for k, v in list(d["mix"].items())[:10]))
    if os.environ.get("DUMP"):
        open(os.environ["DUMP"], "w").write(ttgir)
