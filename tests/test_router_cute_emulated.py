"""The CuTe DSL router top-k (kernels/cute/router_topk.py) on the CPU emulator (tests/cute_emulate.py): its logic
checked without a GPU or nvidia-cutlass-dsl.

The shared checker (k3lab.harness.checker: fresh inputs, idx and weights poisoned, the fp64 oracle
`k3lab.ops.trunk.ref_router`; idx exact under the tie rule, weights 1e-5) on the registry's random / near / ties
score cases at batch 1-3, plus odd shapes (E not a multiple of 128, k = 1, 7, 32), inputs that take the kernel's
two-chunk ranking and its k-rounds fallback (the top experts crowded into few of the 32 groups), pdl (the
emulator refuses a logits read before griddepcontrol.wait) and argument errors by name.

Against the Triton kernel under TRITON_INTERPRET=1 on the same logits: idx bit-identical; weights within 4 fp32
ulp, not bit-identical here: the emulator holds registers in float64 (its module doc) and the interpreter runs
numpy's float32 exp and pairwise sum, neither of which is the GPU's ex2.approx / butterfly. Bit-equality of
both outputs is checked on the GPU (tests/test_router_cute.py).
"""
import pytest
import torch

import cute_emulate as emulate
from k3lab import registry
from k3lab.harness import checker
from k3lab.ops.trunk import make_router
from k3lab_kernels.triton.router_topk import router_topk as triton_router_topk

pytestmark = pytest.mark.cute_emu
ROUTER = registry.get("router_topk")


def run_router(logits, e_bias, idx, weights, *, top_k, scaling=1.0, pdl=False, seed=0):
    """router_topk on the emulator (CPU tensors). pdl=True also checks that only e_bias is read before the wait.
    Row-strided logits (the "near" case's are a slice of wider rows): their whole rows are handed over too, so
    the emulator maps the memory the kernel reads."""
    emulate._PDL["early"] = frozenset({e_bias.data_ptr()})
    extra = {}
    if logits.dim() == 2 and not logits.is_contiguous() and logits.stride(1) == 1:
        extra["rows"] = logits.as_strided((logits.shape[0], logits.stride(0)), (logits.stride(0), 1))

    def call(m, logits, e_bias, idx, weights, **_):
        m.mod["router_topk"].router_topk(logits, e_bias, idx, weights, top_k=top_k, scaling=scaling, pdl=pdl)

    emulate._run(call, dict(logits=logits, e_bias=e_bias, idx=idx, weights=weights, **extra), seed)
    return idx, weights


def impl(case, **kw):
    def f(d):
        run_router(d["logits"], d["e_bias"], d["idx"], d["weights"], top_k=case["top_k"], **kw)
    f.__name__ = f"cute_emulated.router_topk{kw}"
    return f


def check(case, seed=0, inputs=None, **kw):
    checker.require(checker.check(ROUTER, case, impl=impl(case, **kw), seed=seed, device="cpu", inputs=inputs))


def case(batch, scores, experts=896, top_k=16):
    return ROUTER.case(batch=batch, experts=experts, top_k=top_k, scores=scores)


def triton_same(d, top_k, scaling=1.0):
    """idx bit-identical to the Triton kernel (interpreter) on d's logits, weights within 4 ulp."""
    B = d["logits"].shape[0]
    want_i = torch.full((B, top_k), -1, dtype=torch.int64)
    want_w = torch.full((B, top_k), float("nan"))
    triton_router_topk(d["logits"], d["e_bias"], want_i, want_w, top_k=top_k, scaling=scaling)
    got_i = torch.full((B, top_k), -1, dtype=torch.int64)
    got_w = torch.full((B, top_k), float("nan"))
    run_router(d["logits"], d["e_bias"], got_i, got_w, top_k=top_k, scaling=scaling)
    assert torch.equal(got_i, want_i), (got_i, want_i)
    ulp = torch.finfo(torch.float32).eps * want_w.abs().clamp_min(torch.finfo(torch.float32).tiny)
    assert ((got_w - want_w).abs() <= 4 * ulp).all(), (got_w - want_w).abs().max()


# ---- the registry's cases through the shared checker -----------------------------------------------------

@pytest.mark.parametrize("scores", ["random", "near", "ties"])
@pytest.mark.parametrize("batch", [1, 3])
def test_checker(batch, scores):
    check(case(batch, scores), seed=batch)


