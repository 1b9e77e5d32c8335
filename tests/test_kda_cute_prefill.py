"""CuTe DSL chunked prefill (kernels/cute/kda_prefill.py) against the fp64 reference, on the GPU.

Needs nvidia-cutlass-dsl and a CUDA GPU of compute capability >= 9.0; skipped cleanly otherwise. The shared
checker runs the kernel on fresh random inputs (T = L) with out poisoned: out < 1e-2, conv_state bit-exact,
state < 1e-4 against the exact recurrence (inverse fp32) or against the float64 chunked form with the same
bf16 rounding (inverse bf16), bf16 state 2e-2 (k3lab/ops/kda.py). The grid: every chunk x inverse x grouped
over L in {1, 5, 63, 64, 65, 200, 1000}, (B, H) rotating through (1, 2), (3, 12), (1, 12), (3, 2), then the
other value tiles and a bf16 state. CPU-side refusals: tests/test_kda_cute_prefill_api.py.
"""
import pytest
import torch
from cute_gate import require_cute_gpu

pytestmark = [pytest.mark.cute, pytest.mark.gpu]
require_cute_gpu()

import kda_impls as K  # noqa: E402
from k3lab.harness import checker  # noqa: E402
from k3lab_kernels.cute import kda_prefill as kp  # noqa: E402

LS = (1, 5, 63, 64, 65, 200, 1000)
BH = ((1, 2), (3, 12), (1, 12), (3, 2))


def _cases():
    out, k = [], 0
    for ch in kp.PREFILL_CHUNKS:
        for inv in kp.PREFILL_INVERSES:
            for gr in (False, True):
                for L in LS:
                    B, H = BH[k % len(BH)]
                    k += 1
                    out.append((dict(B=B, H=H, L=L, chunk=ch, inverse=inv, grouped=gr), 32))
    for tv in (16, 64, 128):
        for gr in (False, True):
            out.append((dict(B=3, H=12, L=200, chunk=64 if tv != 16 else 16, inverse="fp32", grouped=gr), tv))
    for gr in (False, True):
        out.append((dict(B=3, H=2, L=200, chunk=32, inverse="bf16", grouped=gr, state_dtype="bf16"), 32))
    return out


def _id(c):
    case, tv = c
    return "-".join(f"{k}{v}" for k, v in case.items()) + f"-tv{tv}"


def check(case, tile_v, seed=0):
    pc = K.pcase(**case)
    return checker.check(K.PRE, pc, impl=K.prefill(kp.kda_prefill, pc, tile_v=tile_v), seed=seed)


@pytest.mark.parametrize("c", _cases(), ids=_id)
def test_kda_prefill_matches_fp64_reference(c):
    checker.require(check(*c, seed=sum(c[0][k] for k in ("B", "H", "L"))))


def test_kda_prefill_bf16_inverse_rounds():
    """The bf16 switch must really round A: the kernel with it is further from the exact recurrence (the
    fp32-inverse reference) than the kernel with the fp32 inverse."""
    pc = K.pcase(1, 2, 200)
    errs = {}
    for inv in ("fp32", "bf16"):
        r = checker.check(K.PRE, pc, impl=K.prefill(kp.kda_prefill, K.pcase(1, 2, 200, inverse=inv), tile_v=32),
                          seed=3)
        errs[inv] = r.errors["state"]["rel_norm"]
    assert errs["bf16"] > 10 * errs["fp32"], errs


def test_kda_prefill_component_records_cute():
    from k3lab.components import kda
    from k3lab.ref import kda as ref

    inp, p, st, cs = ref.make_kda_inputs(1, 2, 128, T=70, seed=5, device="cuda")
    a = (inp["qkv"], inp["f"], inp["b"], inp["gate"], p)
    ran = []
    out = kda.prefill(*a, st.clone(), cs.clone(), backend="cute", grouped=True, ran=ran)
    assert ran[-1].backend == "cute" and ran[-1].kernel == "k3lab_kernels.cute.kda_prefill:kda_prefill"
    ref_out = kda.prefill(*a, st.clone(), cs.clone(), backend="reference", grouped=True)
    assert float((out.double() - ref_out.double()).norm() / ref_out.double().norm()) < 1e-2


@pytest.mark.parametrize("name,word", [("chunk=48", "chunk"), ("inverse=fp16", "inverse"), ("grouped=1", "grouped"),
                                       ("tile_v=8", "tile_v"), ("fp32 qkv", "qkv"), ("cpu gate", "gate"),
                                       ("noncontig state", "state"), ("fp16 state", "state"), ("short out", "out")])
def test_kda_cute_prefill_refuses_unsupported_inputs(name, word):
    d = K.PRE.make_inputs(K.pcase(1, 2, 5), 0, "cuda")
    a = list(K._a(d))
    kw = {}
    if "=" in name:
        k, v = name.split("=")
        kw[k] = {"48": 48, "fp16": "fp16", "1": 1, "8": 8}[v]
    else:
        i, t = {"fp32 qkv": (0, a[0].float()), "cpu gate": (3, a[3].cpu()),
                "noncontig state": (5, a[5].transpose(2, 3)), "fp16 state": (5, a[5].half()),
                "short out": (7, a[7][:, :4])}[name]
        a[i] = t
    with pytest.raises((ValueError, TypeError, NotImplementedError), match=word):
        kp.kda_prefill(*a, **kw)
    torch.cuda.synchronize()
