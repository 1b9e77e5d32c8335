"""Compile the CuTe DSL KDA kernel classes for sm_90a without a GPU and print each one's registers,
stack and local memory (spills), read off the cubin with cuobjdump.

    PYTHONPATH=<CuTe DSL site>:<CuTe DSL site>/nvidia_cutlass_dsl/dsl_packages \\
        python kernels/cute/compile_offline.py [--only prefill|decode|verify] [--quick] [--keep DIR]

The Python needs nvidia-cutlass-dsl, cuda-bindings, numpy and torch (a CPU build is enough): e.g. a
Python 3.12 venv with `pip install typing_extensions numpy cuda-bindings torch` and the CuTe DSL
unpacked from .gpu/cute/cute.tar.xz (`tar -xJf .gpu/cute/cute.tar.xz -C <site>`). The kernel classes
are compiled directly on fake device pointers (no torch wrapper, no device): what this proves is that
every kernel builds for the chip and how many registers it takes, not that it is right.

--only prefill: every switch value of kda_prefill.py (chunk x inverse, chunk x tile_v x state dtype
for the sequential pass, and the grouped summary / scan / out kernels); decode: every tile on a resident
grid and a larger one, and pdl; verify: every tile with its default row warps at three batch sizes (the
shape's choices differ), every row_warps, T 2 and 8, ragged and pdl (a failure prints and the script
goes on). --quick: the largest and smallest configuration of each prefill kernel only. --keep DIR: each
configuration's cubin as DIR/<name>.cubin (to diff SASS across commits). Exit status 1 if any compile
failed or any kernel uses local memory.
"""
import glob
import os
import shutil
import subprocess
import sys
import tempfile
import time

# the DSL reads these when it is first imported
os.environ.setdefault("CUTE_DSL_ARCH", "sm_90a")
os.environ["CUTE_DSL_KEEP"] = "cubin"
_DUMP = tempfile.mkdtemp(prefix="k3lab_cute_")
os.environ["CUTE_DSL_DUMP_DIR"] = _DUMP

_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
if _ROOT not in sys.path:
    sys.path.insert(0, _ROOT)


def _cuobjdump() -> str | None:
    found = shutil.which("cuobjdump")
    if found:
        return found
    for base in (os.environ.get("CUDA_HOME", ""), "/usr/local/cuda"):
        p = os.path.join(base, "bin", "cuobjdump")
        if base and os.path.exists(p):
            return p
    try:
        import triton
        p = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
        return p if os.path.exists(p) else None
    except ImportError:
        return None


def _usage(cubin: str, tool: str | None) -> str:
    if tool is None:
        return "(no cuobjdump found)"
    out = subprocess.run([tool, "--dump-resource-usage", cubin], capture_output=True, text=True).stdout
    for line in out.splitlines():
        if "REG:" in line:
            keep = [w for w in line.split() if w.split(":")[0] in ("REG", "STACK", "SHARED", "LOCAL")]
            return " ".join(keep)
    return "(no resource line)"


