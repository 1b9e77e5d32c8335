"""Compile every registered Triton kernel for a GPU target on a machine without a GPU.

The interpreter (TRITON_INTERPRET=1) runs a kernel's Python: it checks the logic, not what the compiler accepts
(a name bound to two shapes in two branches, a layout the PTX assumes) and not the inline PTX. This module runs
each registered op's real host wrapper on CPU tensors with `JITFunction.run` replaced by a compile: the kernel is
compiled for `arch` (sm_90 by default: the H200) from the arguments the wrapper passes, and nothing is launched
(outputs stay as they were). What the wrapper does after the launch still runs on the compiled kernel (the MoE
simt path's pack=4 layout guard reads its TTGIR).

    python -m k3lab.harness.triton_compile [--options] [--full] [--grid NAME=v1,v2 ...] [--resources]
                                           [--arch 90] [--pdl] [OP ...]

checks each op's first case with its default options; `--options` adds each option value alone on that case,
`--full` every case of the op's grid (`--grid` replaces axes of it, e.g. K3's sizes); `--resources` prints each
compiled kernel's registers, stack, shared and local (spilled) bytes a thread, read off its cubin with
cuobjdump. An op's own argument error (a knob refused for that case) counts as refused, not failed; an error
inside Triton's compiler, or a guard's refusal of a compiled kernel, fails (exit 1). Use the device's Triton to
see exactly what it compiles (the H200 image has Triton 3.6: PYTHONPATH=/path/to/triton-3.6).
Run in a process of its own: it patches Triton and k3lab's backend check for the process.
"""
from __future__ import annotations

import argparse
import contextlib
import os
import sys
import time
from dataclasses import dataclass, field
from typing import Any

_TYPES = {"float32": "fp32", "bfloat16": "bf16", "float16": "fp16", "float64": "fp64", "int64": "i64",
          "int32": "i32", "int16": "i16", "int8": "i8", "uint8": "u8", "bool": "i1", "float8_e4m3fn": "fp8e4nv",
          "float8_e5m2": "fp8e5"}
_OPTIONS = ("num_warps", "num_stages", "maxnreg", "num_ctas", "launch_pdl", "enable_fp_fusion")


@dataclass
class Result:
    op: str
    case: str
    options: dict
    status: str  # "ok", "refused" (the op's own argument check), "failed"
    kernels: list = field(default_factory=list)  # (kernel name, compile seconds, compiled kernel)
    error: str = ""


def _signature(fn, args, kwargs) -> tuple[dict, dict, dict, dict]:
    """(signature, constexprs, options, attrs) of one call of the JIT function `fn`, specialized as Triton's launcher
    specializes it (the compiled code depends on it): an int equal to 1 becomes a constexpr, and ints divisible by 16
    and tensors whose data pointer is 16-byte aligned carry tt.divisibility 16 (without it pointer loads compile
    unvectorized and unpipelined, and registers read off such a kernel are not the GPU's), unless the kernel's
    do_not_specialize lists say otherwise."""
    opts = {k: kwargs.pop(k) for k in list(kwargs) if k in _OPTIONS}
    bound = fn.signature.bind(*args, **kwargs)
    bound.apply_defaults()
    sig, const, attrs = {}, {}, {}
    div16 = [["tt.divisibility", 16]]
    for i, (p, (name, v)) in enumerate(zip(fn.params, bound.arguments.items())):
        spec, align = not p.do_not_specialize, not p.do_not_specialize_on_alignment
        if p.is_constexpr or v is None:
            sig[name], const[name] = "constexpr", v
        elif hasattr(v, "dtype") and hasattr(v, "data_ptr"):
            sig[name] = "*" + _TYPES[str(v.dtype).replace("torch.", "")]
            if align and v.data_ptr() % 16 == 0:
                attrs[(i,)] = div16
        elif hasattr(v, "base") and hasattr(v, "block_shape"):  # a host TensorDescriptor (the TMA paths)
            dt = _TYPES[str(v.base.dtype).replace("torch.", "")]
            sig[name] = f"tensordesc<{dt}[{', '.join(str(int(d)) for d in v.block_shape)}]>"
        elif isinstance(v, bool):
            sig[name] = "i1"
        elif isinstance(v, int):
            if spec and v == 1:
                sig[name], const[name] = "constexpr", 1
                continue
            sig[name] = "i32" if -2 ** 31 <= v < 2 ** 31 else "i64"
            if spec and align and v % 16 == 0:
                attrs[(i,)] = div16
        elif isinstance(v, float):
            sig[name] = "fp32"
        else:
            raise TypeError(f"{fn.__name__}: argument {name!r} of type {type(v).__name__} has no Triton type here")
    return sig, const, opts, attrs


