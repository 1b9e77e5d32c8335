"""CuTe DSL chunked prefill (kernels/cute/kda_prefill.py) against the fp64 reference.

Needs nvidia-cutlass-dsl and a CUDA GPU of compute capability >= 9.0; skipped cleanly otherwise.
The checks live in kernels/cute/check_kda.py (check_prefill, `--prefill`) so the GPU script and these
tests assert the same thing: fresh random inputs (make_kda_inputs, T = L), out poisoned with NaN,
out relative error < 1e-2, conv_state exact, state < 1e-4 against the exact recurrence (inverse fp32)
or against the float64 chunked form with the same bf16 rounding (inverse bf16, which must also stay
within 1e-3 of the exact recurrence), bf16 state 2e-2. The grid: every chunk x inverse x grouped over
L in {1, 5, 63, 64, 65, 200, 1000} with B in {1, 3} and H in {2, 12}, then the other value tiles and a
bf16 state (check_kda.prefill_cases). CPU-side refusals: tests/test_kda_cute_prefill_api.py.
"""
import pytest

import k3lab  # noqa: F401  (maps k3lab_kernels onto the checkout when it is not installed)
from cute_gate import require_cute_gpu

pytestmark = [pytest.mark.cute, pytest.mark.gpu]
require_cute_gpu()

from k3lab_kernels.cute.check_kda import check_prefill, check_prefill_errors, prefill_cases  # noqa: E402


def _id(c):
    return (f"B{c['B']}-H{c['H']}-L{c['L']}-ch{c['chunk']}-{c['inverse']}-{'grp' if c['grouped'] else 'seq'}"
            f"-tv{c['tile_v']}" + ("-bf16state" if c.get("state_dtype") == "bf16" else ""))


_CASES = prefill_cases()


@pytest.mark.parametrize("case", _CASES, ids=[_id(c) for c in _CASES])
def test_kda_prefill_matches_fp64_reference(case):
    r = check_prefill(**case)
    assert r["out_finite"], r
    assert r["conv_exact"], r
    assert r["ok"], r


def test_kda_prefill_bf16_inverse_rounds():
    """The bf16 switch must really round A: its error against the exact recurrence is well above the
    fp32 inverse's."""
    e = {inv: check_prefill(1, 2, 200, chunk=64, inverse=inv)["exact_state_err"] for inv in ("fp32", "bf16")}
    assert e["bf16"] > 10 * e["fp32"], e


def test_kda_prefill_component_records_cute():
    from k3lab.components import kda
    from k3lab.ref import kda as ref

    inp, p, st, cs = ref.make_kda_inputs(1, 2, 128, T=70, seed=5, device="cuda")
    a = (inp["qkv"], inp["f"], inp["b"], inp["gate"], p)
    out = kda.prefill(*a, st.clone(), cs.clone(), backend="cute", grouped=True)
    assert kda.last_run.backend == "cute" and kda.last_run.kernel.startswith("cute:kda_prefill grouped")
    ref_out = kda.prefill(*a, st.clone(), cs.clone(), backend="reference", grouped=True)
    assert float((out.double() - ref_out.double()).norm() / ref_out.double().norm()) < 1e-2


def test_kda_cute_prefill_refuses_unsupported_inputs():
    r = check_prefill_errors()
    assert r["ok"], r