@pytest.mark.parametrize("scores", ["random", "near", "ties"])
def test_same_as_triton(scores):
    d = make_router(case(2, scores), 5, "cpu")
    triton_same(d, 16, scaling=2.5)


def test_pdl():
    check(case(2, "random"), seed=4, pdl=True)
    assert emulate.LAST["launches"][-1]["use_pdl"]


# ---- odd shapes: padding threads (E % 128 != 0), k = 1, 7 (KP 8), 32 -------------------------------------------

@pytest.mark.parametrize("experts,top_k,scores", [(200, 5, "random"), (896, 1, "ties"), (896, 7, "near"),
                                                  (896, 32, "random"), (64, 16, "ties"), (1024, 16, "random")])
def test_odd_shapes(experts, top_k, scores):
    check(case(2, scores, experts=experts, top_k=top_k), seed=experts + top_k)


def test_odd_shapes_same_as_triton():
    d = make_router(case(1, "random", experts=200, top_k=5), 3, "cpu")
    triton_same(d, 5)


# ---- the ranking's paths: one chunk (above), two chunks, k rounds ---------------------------------------------

def crowded(groups: int, batch: int = 1, seed: int = 0, E: int = 896):
    """Logits whose largest values sit in the first `groups` of the kernel's 32 groups (lane l's group: the
    experts e with e % (32 W) % 32 == l), so the threshold is loose: ~28 * groups candidates at E = 896."""
    g = torch.Generator().manual_seed(seed)
    z = torch.randn(batch, E, generator=g)
    lanes = (torch.arange(E) % (32 * ((E + 127) // 128))) % 32
    z[:, lanes < groups] += 6.0
    d = make_router(case(batch, "random", experts=E), seed, "cpu")
    d["logits"] = z
    d["e_bias"] = torch.randn(E, generator=g) * 0.1
    return d


@pytest.mark.parametrize("groups", [1, 5])
def test_crowded_groups(groups):
    """groups 1: ~44 candidates (two chunks); 5: ~150 (k rounds)."""
    d = crowded(groups, batch=2, seed=groups)
    check(case(2, "random"), inputs=d)
    triton_same(d, 16)


def test_candidate_paths_taken():
    """The inputs above do reach the paths they are meant for (counted as the kernel counts: keys >= the
    group maximum of rank k - 1)."""
    def n_candidates(d, k=16, W=7):
        v = (torch.sigmoid(d["logits"][0].double()) + d["e_bias"].double()).float()
        E = v.shape[0]
        order = torch.sort(-v.double(), stable=True).indices
        key = torch.empty(E, dtype=torch.int64)
        key[order] = -torch.arange(E)
        t = key.reshape(4, 32 * W).max(0).values
        gm = t.reshape(W, 32).max(0).values
        T = torch.sort(gm, descending=True).values[k - 1]
        return int((key >= T).sum())
    assert n_candidates(make_router(case(1, "random"), 1, "cpu")) <= 32
    assert 32 < n_candidates(crowded(1, seed=1)) <= 64
    assert n_candidates(crowded(5, seed=5)) > 64


# ---- argument errors by name ---------------------------------------------------------------------------

@pytest.mark.parametrize("arg,mutate,kw", [
    ("top_k", None, dict(top_k=33)),
    ("top_k", None, dict(top_k=0)),
    ("logits", "logits_dtype", {}),
    ("e_bias", "bias_shape", {}),
    ("idx", "idx_dtype", {}),
    ("weights", "weights_shape", {}),
    ("pdl", None, dict(pdl=1)),
])
def test_argument_errors(arg, mutate, kw):
    d = make_router(case(1, "random"), 0, "cpu")
    if mutate == "logits_dtype":
        d["logits"] = d["logits"].double()
    elif mutate == "bias_shape":
        d["e_bias"] = d["e_bias"][:-1].clone()
    elif mutate == "idx_dtype":
        d["idx"] = d["idx"].int()
    elif mutate == "weights_shape":
        d["weights"] = torch.empty(1, 8)
    kw = dict(dict(top_k=16), **kw)
    with pytest.raises(ValueError, match=repr(arg)):
        run_router(d["logits"], d["e_bias"], d["idx"], d["weights"], **kw)