def _cases(only: str | None, quick: bool):
    """(name, build, args) for every kernel to compile. Imports the DSL."""
    import cuda.bindings.driver as cuda
    import cutlass
    from cutlass import cute
    from cutlass.cute.runtime import make_ptr

    def P(dt, align=16):
        return make_ptr(dt, 1 << 20, cute.AddressSpace.gmem, assumed_align=align)

    bf, f32, i32 = cutlass.BFloat16, cutlass.Float32, cutlass.Int32
    S = cuda.CUstream(0)
    B, H, L = 1, 12, 4096
    cases = []
    if only in (None, "prefill"):
        from kernels.cute import kda_prefill as kp
        C = kp._classes()
        chunks, tiles = kp.PREFILL_CHUNKS, kp.PREFILL_TILES
        if quick:
            chunks, tiles = (16, 64), (16, 128)
        dims = [B, H, L, S]
        for ch in chunks:
            cases.append((f"prefill prep ch{ch}", lambda ch=ch: C.Prep(ch, -5.0),
                          [P(bf, 2), P(bf, 2), P(bf, 2), P(bf, 2), P(f32, 4), P(f32, 4), P(bf, 2), P(f32), P(f32),
                           P(f32), P(f32), P(f32, 4)] + dims))
            for inv in kp.PREFILL_INVERSES:
                cases.append((f"prefill intra ch{ch} inverse={inv}", lambda ch=ch, inv=inv: C.Intra(ch, inv == "bf16"),
                              [P(f32)] * 4 + [P(f32, 4)] + [P(f32)] * 3 + dims))
            for tv in tiles:
                for sname, sp in (("fp32", P(f32, 4)), ("bf16", P(bf, 2))):
                    cases.append((f"prefill chunks ch{ch} tile{tv} state={sname}",
                                  lambda ch=ch, tv=tv: C.Chunks(ch, tv, False), [P(f32)] * 7 + [sp] + dims))
                cases.append((f"prefill chunks-out ch{ch} tile{tv}", lambda ch=ch, tv=tv: C.Chunks(ch, tv, True),
                              [P(f32)] * 8 + dims))
                cases.append((f"prefill summary ch{ch} tile{tv}", lambda ch=ch, tv=tv: C.Summary(ch, tv),
                              [P(f32)] * 6 + dims))
        for tv in tiles:
            for sname, sp in (("fp32", P(f32, 4)), ("bf16", P(bf, 2))):
                cases.append((f"prefill scan tile{tv} state={sname}", lambda tv=tv: C.Scan(tv),
                              [P(f32)] * 3 + [sp, B, H, L // 64, S]))
        cases.append(("prefill norm+conv tail", lambda: C.Norm(1e-6),
                      [P(f32), P(bf, 8), P(bf, 2), P(bf, 8), P(bf, 2), P(bf, 2)] + dims))
    # decode / verify: the pointer order of kda_decode._kernel_args
    step_args = [P(bf, 2), P(bf, 2), P(bf, 2), P(bf, 8), P(bf, 8), P(f32, 4), P(f32, 4), P(bf, 8), P(f32),
                 P(bf, 2), P(bf, 8), P(f32), P(bf, 2), P(i32, 4), S]
    if only in (None, "decode"):
        from kernels.cute import kda_decode as kd
        for B in (1, 64):  # a resident grid (fast) / a larger one
            for tv in kd.TILES:
                cases.append((f"decode B{B} tile{tv}",
                              lambda B=B, tv=tv: kd._kernel_class()(B, H, 1e-6, -5.0, tv), step_args))
        for B, tv in ((1, 16), (64, 128)):  # programmatic dependent launch
            cases.append((f"decode B{B} tile{tv} pdl",
                          lambda B=B, tv=tv: kd._kernel_class()(B, H, 1e-6, -5.0, tv, pdl=True), step_args))
    if only in (None, "verify"):
        from kernels.cute import kda_verify as kv
        # B = 1: one CTA per SM (preload, delay) and the batched prologue; B = 16: the batched prologue under
        # the register cap; B = 64: neither
        for B in (1, 16, 64):
            for tv, wr in sorted(kv.ROW_WARPS.items(), reverse=True):
                cases.append((f"verify B{B} T4 tile{tv} row_warps{wr}",
                              lambda tv=tv, wr=wr, B=B: kv._kernel_class()(B, H, 4, False, 1e-6, -5.0, tv, wr),
                              step_args))
        # every other row_warps (tile 32), T 2 and 8, ragged, pdl
        for B, T, tv, wr, rg, pdl in [(1, 4, 32, 1, False, False), (1, 4, 32, 2, False, False),
                                      (1, 4, 32, 8, False, False), (1, 2, 16, 4, False, False),
                                      (1, 8, 16, 4, True, False), (5, 8, 16, 4, True, False),
                                      (1, 8, 16, 4, True, True), (5, 8, 16, 4, True, True),
                                      (64, 4, 128, 4, False, True)]:
            name = f"verify B{B} T{T} tile{tv} row_warps{wr}" + (" ragged" if rg else "") + (" pdl" if pdl else "")
            cases.append((name, lambda B=B, T=T, tv=tv, wr=wr, rg=rg, pdl=pdl: kv._kernel_class()(
                B, H, T, rg, 1e-6, -5.0, tv, wr, pdl), step_args))
    return cases


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    only = None
    for i, a in enumerate(argv):
        if a == "--only" and i + 1 < len(argv):
            only = argv[i + 1]
        elif a.startswith("--only="):
            only = a.split("=", 1)[1]
    if only not in (None, "prefill", "decode", "verify"):
        print(f"--only must be prefill, decode or verify (got {only!r})")
        return 2
    quick = "--quick" in argv
    keep = None  # --keep DIR: copy each configuration's cubin to DIR/<name>.cubin (to diff SASS across commits)
    for i, a in enumerate(argv):
        if a == "--keep" and i + 1 < len(argv):
            keep = argv[i + 1]
        elif a.startswith("--keep="):
            keep = a.split("=", 1)[1]
    if keep:
        os.makedirs(keep, exist_ok=True)
    # min_blocks_per_mp > 1 asks the device for its shared memory per SM: answer for an H100/H200
    import cutlass.cutlass_dsl.cutlass as _cd
    _cd.cuda_helpers.get_device_attribute = lambda *a, **k: 233472
    from cutlass import cute

    tool = _cuobjdump()
    bad = 0
    t0 = time.time()
    print(f"arch {os.environ['CUTE_DSL_ARCH']}; cubins in {_DUMP}")
    for name, build, args in _cases(only, quick):
        for f in glob.glob(os.path.join(_DUMP, "*.cubin")):  # file names repeat across configurations
            os.remove(f)
        try:
            cute.compile(build(), *args)
        except Exception as e:  # noqa: BLE001  (report and go on)
            bad += 1
            print(f"{name:<44} FAILED: {type(e).__name__}: {str(e).strip().splitlines()[-1][:200]}", flush=True)
            continue
        new = glob.glob(os.path.join(_DUMP, "*.cubin"))
        if keep and len(new) == 1:
            shutil.copyfile(new[0], os.path.join(keep, name.replace(" ", "_").replace("=", "") + ".cubin"))
        use = _usage(new[0], tool) if len(new) == 1 else f"({len(new)} cubins written)"
        if "LOCAL:" in use and "LOCAL:0" not in use:
            bad += 1
            use += "   <- local memory (spills)"
        print(f"{name:<44} {use}", flush=True)
    print(f"{'ALL COMPILED, NO LOCAL MEMORY' if not bad else f'{bad} PROBLEM(S)'}  [{time.time() - t0:.0f}s]")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
