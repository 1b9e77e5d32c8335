"""The CuTe DSL MLA cache write (kernels/cute/mla_cache_write.py) on the CPU emulator (tests/cute_emulate.py):
its logic checked without a GPU or nvidia-cutlass-dsl.

1. The shared checker (k3lab.harness.checker: fresh inputs, the cache and per-token scales poisoned with NaN,
   the fp64 reference rounded once to the cache format, every row but the written ones left untouched, inputs
   unchanged) with the emulated kernel as the implementation: bf16 and fp8 (per-tensor and per-token scales),
   contiguous and paged 1 / 16 / 64, T 1 and 4, batch 1 and 3, ragged lengths, int64 lengths, pdl.
2. Bit-equality with the Triton kernel (kernels/triton/mla_cache_write.py) under TRITON_INTERPRET=1. The
   interpreter sums the squares in numpy's pairwise order, the CuTe kernel in Triton-on-the-GPU's order, so
   the strict test uses latent values on a grid of 1/8 (every partial sum of squares exact in fp32 in any
   order); everything after the sum is the same IEEE fp32 operation in both (the emulator holds div.full and
   sqrt.approx correctly rounded, as the interpreter does). On the registry's own inputs the codes agree but
   for the sign of fp8 zeros: the interpreter's rne_e4m3 (kernels/triton/mla_decode.py) makes a tiny negative
   value +0 where the GPU's cvt (the CuTe kernel's, and Triton's on the GPU) gives -0 (0x80).
3. The component API: backend "cute" refused by name without cutlass; pdl validated by name.
"""
import importlib.util

import pytest
import torch

import cute_emulate as emulate
from k3lab import registry
from k3lab.components import mla as comp
from k3lab.harness import checker
from k3lab.harness.checker import clone_inputs
from k3lab.ops import mla as om
from k3lab.ref.mla import PagedMLACache
from k3lab.switches import BackendUnavailable

pytestmark = pytest.mark.cute_emu
WRITE = registry.get("mla_cache_write")
FORMATS = [("bf16", "tensor"), ("fp8", "tensor"), ("fp8", "token")]
PAGES = [0, 1, 16, 64]


def run_write(kv, kv_norm, cache, lengths, *, eps=1e-6, scale=None, block_table=None, pdl=False, early=None,
              base=None, seed=0):
    """mla_cache_write on the emulator (the wrapper's arguments as CPU tensors; `base`: the contiguous tensor
    a strided kv views). pdl=True also checks the launch's order: only `early` (default: kv_norm, lengths,
    the block table, a per-tensor scale) read, nothing written, before griddepcontrol.wait."""
    if early is None:
        early = [kv_norm, lengths] + [t for t in (block_table,) if t is not None] + \
            [t for t in (scale,) if t is not None and t.dim() == 0]
    emulate._PDL["early"] = frozenset(t.data_ptr() for t in early)
    emulate._run(lambda m, base, **a: m.mod["mla_cache_write"].mla_cache_write(**a, eps=eps, pdl=pdl),
                 dict(kv=kv, kv_norm=kv_norm, cache=cache, lengths=lengths, scale=scale, block_table=block_table,
                      base=base), seed)


def _args(d):
    """(kv, kv_norm, cache tensor, lengths, scale, block_table) of a registry input dict (views: the write
    lands in d)."""
    c = om._cache_of(d, "token_scale")
    paged = isinstance(c, PagedMLACache)
    return d["kv"], d["kv_norm"], c.pool if paged else c.data, d["lengths"], c.scale, c.block_table if paged else None


def emulated_impl(pdl=False, lengths_dtype=None):
    def impl(d):
        kv, kv_norm, cache, lengths, scale, table = _args(d)
        if lengths_dtype is not None:
            lengths = lengths.to(lengths_dtype)
        run_write(kv, kv_norm, cache, lengths, scale=scale, block_table=table, pdl=pdl)
    impl.__name__ = f"emulated cute mla_cache_write(pdl={pdl})"
    return impl


def case(kv, page_size, batch=3, T=4, context=20, ragged=True):
    return WRITE.case(kv_dtype=kv[0], fp8_scale=kv[1], page_size=page_size, batch=batch, T=T, context=context,
                      ragged=ragged)


def check(c, seed=0, **kw):
    res = checker.require(checker.check(WRITE, c, impl=emulated_impl(**kw), seed=seed, device="cpu"))
    assert emulate.LAST["launches"][-1]["grid"] == (c["batch"] * c["T"], 1, 1)
    assert emulate.LAST["launches"][-1]["block"] == 32
    return res


