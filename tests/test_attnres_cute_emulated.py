"""The CuTe DSL AttnRes + RMSNorm kernel (kernels/cute/attnres_norm.py) on the CPU emulator (tests/cute_emulate.py):
its logic checked without a GPU or nvidia-cutlass-dsl, as TRITON_INTERPRET=1 checks the Triton kernel.

The checks are the shared checker's (k3lab.harness.checker: fresh inputs of the registry's `attnres_norm`, out and
partial_out poisoned with NaN, the fp64 reference; partial_out bit-exact, out < 4e-3, inputs unchanged), with the
emulator's entry point as the implementation and CPU tensors: D = 7168 (the model's) at batch 1 and 2, 0 / 1 / 9
blocks and every update mode, every (cluster, vec) the kernel takes at D = 7168, odd widths (clusters of 1 and
4, vec 1, idle threads), the in-place partial, and the argument errors by name; the large-batch options (cluster 8 /
4 / 2 with vec 8) at batch 1, 3 and 5, 0 / 1 / 9 blocks, every update mode, and under pdl with the early reads.
"""
import pytest
import torch

import cute_emulate as emulate
from k3lab import registry
from k3lab.harness import checker
from k3lab_kernels.cute import attnres_norm as kern

pytestmark = pytest.mark.cute_emu
OP = registry.get("attnres_norm")


def impl(case, **opts):
    """The emulator's kernel call as a checker implementation (the component API's argument mapping)."""
    u = case["update"]

    def run(d):
        blocks = [d[f"block{i}"] for i in range(case["n_blocks"])]
        emulate.run_attnres(blocks, d["prefix"], d["new"] if u != "none" else None, d["w_norm"], d["w_proj"],
                            d["norm_w"], d["out"], d["partial_out"] if u != "none" else None, update=u, **opts)
    run.__name__ = f"cute_emulate.run_attnres{opts}"
    return run


def check(batch, n_blocks, update, dim=7168, seed=0, **opts):
    case = OP.case(batch=batch, n_blocks=n_blocks, update=update, dim=dim)
    return checker.require(checker.check(OP, case, impl=impl(case, **opts), seed=seed, device="cpu"))


@pytest.mark.parametrize("update", ["none", "add", "fresh"])
@pytest.mark.parametrize("n_blocks", [0, 1, 9])
def test_blocks_and_updates(n_blocks, update):
    """D = 7168 at the default options (cluster 8, vec 4: 224 threads a CTA), batch 2 (two clusters)."""
    check(2, n_blocks, update, seed=n_blocks * 3 + len(update))
    launch = emulate.LAST["launches"][-1]
    assert launch["cluster"] == (8, 1, 1) and launch["grid"] == (8, 2, 1) and launch["block"] == 224


def test_batch_one_nine_blocks():
    check(1, 9, "add", seed=5)


@pytest.mark.parametrize("update", ["add", "fresh"])
def test_pdl(update):
    """pdl=True (the decode step's `pdl` switch): a PDL launch whose CTAs read only the three weight vectors before
    griddepcontrol.wait (the emulator raises on any other read, and on a launch_dependents before the wait); the
    same result."""
    check(2, 9, update, seed=11, pdl=True)
    assert emulate.LAST["launches"][-1]["use_pdl"]


@pytest.mark.parametrize("n_blocks,update", [(9, "add"), (9, "none"), (1, "fresh"), (0, "add")])
def test_pdl_early(n_blocks, update):
    """EARLY under pdl: the blocks and the prefix read, and the blocks' partial sums formed, before
    griddepcontrol.wait, `new` after it; the same checked result. Without the blocks and prefix declared readable
    there the emulator refuses the launch (the early reads are real)."""
    check(2, n_blocks, update, seed=13 + n_blocks, pdl=True, early=True)
    if n_blocks or update != "fresh":
        case = OP.case(batch=2, n_blocks=n_blocks, update=update, dim=7168)
        d = OP.make_inputs(case, 1, "cpu")
        with pytest.raises(emulate.EmulationError, match="before griddepcontrol.wait"):
            impl(case, pdl=True, early=True, declare=False)(d)


