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
for the sequential pass, and the grouped summary / scan / out kernels); decode / verify: the grid
decode at each tile and the column-layout verify at each tile with its default row warps (best
effort: those generators change often; a failure prints and the script goes on). --quick: the
largest and smallest configuration of each prefill kernel only. Exit status 1 if any compile failed
or any kernel uses local memory.
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
        for tv in kd.TILES:
            cases.append((f"decode tile{tv}", lambda tv=tv: kd._kernel_class()(1, H, 1, False, False, 1e-6, -5.0, tv),
                          step_args))
        for tv in (128, 16):  # programmatic dependent launch
            cases.append((f"decode tile{tv} pdl",
                          lambda tv=tv: kd._kernel_class()(1, H, 1, False, False, 1e-6, -5.0, tv, pdl=True),
                          step_args))
        for kn in ({"fold": False}, {"early": False}, {"fold": False, "early": False}):  # the knobs off
            cases.append((f"decode tile128 {kn}",
                          lambda kn=kn: kd._kernel_class()(1, H, 1, False, False, 1e-6, -5.0, 128, **kn), step_args))
        cases.append(("decode tile32 fold",
                      lambda: kd._kernel_class()(1, H, 1, False, False, 1e-6, -5.0, 32, fold=True), step_args))
        cases.append(("decode tile128 rs",
                      lambda: kd._kernel_class()(1, H, 1, False, False, 1e-6, -5.0, 128, rs=True), step_args))
        for tv, kn in ((16, {"fast": True}), (128, {"fast": True}), (128, {"fast": True, "rs": True})):
            cases.append((f"decode tile{tv} {kn}",
                          lambda tv=tv, kn=kn: kd._kernel_class()(1, H, 1, False, False, 1e-6, -5.0, tv, **kn),
                          step_args))
        cases.append(("decode tile64 no fold",
                      lambda: kd._kernel_class()(1, H, 1, False, False, 1e-6, -5.0, 64, fold=False), step_args))
        for bare in ("regs", "pad2"):  # the state traffic alone (a measurement knob)
            cases.append((f"decode tile128 bare={bare}",
                          lambda b=bare: kd._kernel_class()(1, H, 1, False, False, 1e-6, -5.0, 128, bare=b),
                          step_args))
        from kernels.cute import kda_decode_persistent as kpd
        for ctas, stages in kpd.CONFIGS:
            cases.append((f"decode persistent ctas{ctas} stages{stages} B64",
                          lambda c=ctas, st=stages: kpd._persistent_class()(64, H, 1, False, False, 1e-6, -5.0, 128,
                                                                            sms=132, stages=st, ctas=c),
                          step_args))
    if only in (None, "verify"):
        from kernels.cute import kda_verify as kv
        for tv, wr in sorted(kv.ROW_WARPS.items(), reverse=True):
            for B in (1, 64):  # one CTA per SM (preload, delay) / two (register cap)
                cases.append((f"verify B{B} T4 tile{tv} row_warps{wr}",
                              lambda tv=tv, wr=wr, B=B: kv._columns_class()(B, H, 4, True, False, 1e-6, -5.0, tv,
                                                                            row_warps=wr),
                              step_args))
        # the measurement knobs forced (check_kda.py --exp): ragged T = 8 at tile 16, B = 1 and 5
        for B, knobs in [(1, {"preload": True, "delay": True}), (1, {"late_conv": True}),
                         (5, {"late_conv": True}), (1, {"scatter": False, "preload": False}),
                         (1, {"group_bar": False}), (5, {"group_bar": True, "late_conv": True}),
                         (1, {"pdl": True}), (5, {"pdl": True, "delay": True})]:
            name = " ".join(f"{k}={v}" for k, v in knobs.items())
            cases.append((f"verify B{B} T8 tile16 ragged {name}",
                          lambda B=B, kn=knobs: kv._columns_class()(B, H, 8, True, True, 1e-6, -5.0, 16, row_warps=4,
                                                                    **kn),
                          step_args))
        # chunk (the T positions as one chunk): B = 1 at tiles 16 / 32, T 2..8, and the large-batch tile 128
        for B, T, tv, rg, kn in [(1, 2, 16, False, {}), (1, 4, 16, False, {}), (1, 4, 16, True, {}),
                                 (1, 8, 16, False, {}), (1, 8, 16, False, {"preload": True}), (1, 4, 32, False, {}),
                                 (1, 4, 16, False, {"pdl": True}), (64, 4, 128, False, {}), (8, 4, 64, False, {}),
                                 (1, 4, 16, False, {"fast": True})]:
            name = " ".join(f"{k}={v}" for k, v in kn.items())
            cases.append((f"verify chunk B{B} T{T} tile{tv}{' ragged' if rg else ''} {name}",
                          lambda B=B, T=T, tv=tv, rg=rg, kn=kn: kv._columns_class()(
                              B, H, T, True, rg, 1e-6, -5.0, tv, row_warps=kv.ROW_WARPS[tv], chunk=True, **kn),
                          step_args))
        # fast (single-MUFU transcendentals) and bpro (the batched prologue)
        for B, T, tv, kn in ((1, 4, 16, {"fast": True}), (1, 8, 16, {"fast": True}), (64, 4, 128, {"fast": True}),
                             (1, 4, 16, {"bpro": True}), (1, 4, 16, {"bpro": True, "fast": True}),
                             (1, 8, 16, {"bpro": True, "fast": True}), (1, 2, 32, {"bpro": True, "fast": True}),
                             (64, 4, 128, {"bpro": True, "fast": True}), (8, 4, 64, {"bpro": True, "fast": True})):
            name = " ".join(f"{k}={v}" for k, v in kn.items())
            cases.append((f"verify B{B} T{T} tile{tv} {name}",
                          lambda B=B, T=T, tv=tv, kn=kn: kv._columns_class()(B, H, T, True, False, 1e-6, -5.0, tv,
                                                                             row_warps=kv.ROW_WARPS[tv], **kn),
                          step_args))
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