# ---- 1. the checker against fp64 ---------------------------------------------------------------------

@pytest.mark.parametrize("page_size", PAGES)
@pytest.mark.parametrize("kv", FORMATS, ids=lambda k: "-".join(k))
def test_batch3_ragged_T4(kv, page_size):
    """Three sequences of lengths 20, 10, 1, four new positions each (crossing page boundaries)."""
    check(case(kv, page_size), seed=page_size)


@pytest.mark.parametrize("kv", FORMATS, ids=lambda k: "-".join(k))
@pytest.mark.parametrize("page_size,T,context", [(0, 1, 7), (64, 1, 63), (16, 4, 0), (1, 4, 5)])
def test_batch1(kv, page_size, T, context):
    """Batch 1: one entry (T 1) or four; an empty history; the last slot of a page."""
    check(case(kv, page_size, batch=1, T=T, context=context, ragged=False), seed=T + context)


@pytest.mark.parametrize("kv", FORMATS, ids=lambda k: "-".join(k))
def test_pdl(kv):
    """Programmatic dependent launch: the same results, and the emulator's order check (nothing but kv_norm,
    lengths, the block table and a per-tensor scale read, nothing written, before griddepcontrol.wait)."""
    check(case(kv, 16, T=2), seed=3, pdl=True)
    assert emulate.LAST["launches"][-1]["use_pdl"] is True
    check(case(kv, 0, batch=1, T=1, ragged=False), seed=4, pdl=True)


def test_pdl_order_is_enforced():
    """With only kv_norm declared readable before the wait, the early lengths load must be caught."""
    d = WRITE.make_inputs(case(FORMATS[0], 16, batch=1, T=1), 0, "cpu")
    kv, kv_norm, cache, lengths, scale, table = _args(d)
    with pytest.raises(emulate.EmulationError, match="before griddepcontrol.wait"):
        run_write(kv, kv_norm, cache, lengths, scale=scale, block_table=table, pdl=True, early=[kv_norm])


@pytest.mark.parametrize("kv", [FORMATS[0], FORMATS[2]], ids=lambda k: "-".join(k))
def test_tree_sum_order(kv, monkeypatch):
    """The in-thread sum of squares as Triton 3.8 forms it (mla_cache_write.SUM_ORDER = "tree")."""
    with emulate.emulated() as m:  # the runs below reuse this context: the patched module stays loaded
        monkeypatch.setattr(m.mod["mla_cache_write"], "SUM_ORDER", "tree")
        check(case(kv, 16, T=2), seed=6)
        assert any("tree" in key for key in m.mod["mla_cache_write"]._COMPILED)


@pytest.mark.parametrize("kv", [FORMATS[0], FORMATS[2]], ids=lambda k: "-".join(k))
def test_int64_lengths(kv):
    check(case(kv, 16, T=2), seed=5, lengths_dtype=torch.int64)


def test_strided_kv():
    """kv a slice of a wider projection output (strides multiples of 4): the kernel reads it in place."""
    d = WRITE.make_inputs(case(FORMATS[0], 0, batch=2, T=3, ragged=False), 0, "cpu")
    want = clone_inputs(d)
    wide = torch.full((2, 3, 640), float("nan"), dtype=torch.bfloat16)
    wide[..., 64:] = d["kv"]
    kv, kv_norm, cache, lengths, scale, table = _args(d)
    run_write(wide[..., 64:], kv_norm, cache, lengths, scale=scale, block_table=table, base=wide)
    emulated_impl()(want)
    assert torch.equal(d["kv_cache"].view(torch.uint8), want["kv_cache"].view(torch.uint8))


# ---- 2. bit-equality with the Triton kernel (interpreter) ------------------------------------------------

def _on_grid(d, seed):
    """Latent and rope values k / 8, |k| <= 64 (rope k != 0): every sum of squares exact in fp32, no value
    near zero (module doc)."""
    g = torch.Generator().manual_seed(seed)
    k = torch.randint(-64, 65, d["kv"].shape, generator=g)
    rope = k[..., 512:]
    rope[rope == 0] = 1
    d["kv"] = (k.float() / 8).to(d["kv"].dtype)
    return d