@pytest.mark.parametrize("cluster,vec", [(8, 2), (8, 8), (4, 4), (4, 8), (2, 8)])
def test_options(cluster, vec):
    """Every (cluster, vec) the kernel takes at D = 7168 (cluster 8 vec 8: 112 of 128 threads own columns; cluster 2
    vec 8: 448 threads)."""
    check(1, 9, "add", seed=cluster + vec, cluster=cluster, vec=vec)
    assert emulate.LAST["launches"][-1]["cluster"] == (cluster, 1, 1)


def test_options_cover_every_valid_pair():
    valid = []
    for c in kern.CLUSTERS:
        for v in kern.VECS:
            try:
                kern.plan(1, 7168, 9, c, v)
                valid.append((c, v))
            except ValueError:
                pass
    assert sorted(valid) == [(2, 8), (4, 4), (4, 8), (8, 2), (8, 4), (8, 8)]
    assert kern.plan(64, 7168, 9) == (8, 4)  # the kernel's own choice


# every (batch, cluster, vec) x n_blocks x update under `-m slow`; by default a Latin square of them (each config
# at every block count and each update at every block count and config once: 12 of the 36, for CI time)
_UPD = ("none", "add", "fresh")
_LARGE = [pytest.param(b, c, v, n, u, marks=() if u == _UPD[(i + j) % 3] else pytest.mark.slow)
          for i, (b, c, v) in enumerate([(1, 8, 8), (3, 4, 8), (5, 2, 8), (2, 8, 4)]) for j, n in enumerate((0, 1, 9))
          for u in _UPD]


@pytest.mark.parametrize("batch,cluster,vec,n_blocks,update", _LARGE)
def test_large_batch_options(batch, cluster, vec, n_blocks, update):
    """Cluster 8 / 4 / 2 with vec 8 and cluster 8 vec 4 (128 / 224 / 448 / 224 threads: 4 / 8 / 16 / 8 lanes a partial
    row at 9 blocks), odd batches, 0 / 1 / 9 blocks."""
    check(batch, n_blocks, update, seed=batch * 5 + n_blocks + len(update), cluster=cluster, vec=vec)
    got = emulate.LAST["launches"][-1]
    assert got["grid"] == (cluster, batch, 1) and got["block"] == kern.threads(7168, n_blocks, cluster, vec)
    assert got["block"] == {(8, 8): 128, (4, 8): 224, (2, 8): 448, (8, 4): 224}[(cluster, vec)]


@pytest.mark.parametrize("n_blocks,update", [(9, "add"), (1, "fresh")])
def test_cluster2_pdl_early(n_blocks, update):
    check(2, n_blocks, update, seed=17 + n_blocks, cluster=2, vec=8, pdl=True, early=True)


def test_row_lanes():
    """The lanes a partial row: 448 / 224 / 128 threads at 9 blocks (20 rows) take 16 / 8 / 4."""
    assert [kern.row_lanes(t, 20) for t in (448, 224, 128, 32)] == [16, 8, 4, 1]
    assert kern.n_partials(9) == 20 and kern.n_partials(0) == 2
    for T in range(32, 513, 32):
        for K in (2, 4, 12, 20):
            if K <= T:
                L = kern.row_lanes(T, K)
                assert L * K <= T and T % (4 * L) == 0


@pytest.mark.parametrize("batch,dim,n_blocks,update,launch", [
    (2, 64, 9, "add", ((8, 2, 1), 32)),     # the tiny preset's D: one thread of a CTA owns columns (20 partials
                                            # a thread, one warp, one lane a row)
    (1, 200, 5, "fresh", ((8, 1, 1), 32)),  # vec 1 (25 columns a CTA)
    (3, 100, 1, "add", ((4, 3, 1), 32)),    # a cluster of 4 (100 is no multiple of 8)
    (2, 1, 0, "none", ((1, 2, 1), 32)),     # no cluster at all
])
def test_odd_widths(batch, dim, n_blocks, update, launch):
    check(batch, n_blocks, update, dim=dim, seed=dim)
    got = emulate.LAST["launches"][-1]
    assert (got["grid"], got["block"]) == launch


