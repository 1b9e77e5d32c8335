"""The absorbed MLA query step (q_norm + Wuq + Wuk in one launch; k3lab.ops.mla `mla_query`) through the shared
checker (fp64 reference, outputs poisoned, inputs unchanged; tolerances and their reasons in k3lab.ops.mla): the
reference, the Triton kernel under TRITON_INTERPRET=1 and the CuTe DSL kernel on the CPU emulator (tests/
cute_emulate.py) at small shapes (a partial 256-column step, full steps, the four preloaded steps and one more, batch
1..4, 1..3 heads, C from one column a lane to sixteen); the refusals by name; the GPU tests at K3's TP8 and TP16
shapes (tests marked gpu: `python3 -m pytest -q -m gpu tests/test_mla_query.py`)."""
from __future__ import annotations

import pytest
import torch

import cute_emulate as emulate
from k3lab import registry
from k3lab.components import mla
from k3lab.harness import checker
from k3lab.ops.mla import query_supports
from k3lab.switches import BackendUnavailable

OP = registry.get("mla_query")
SMALL = dict(heads=2, batch=1, q_rank=40, nope=16, rope=8, latent=32)


def _check(backend="triton", impl=None, seed=0, **shape):
    case = OP.case(**{**SMALL, **shape})
    if impl is not None:
        return checker.require(checker.check(OP, case, impl=impl, seed=seed, device="cpu"))
    res = checker.require(checker.check(OP, case, backend=backend, seed=seed))
    assert res.ran and res.ran[-1].backend == backend
    return res


def test_reference_at_k3_tp8():
    _check("reference", heads=12, batch=1, q_rank=1536, nope=128, rope=64, latent=512)


@pytest.mark.parametrize("shape", [
    dict(),                                               # Q 40: one partial step of 256 columns
    dict(batch=3, q_rank=264, latent=64, heads=3),        # a full step and a partial one, a masked batch row
    dict(batch=4, q_rank=512, latent=128, nope=24, rope=16),
    dict(batch=2, q_rank=1536, nope=128, rope=64, latent=512, heads=1),
], ids=lambda d: ",".join(f"{k}={v}" for k, v in d.items()) or "small")
def test_triton(shape):
    _check("triton", **shape)


def run_cute(d, pdl=False, seed=0):
    """mla_query on the CuTe emulator; under pdl only the two weights may be read before the wait."""
    t = {k: d[k] for k in ("cq", "q_norm", "w_uq", "w_uk", "q_lat", "q_rope")}
    emulate._PDL["early"] = frozenset({d["w_uq"].data_ptr(), d["w_uk"].data_ptr()})

    def call(m, **a):
        m.mod["mla_query"].mla_query(a["cq"], a["q_norm"], a["w_uq"], a["w_uk"], a["q_lat"], a["q_rope"], eps=1e-6,
                                     pdl=pdl)
    emulate._run(call, t, seed)


def cute_impl(pdl=False):
    def f(d):
        run_cute(d, pdl)
    f.__name__ = f"emulated cute mla_query(pdl={pdl})"
    return f


@pytest.mark.cute_emu
@pytest.mark.parametrize("shape,pdl", [
    (dict(rope=16), False),                                             # one CTA a head (no cluster), partial step
    (dict(batch=3, q_rank=264, latent=64, heads=3, nope=32, rope=16), True),   # clusters of 2, a padding CTA
    (dict(batch=4, q_rank=1280, latent=256, nope=64, rope=16), True),  # clusters of 4, five steps, 8 columns a lane
    (dict(batch=1, q_rank=256, latent=512, heads=1, nope=128, rope=64), False),  # K3's head: a cluster of 8
], ids=["small", "b3-q264-cluster2", "b4-q1280-cluster4-pdl", "k3-head"])
def test_cute_emulated(shape, pdl):
    _check(impl=cute_impl(pdl), seed=len(shape), **shape)
    assert emulate.LAST["launches"][-1]["use_pdl"] is pdl


@pytest.mark.cute_emu
def test_cute_emulated_repeats_bit_for_bit():
    """The sums run in a fixed order: a second launch on the same inputs (into other outputs; the emulator runs the
    clusters and threads in another random order) gives the same bits."""
    d = OP.make_inputs(OP.case(**{**SMALL, "batch": 2, "heads": 3, "nope": 32, "rope": 16}), 5, "cpu")
    t = {k: d[k] for k in ("cq", "q_norm", "w_uq", "w_uk", "q_lat", "q_rope")}
    t["lat2"], t["rope2"] = torch.full_like(d["q_lat"], float("nan")), torch.full_like(d["q_rope"], float("nan"))
    emulate._PDL["early"] = frozenset()

    def call(m, **a):
        for lat, rope in (("q_lat", "q_rope"), ("lat2", "rope2")):
            m.mod["mla_query"].mla_query(a["cq"], a["q_norm"], a["w_uq"], a["w_uk"], a[lat], a[rope], eps=1e-6,
                                         pdl=False)
    emulate._run(call, t, 3)
    assert not d["q_lat"].isnan().any() and not d["q_rope"].isnan().any()
    assert torch.equal(d["q_lat"], t["lat2"]) and torch.equal(d["q_rope"], t["rope2"])


