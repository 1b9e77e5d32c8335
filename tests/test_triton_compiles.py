"""Every registered Triton kernel compiles for sm_90 (the H200) on this machine, no GPU needed
(k3lab.harness.triton_compile): the interpreter tests check the kernels' logic; this checks what the compiler
accepts and what the launchers' guards read from the compiled kernels (the MoE simt path's pack=4 layouts). Runs
in a process of its own (no TRITON_INTERPRET; the module patches Triton's launcher for its process)."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest

from k3lab import registry


def _run(*args: str) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    return subprocess.run([sys.executable, "-m", "k3lab.harness.triton_compile", *args], capture_output=True,
                          text=True, env=env, timeout=900)


def _check_compiled(r: subprocess.CompletedProcess) -> None:
    if r.returncode and "ptxas" in r.stdout + r.stderr and "FAILED" not in r.stdout:
        pytest.skip(f"no ptxas in this Triton build: {(r.stdout + r.stderr)[-300:]}")
    assert r.returncode == 0, (r.stdout + r.stderr)[-4000:]
    assert " 0 failed;" in r.stdout.splitlines()[-1]


def test_every_triton_kernel_compiles_for_hopper():
    """Every case of every op's grid but kda_prefill's (the next test)."""
    pytest.importorskip("triton")
    registry._load()
    ops = sorted({o.name for c in registry.components() for o in registry.ops_of(c) if "triton" in o.backends})
    assert "kda_prefill" in ops and "norm_glu" in ops and "moe_experts" in ops
    _check_compiled(_run("--full", *[o for o in ops if o != "kda_prefill"]))


def test_kda_prefill_compiles_for_hopper():
    """kda_prefill's first case (its five kernels: ~35 s on two cores; the whole grid compiles for minutes)."""
    pytest.importorskip("triton")
    _check_compiled(_run("kda_prefill"))


def test_a_compile_error_fails_the_check(tmp_path):
    """A kernel the interpreter runs but the compiler refuses (a name bound to two shapes in two branches, the
    twelfth session's norm_glu bug) fails the check, with the kernel named."""
    pytest.importorskip("triton")
    mod = tmp_path / "badkern.py"
    mod.write_text('''
import torch
import triton
import triton.language as tl


@triton.jit
def _two_shapes(x, B: tl.constexpr):
    if tl.program_id(0) == 0:
        g = tl.load(x + tl.arange(0, 2 * B))
    else:
        g = tl.load(x + tl.arange(0, B))
    tl.store(x + tl.arange(0, 2 * B), tl.sum(g, axis=0) + tl.zeros([2 * B], tl.float32))


def run():
    from k3lab.harness.triton_compile import compile_only

    with compile_only():
        _two_shapes[(2,)](torch.zeros(64), B=16)
''')
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = f"{tmp_path}{os.pathsep}{env.get('PYTHONPATH', '')}"
    r = subprocess.run([sys.executable, "-c", "import badkern; badkern.run()"], capture_output=True, text=True,
                       env=env, timeout=300)
    assert r.returncode != 0 and "CompilationError" in r.stderr and "Mismatched type" in r.stderr, r.stderr[-2000:]


def test_compile_check_refuses_a_grid_that_compiles_nothing():
    """`python -m k3lab.harness.triton_compile OP --grid ...`: a grid name no op has, or values that leave the op no
    case, are refused by name instead of compiling nothing and passing."""
    from k3lab.harness import triton_compile as tc

    with pytest.raises(SystemExit, match="grid batch=\\[0\\] gives no valid case"):
        tc.check(["rms_norm"], grid={"batch": [0]})
    with pytest.raises(SystemExit, match="grid names \\['bogus'\\] are no axis"):
        tc.check(["rms_norm"], grid={"bogus": [1]})


def test_offline_signature_specializes_as_the_launcher():
    """The offline compile sees what the launcher passes: an int of 1 is a constexpr, aligned pointers and ints
    divisible by 16 carry tt.divisibility 16 (without it pointer loads compile unvectorized and unpipelined, and
    the registers read offline are not the GPU's: docs/NOTES_trunk.md, forty-third session)."""
    triton = pytest.importorskip("triton")
    import torch
    import triton.language as tl

    from k3lab.harness.triton_compile import _signature

    def body(p, q, n, m, one, f, B: tl.constexpr):
        pass

    k = triton.runtime.jit.JITFunction(body)  # not triton.jit: this process may run under TRITON_INTERPRET=1

    base = torch.zeros(64)
    sig, const, opts, attrs = _signature(k, (base, base[1:], 7168, 17, 1, 0.5), dict(B=4, num_warps=4))
    assert sig == {"p": "*fp32", "q": "*fp32", "n": "i32", "m": "i32", "one": "constexpr", "f": "fp32",
                   "B": "constexpr"}
    assert const == {"one": 1, "B": 4} and opts == {"num_warps": 4}
    assert attrs == {(0,): [["tt.divisibility", 16]], (2,): [["tt.divisibility", 16]]}