def _triton_and_cute(c, seed, grid_values):
    d = WRITE.make_inputs(c, seed, "cpu")
    if grid_values:
        d = _on_grid(d, seed + 100)
    a, b = clone_inputs(d), clone_inputs(d)
    comp.write_cache(a["kv"], a["kv_norm"], om._cache_of(a, "token_scale"), a["lengths"], eps=1e-6,
                     backend="triton", check_values=False)
    emulated_impl()(b)
    out = [(a["kv_cache"], b["kv_cache"])]
    if a["token_scale"].numel():
        out.append((a["token_scale"], b["token_scale"]))
    return out


def _bytes(t):
    return t.reshape(-1).view(torch.uint8)


@pytest.mark.parametrize("page_size", PAGES)
@pytest.mark.parametrize("kv", FORMATS, ids=lambda k: "-".join(k))
def test_bit_equal_to_triton(kv, page_size):
    for tri, cute in _triton_and_cute(case(kv, page_size), seed=page_size + 1, grid_values=True):
        assert torch.equal(_bytes(tri), _bytes(cute))


@pytest.mark.parametrize("page_size", [0, 16])
@pytest.mark.parametrize("kv", FORMATS, ids=lambda k: "-".join(k))
def test_equal_to_triton_on_registry_inputs(kv, page_size):
    """The registry's inputs: the same values everywhere (NaN poison included), the same bytes but for the
    interpreter's +0 where the GPU's cvt gives -0 (module doc)."""
    for tri, cute in _triton_and_cute(case(kv, page_size), seed=page_size, grid_values=False):
        tb, cb = _bytes(tri), _bytes(cute)
        diff = tb != cb
        if tri.dtype == torch.float8_e4m3fn:
            assert bool(((tb[diff] == 0x00) & (cb[diff] == 0x80)).all())
        else:
            assert not bool(diff.any())


# ---- 3. the component API ---------------------------------------------------------------------------

def _component_args(kv=FORMATS[0], page_size=16):
    d = WRITE.make_inputs(case(kv, page_size, batch=1, T=1), 0, "cpu")
    return d["kv"], d["kv_norm"], om._cache_of(d, "token_scale"), d["lengths"]


@pytest.mark.skipif(importlib.util.find_spec("cutlass") is not None, reason="cutlass is installed here")
def test_cute_refused_without_cutlass():
    with pytest.raises(BackendUnavailable, match="'cute'.*nvidia-cutlass-dsl"):
        comp.write_cache(*_component_args(), backend="cute")


def test_pdl_validated_by_name():
    with pytest.raises(comp.MLAArgumentError, match="'pdl'"):
        comp.write_cache(*_component_args(), backend="reference", pdl="yes")
    with pytest.raises(comp.MLAArgumentError, match="'pdl'.*kernel backend"):
        comp.write_cache(*_component_args(), backend="reference", pdl=True)


def test_registry_entry():
    assert WRITE.backends["cute"] == "k3lab_kernels.cute.mla_cache_write:mla_cache_write"
    assert WRITE.options("cute") == [{"pdl": None}]
    assert WRITE.options("cute", {"pdl": (False, True)}) == [{"pdl": False}, {"pdl": True}]


@pytest.mark.parametrize("bad,match", [
    (dict(kv=lambda kv: kv[..., :512]), "'kv'.*576"),
    (dict(kv=lambda kv: torch.zeros(580, dtype=torch.bfloat16)[1:577].view(1, 1, 576)), "'kv'.*aligned"),
    (dict(kv=lambda kv: torch.zeros(1, 1, 578, dtype=torch.bfloat16)[..., 1:577]), "'kv'.*multiples of 4"),
    (dict(scale=lambda s: None), "'scale'.*required"),
    (dict(pdl="no"), "'pdl'"),
])
def test_kernel_arguments_named(bad, match):
    d = WRITE.make_inputs(case(FORMATS[1], 0, batch=1, T=1), 0, "cpu")
    kv, kv_norm, cache, lengths, scale, table = _args(d)
    kw = dict(kv=kv, scale=scale, pdl=False)
    for k, v in bad.items():
        kw[k] = v(kw[k]) if callable(v) else v
    with emulate.emulated() as m:
        with pytest.raises(ValueError, match=match):
            m.mod["mla_cache_write"].mla_cache_write(emulate._dev(kw["kv"]), emulate._dev(kv_norm),
                                                     emulate._dev(cache), emulate._dev(lengths),
                                                     scale=emulate._dev(kw["scale"]), pdl=kw["pdl"])