def test_in_place_partial():
    """partial_out = prefix (the layer's in-place update): the same bits as the out-of-place call."""
    case = OP.case(batch=2, n_blocks=3, update="add", dim=7168)
    d = OP.make_inputs(case, 7, "cpu")
    want = OP.reference(d, case)
    blocks = [d[f"block{i}"] for i in range(3)]
    p = d["prefix"].clone()
    emulate.run_attnres(blocks, p, d["new"], d["w_norm"], d["w_proj"], d["norm_w"], d["out"], p, update="add")
    assert torch.equal(p.double(), want["partial_out"])
    err = (d["out"].double() - want["out"]).norm() / want["out"].norm()
    assert err < 4e-3


def _args(B=1, D=7168, n=1):
    t = [torch.randn(B, D).to(torch.bfloat16) for _ in range(n + 3)]
    w = [torch.ones(D, dtype=torch.bfloat16) for _ in range(3)]
    return dict(blocks=t[:n], prefix=t[n], new=t[n + 1], w_norm=w[0], w_proj=w[1], norm_w=w[2], out=t[n + 2],
                partial_out=t[n].clone())


@pytest.mark.parametrize("change,name", [
    (dict(cluster=3), "cluster"), (dict(vec=16), "vec"), (dict(cluster=1), "cluster"),
    (dict(cluster=1, vec=8), "cluster"), (dict(update="sum"), "update"), (dict(eps=0.0), "eps"),
])
def test_argument_errors(change, name):
    a = dict(_args(), update="add")
    a.update(change)
    with pytest.raises(ValueError, match=repr(name)):
        emulate.run_attnres(**a)


def test_tensor_errors_name_the_argument():
    a = _args()
    a["w_norm"] = a["w_norm"].float()
    with pytest.raises(ValueError, match="'w_norm'"):
        emulate.run_attnres(**a, update="add")
    a = _args(n=2)
    a["blocks"][1] = a["blocks"][1][:, :100]
    with pytest.raises(ValueError, match=r"'blocks\[1\]'"):
        emulate.run_attnres(**a, update="add")
    with pytest.raises(ValueError, match="'dim'"):
        kern.plan(1, 8191, 9)


@pytest.mark.parametrize("dim,kept", [(256, True), (40, False)])
def test_auto_rule_options_fit_or_give_way(monkeypatch, dim, kept):
    """`auto`'s AttnRes rule names cluster / vec (measured at dim 7168): a dim they fit keeps them, one
    they do not (a small test model) runs the kernel's own choice, and the record's `why` says so."""
    from k3lab.components import attnres, dispatch

    seen = {}
    monkeypatch.setattr(dispatch, "select", lambda op, be, B: ("cute", {"cluster": 2, "vec": 8},
                                                              "measured rule"))
    monkeypatch.setattr(dispatch, "kernel", lambda op, be: (lambda *a, **kw: seen.update(kw)))
    g = torch.Generator().manual_seed(0)
    blocks = [torch.randn(2, dim, generator=g).to(torch.bfloat16) for _ in range(3)]
    prefix = torch.randn(2, dim, generator=g).to(torch.bfloat16)
    w = torch.randn(dim, generator=g).to(torch.bfloat16)
    ran = []
    attnres.update_mix_norm(blocks, prefix, None, w, w, w, update="none", backend="auto", ran=ran)
    if kept:
        assert seen["cluster"] == 2 and seen["vec"] == 8
        assert "do not fit" not in ran[-1].why
    else:
        assert "cluster" not in seen and "vec" not in seen and "do not fit" in ran[-1].why