def resources(kernel) -> dict[str, int]:
    """REG, STACK, SHARED, LOCAL of a compiled kernel (cuobjdump -res-usage on its cubin; {} without the tool)."""
    import re
    import subprocess
    import tempfile

    import triton

    tool = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
    cubin = kernel.asm.get("cubin")
    if not cubin or not os.path.exists(tool):
        return {}
    with tempfile.TemporaryDirectory() as d:
        path = os.path.join(d, "k.cubin")
        with open(path, "wb") as f:
            f.write(cubin)
        out = subprocess.run([tool, "-res-usage", path], capture_output=True, text=True).stdout
    m = re.search(r"REG:(\d+) STACK:(\d+) SHARED:(\d+) LOCAL:(\d+)", out)
    return dict(zip(("reg", "stack", "shared", "local"), map(int, m.groups()))) if m else {}


@contextlib.contextmanager
def compile_only(arch: int = 90, log: list | None = None):
    """Within: every JIT kernel launch compiles for sm_`arch` instead (appending (name, seconds, compiled kernel)
    to `log`) and returns the compiled kernel; k3lab's dispatcher takes the triton backend as available."""
    os.environ.pop("TRITON_INTERPRET", None)
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    from triton.runtime.jit import JITFunction

    from k3lab import switches
    from k3lab.components import dispatch

    target = GPUTarget("cuda", arch, 32)
    cache: dict[tuple, Any] = {}

    def run(self, *args, grid, warmup, **kwargs):
        sig, const, opts, attrs = _signature(self, args, dict(kwargs))
        key = (self.__name__, self.module, tuple(sorted(sig.items())), repr(sorted(const.items(), key=str)),
               tuple(sorted(opts.items())), repr(sorted(attrs)))
        if key not in cache:
            t = time.perf_counter()
            cache[key] = triton.compile(ASTSource(fn=self, signature=sig, constexprs=const, attrs=attrs), target=target,
                                        options=opts)
            if log is not None:
                log.append((self.__name__, round(time.perf_counter() - t, 2), cache[key]))
        return cache[key]

    saved = (JITFunction.run, switches.backend_status, dispatch.require_backend)
    orig_status, orig_require = switches.backend_status, switches.require_backend
    JITFunction.run = run
    switches.backend_status = lambda b: (True, "compile check") if b == "triton" else orig_status(b)
    dispatch.require_backend = lambda b: None if b == "triton" else orig_require(b)
    try:
        yield
    finally:
        JITFunction.run, switches.backend_status, dispatch.require_backend = saved


def _points(op, options: bool, full: bool, grid: dict | None = None) -> list[tuple[Any, dict]]:
    """(case, options) pairs: the first case with the defaults, each option value alone on it (options), every
    case of the grid (full); `grid` replaces axes of the op's grid (axes it does not have are ignored)."""
    g = {k: v for k, v in (grid or {}).items() if k in op.axes}
    every = op.cases(g)
    cases = every if full else every[:1]
    out = [(c, {}) for c in cases]
    for opt, per_be in (op.option_axes.items() if options else ()):
        for v in per_be.get("triton", ()):
            if v is not None and cases:
                out.append((cases[0], {opt: v}))
    return out