def test_refused_by_name():
    d = OP.make_inputs(OP.case(**SMALL), 0, "cpu")
    a = (d["cq"], d["q_norm"], d["w_uq"], d["w_uk"], d["q_lat"], d["q_rope"])
    with pytest.raises(BackendUnavailable, match="batch 5 > 4"):  # the registry's supports, before the kernel
        mla.query(torch.zeros(5, 40, dtype=torch.bfloat16), *a[1:4], backend="triton")
    import k3lab_kernels.triton.mla_query  # (after k3lab: a checkout that is not installed maps kernels/ there)

    with pytest.raises(ValueError, match="'cq' must be \\[1..4, Q\\]"):  # the kernel's own check
        k3lab_kernels.triton.mla_query.mla_query(torch.zeros(5, 40, dtype=torch.bfloat16), *a[1:])
    with pytest.raises(BackendUnavailable, match="C 48 not in"):
        mla.query(*a[:3], torch.zeros(2, 16, 48, dtype=torch.bfloat16), backend="triton")
    with pytest.raises(ValueError, match="'w_uk' must be a contiguous"):
        k3lab_kernels.triton.mla_query.mla_query(*a[:3], torch.zeros(2, 16, 48, dtype=torch.bfloat16), *a[4:])
    with pytest.raises(ValueError, match="'q_norm' must be bf16"):
        mla.query(a[0], a[1].float(), *a[2:], backend="triton")
    with pytest.raises(ValueError, match="'q_lat' must be \\[1, 2, 32\\]"):
        mla.query(*a[:4], torch.zeros(1, 2, 16, dtype=torch.bfloat16), a[5], backend="reference")
    with pytest.raises(ValueError, match="'w_uq' must be"):
        mla.query(a[0], a[1], a[2][:-1], a[3], backend="reference")
    with pytest.raises(ValueError, match="'pdl' pdl=True .* needs a kernel backend"):
        mla.query(*a, backend="reference", pdl=True)


def test_auto_passes_over_the_kernels_beyond_their_limits():
    assert query_supports("cute", dict(B=4, Dn=128, Dr=64, C=512)) is None
    assert "batch 5" in query_supports("triton", dict(B=5))
    assert "C 48" in query_supports("cute", dict(B=1, C=48))
    assert "Dn 48" in query_supports("cute", dict(B=1, Dn=48)) and "Dr 8" in query_supports("cute", dict(Dr=8))
    assert query_supports("triton", dict(B=1, Dn=48, Dr=8)) is None
    assert query_supports("reference", dict(B=64)) is None
    ran: list = []
    d = OP.make_inputs(OP.case(**{**SMALL, "batch": 1}), 0, "cpu")
    mla.query(d["cq"], d["q_norm"], d["w_uq"], d["w_uk"], backend="auto", ran=ran)
    assert ran[-1].op == "mla_query" and ran[-1].backend in ("triton", "reference")
    # data/mla_defaults.json (profiles/h200/mla_query.json.gz): cute up to batch 4, the Triton twin where CuTe DSL
    # cannot run, the reference above batch 4
    from k3lab import policy

    assert policy.rule("mla", "query", 1)["backend"] == "cute" and policy.rule("mla", "query", 4)["backend"] == "cute"
    assert policy.rule("mla", "query", 5)["backend"] == "reference"
    pick = policy.choose("mla", "query", 2, 1, lambda b: b != "cute")
    assert pick[0] == "triton" and "fallback" in pick[2]
    assert policy.choose("mla", "query", 8, 1, lambda b: True)[0] == "reference"


# ---- GPU ------------------------------------------------------------------------------------------------

gpu = pytest.mark.gpu


def _k3(tp_heads, batch):
    return dict(heads=tp_heads, batch=batch, q_rank=1536, nope=128, rope=64, latent=512)


@gpu
@pytest.mark.parametrize("backend", ["triton", "cute"])
@pytest.mark.parametrize("heads,batch", [(12, 1), (6, 1), (12, 4)])
def test_gpu_k3(backend, heads, batch):
    if not torch.cuda.is_available():
        pytest.skip("no GPU")
    if backend == "cute":
        pytest.importorskip("cutlass")
    _check(backend, **_k3(heads, batch))
    _check(backend, seed=3, **_k3(heads, batch))  # again: the counters were reset


@gpu
@pytest.mark.parametrize("backend", ["triton", "cute"])
def test_gpu_graph_pdl_chain_and_strided_outputs(backend):
    """In a pdl chain, inside a CUDA graph replayed on new inputs, into strided views (the decode step's q_lat is a
    transposed [H, B, C] buffer): equal to the eager fp64-checked result of the same inputs."""
    if not torch.cuda.is_available():
        pytest.skip("no GPU")
    if backend == "cute":
        pytest.importorskip("cutlass")
    from k3lab_kernels.triton.pdl import pdl_chain

    d = OP.make_inputs(OP.case(**_k3(12, 1)), 0, "cuda")
    want = OP.reference(d, OP.case(**_k3(12, 1)))
    lat_t = torch.empty(12, 1, 512, dtype=torch.bfloat16, device="cuda")
    rope_w = torch.empty(1, 12, 192, dtype=torch.bfloat16, device="cuda")
    lat, rope = lat_t.transpose(0, 1), rope_w[..., 128:]
    run = lambda: mla.query(d["cq"], d["q_norm"], d["w_uq"], d["w_uk"], lat, rope, backend=backend)  # noqa: E731
    with pdl_chain(True):
        run()
        torch.cuda.synchronize()
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            run()
    for _ in range(3):
        lat.fill_(float("nan"))
        g.replay()
    torch.cuda.synchronize()
    for got, ref in ((lat, want["q_lat"]), (rope, want["q_rope"])):
        err = (got.double() - ref.cuda()).norm() / ref.norm()
        assert err < 5e-3, err