def check(names: list[str] | None = None, *, options: bool = False, full: bool = False, arch: int = 90,
          grid: dict | None = None, show_resources: bool = False, say=print) -> list[Result]:
    """Compile the Triton kernels of the named ops (None: every registered op with a triton backend)."""
    from triton.compiler.errors import CompilationError

    from k3lab import registry

    registry._load()
    all_ops = sorted({o.name for c in registry.components() for o in registry.ops_of(c) if "triton" in o.backends})
    unknown = sorted(set(names or ()) - set(all_ops))
    if unknown:
        raise SystemExit(f"triton_compile: unknown ops {unknown}; ops with a triton backend: {all_ops}")
    if grid:  # a name no op has, or values that leave an op no case, would compile nothing and pass: refuse them
        from k3lab.bench.runner import grid_cases

        ops = [registry.get(n) for n in names or all_ops]
        if bad := sorted(set(grid) - {k for o in ops for k in o.axes}):
            raise SystemExit(f"triton_compile: grid names {bad} are no axis of {[o.name for o in ops]}")
        try:
            for o in ops:
                if any(k in o.axes for k in grid):
                    grid_cases("triton_compile", [o], {k: tuple(v) for k, v in grid.items() if k in o.axes},
                               ("triton",))
        except registry.RegistryError as e:
            raise SystemExit(str(e)) from None
    results = []
    log: list = []
    with compile_only(arch, log):
        for name in names or all_ops:
            op = registry.get(name)
            t0, mine = time.perf_counter(), []
            for case, opts in _points(op, options, full, grid):
                n0 = len(log)
                res = Result(op=name, case=case.key(), options=opts, status="ok")
                try:
                    inp = op.make_inputs(case, 0, "cpu")
                    op.call(inp, case, "triton", dict(opts))
                except CompilationError as e:
                    res.status, res.error = "failed", f"CompilationError: {str(e).strip().splitlines()[-1][:300]}"
                except ValueError as e:  # the op's own argument errors are ValueErrors: not an option for this case
                    res.status, res.error = "refused", f"{type(e).__name__}: {str(e)[:200]}"
                except Exception as e:  # noqa: BLE001  Triton's backend (ptxas, passes), a guard, a wrapper bug
                    res.status, res.error = "failed", f"{type(e).__name__}: {str(e)[:300]}"
                res.kernels = log[n0:]
                results.append(res)
                mine.append(res)
                for kname, _, ck in res.kernels if show_resources else ():
                    r_ = resources(ck)
                    say(f"    {kname:28s} {opts or ''} {case.key()[len(name) + 1:-1][:70]}: "
                        + (" ".join(f"{k} {v}" for k, v in r_.items()) or "no cuobjdump"))
            n = {s: sum(r.status == s for r in mine) for s in ("ok", "refused", "failed")}
            say(f"{name:18s} {n['ok']:3d} ok {n['refused']:3d} refused {n['failed']:3d} failed "
                f"{time.perf_counter() - t0:6.1f} s  {sorted({k[0] for r in mine for k in r.kernels})}")
    return results


def _value(v: str) -> Any:
    """A grid value: int, float, bool or the string."""
    for cast in (int, float):
        try:
            return cast(v)
        except ValueError:
            pass
    return {"true": True, "false": False}.get(v.lower(), v)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m k3lab.harness.triton_compile", description=__doc__.split("\n")[0])
    ap.add_argument("ops", nargs="*", help="op names (default: every op with a triton backend)")
    ap.add_argument("--options", action="store_true", help="each option value alone on the first case")
    ap.add_argument("--full", action="store_true", help="every case of each op's grid, not only its first")
    ap.add_argument("--grid", action="append", default=[], metavar="NAME=v1,v2",
                    help="replace an axis of the ops' grids (repeatable), e.g. latent=3584")
    ap.add_argument("--resources", action="store_true", help="registers, stack, shared, local bytes per kernel")
    ap.add_argument("--arch", type=int, default=90, help="compute capability, e.g. 90 (H200), 100")
    ap.add_argument("--pdl", action="store_true", help="inside a pdl_chain: the kernels as the step's `pdl` switch "
                                                       "launches them (griddepcontrol wait / launch_dependents)")
    a = ap.parse_args(argv)
    if a.pdl:
        from k3lab_kernels.triton.pdl import pdl_chain

        with pdl_chain(True):
            return _main(a, ap)
    return _main(a, ap)


def _main(a, ap) -> int:
    import triton

    t = time.perf_counter()
    grid = {}
    for g in a.grid:
        name, _, vals = g.partition("=")
        if not name or not vals:
            ap.error(f"--grid takes NAME=v1,v2, got {g!r}")
        grid[name] = [_value(v) for v in vals.split(",")]
    res = check(a.ops or None, options=a.options, full=a.full, arch=a.arch, grid=grid, show_resources=a.resources)
    bad = [r for r in res if r.status == "failed"]
    n = {s: sum(r.status == s for r in res) for s in ("ok", "refused", "failed")}
    print(f"triton {triton.__version__}, sm_{a.arch}: {n['ok']} compiled, {n['refused']} refused by the op's own "
          f"checks, {n['failed']} failed; {len({k[0] for r in res for k in r.kernels})} kernels in "
          f"{time.perf_counter() - t:.0f} s")
    for r in bad:
        print(f"FAILED {r.op} {r.options} {r.case}: {r.error}")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
