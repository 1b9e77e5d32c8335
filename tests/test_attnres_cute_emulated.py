"""The CuTe DSL AttnRes + RMSNorm kernel (kernels/cute/attnres_norm.py) on the CPU emulator (tests/cute_emulate.py):
its logic checked without a GPU or nvidia-cutlass-dsl, as TRITON_INTERPRET=1 checks the Triton kernel.

The checks are the shared checker's (k3lab.harness.checker: fresh inputs of the registry's `attnres_norm`, out and
partial_out poisoned with NaN, the fp64 reference; partial_out bit-exact, out < 4e-3, inputs unchanged), with the
emulator's entry point as the implementation and CPU tensors: D = 7168 (the model's) at batch 1 and 2, 0 / 1 / 9
blocks and every update mode, every (cluster, vec) the kernel takes at D = 7168, odd widths (clusters of 1 and
4, vec 1, idle threads), the in-place partial, and the argument errors by name; alpha "threads" at the
large-batch shapes it takes (batch 1, 3 and 5 with cluster 8 / 4 and vec 8, cluster 8 vec 4), 0 / 1 / 9 blocks, every
update mode; alpha "twopass" likewise (cluster 2 vec 8 too), with odd widths and under pdl with the early reads.
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
    """D = 7168 at the default options (alpha twopass, cluster 8, vec 4: 224 threads a CTA), batch 2 (two clusters)."""
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


@pytest.mark.parametrize("cluster,vec", [(8, 2), (8, 8), (4, 4), (4, 8)])
def test_options(cluster, vec):
    """Every (cluster, vec) the kernel takes at D = 7168 (cluster 8 vec 8: 112 of 128 threads own columns)."""
    check(1, 9, "add", seed=cluster + vec, cluster=cluster, vec=vec)
    assert emulate.LAST["launches"][-1]["cluster"] == (cluster, 1, 1)


def test_options_cover_every_valid_pair():
    valid = []
    for c in kern.CLUSTERS:
        for v in kern.VECS:
            try:
                kern.plan(1, 7168, 9, c, v, alpha="threads")
                valid.append((c, v))
            except ValueError:
                pass
    assert sorted(valid) == [(4, 4), (4, 8), (8, 2), (8, 4), (8, 8)]


# every (batch, cluster, vec) x n_blocks x update under `-m slow`; by default a Latin square of them (each config
# at every block count and each update at every block count and config once: 9 of the 27, for CI time)
_UPD = ("none", "add", "fresh")
_ALPHA_THREADS = [pytest.param(b, c, v, n, u, marks=() if u == _UPD[(i + j) % 3] else pytest.mark.slow)
                  for i, (b, c, v) in enumerate([(1, 8, 8), (3, 4, 8), (5, 8, 4)]) for j, n in enumerate((0, 1, 9))
                  for u in _UPD]


@pytest.mark.parametrize("batch,cluster,vec,n_blocks,update", _ALPHA_THREADS)
def test_alpha_threads_large(batch, cluster, vec, n_blocks, update):
    """alpha "threads" (the Gram matrix in one exchange, every thread forming alpha and the norm) at the
    large-batch shapes it takes: cluster 8 / 4 with vec 8 and cluster 8 vec 4 (128 / 224 / 224 threads a CTA; vec 8
    is capped at 256 threads there), odd batches."""
    check(batch, n_blocks, update, seed=batch * 7 + n_blocks + len(update), cluster=cluster, vec=vec, alpha="threads")
    got = emulate.LAST["launches"][-1]
    assert got["grid"] == (cluster, batch, 1) and got["block"] == kern.threads(7168, n_blocks, cluster, vec)
    assert got["block"] == {(8, 8): 128, (4, 8): 224, (8, 4): 224}[(cluster, vec)]


def test_alpha_threads_default_options():
    """alpha "threads" with cluster / vec None: the default choice (cluster 8, vec 4, whatever the blocks), batch 3,
    two blocks (nine at these options: test_alpha_threads_large)."""
    check(3, 2, "add", seed=31, alpha="threads")
    got = emulate.LAST["launches"][-1]
    assert got["grid"] == (8, 3, 1) and got["block"] == 224


def test_alpha_threads_odd_width():
    """alpha "threads" where NS exceeds a vec's threads' work: D = 64 (one thread of a CTA owns columns)."""
    check(3, 9, "fresh", dim=64, seed=64, alpha="threads")


def test_alpha_pairs():
    """alpha "twopass" (and None) allows vec 8 up to 512 threads a CTA: cluster 2 vec 8 at D = 7168 (448 threads),
    which "threads" refuses; "warp" (retired) is refused by name."""
    valid = [(c, v) for c in kern.CLUSTERS for v in kern.VECS if _plans(c, v, "twopass")]
    assert sorted(valid) == [(2, 8), (4, 4), (4, 8), (8, 2), (8, 4), (8, 8)]
    assert [(c, v) for c, v in valid if not _plans(c, v, "threads")] == [(2, 8)]
    assert kern.plan(64, 7168, 9) == kern.plan(64, 7168, 9, alpha="twopass") == (8, 4)  # the defaults unchanged
    with pytest.raises(ValueError, match="'alpha'"):
        kern.plan(64, 7168, 9, alpha="warp")


# alpha "twopass": the scores' sums (2 NS partials a thread) in one exchange, warp 0's alpha, then the mix's sum of
# squares in a second (a butterfly a warp, the warps in order, one more cluster barrier)
_TWOPASS = [pytest.param(b, c, v, n, u, marks=() if u == _UPD[(i + j) % 3] else pytest.mark.slow)
            for i, (b, c, v) in enumerate([(1, 8, 8), (3, 4, 8), (5, 2, 8), (2, 8, 4)]) for j, n in enumerate((0, 1, 9))
            for u in _UPD]


@pytest.mark.parametrize("batch,cluster,vec,n_blocks,update", _TWOPASS)
def test_alpha_twopass(batch, cluster, vec, n_blocks, update):
    """alpha "twopass" at cluster 8 / 4 / 2 with vec 8 and cluster 8 vec 4 (128 / 224 / 448 / 224 threads: 4 / 8 /
    16 / 8 lanes a partial row at 9 blocks), odd batches, 0 / 1 / 9 blocks."""
    check(batch, n_blocks, update, seed=batch * 5 + n_blocks + len(update), cluster=cluster, vec=vec,
          alpha="twopass")
    got = emulate.LAST["launches"][-1]
    assert got["grid"] == (cluster, batch, 1) and got["block"] == kern.threads(7168, n_blocks, cluster, vec, "twopass")


@pytest.mark.parametrize("dim,n_blocks,update", [(64, 9, "add"), (200, 5, "fresh"), (1, 0, "none")])
def test_alpha_twopass_odd_widths(dim, n_blocks, update):
    """"twopass" where few threads own columns (one lane a row at 32 threads), vec 1, no cluster at all."""
    check(3, n_blocks, update, dim=dim, seed=dim + 1, alpha="twopass")


@pytest.mark.parametrize("n_blocks,update", [(9, "add"), (1, "fresh")])
def test_alpha_twopass_pdl_early(n_blocks, update):
    check(2, n_blocks, update, seed=17 + n_blocks, cluster=2, vec=8, alpha="twopass", pdl=True, early=True)


def test_row_lanes():
    """The lanes a partial row under "twopass": 448 / 224 / 128 threads at 9 blocks (20 rows) take 16 / 8 / 4."""
    assert [kern.row_lanes(t, 20) for t in (448, 224, 128, 32)] == [16, 8, 4, 1]
    assert kern.n_partials(9, "twopass") == 20 and kern.n_partials(9) == 65
    for T in range(32, 513, 32):
        for K in (2, 4, 12, 20):
            if K <= T:
                L = kern.row_lanes(T, K)
                assert L * K <= T and T % (4 * L) == 0


def _plans(c, v, alpha):
    try:
        kern.plan(1, 7168, 9, c, v, alpha=alpha)
        return True
    except ValueError:
        return False


@pytest.mark.parametrize("batch,dim,n_blocks,update,launch", [
    (2, 64, 9, "add", ((8, 2, 1), 32)),     # the tiny preset's D: one thread of a CTA owns columns (twopass: 20
                                            # partials a thread, one warp)
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
    (dict(cluster=2, alpha="threads"), "cluster"),
    (dict(update="sum"), "update"), (dict(eps=0.0), "eps"), (dict(alpha="fast"), "alpha"),
    (dict(alpha="twopass", cluster=1), "cluster"), (dict(alpha="warp"), "alpha"),
])
def test_argument_errors(change, name):
    a = dict(_args(), update="add")
    a.update(change)
    with pytest.raises(ValueError, match=repr(name)):
        emulate.run_attnres(**a)


def test_component_refuses_alpha_by_name():
    """The component API checks `alpha` before it dispatches (no GPU needed to refuse it)."""
    from k3lab.components import attnres
    a = _args()
    with pytest.raises(ValueError, match="'alpha'"):
        attnres.update_mix_norm(a["blocks"], a["prefix"], a["new"], a["w_norm"], a["w_proj"], a["norm_w"],
                                update="add", backend="cute", alpha="fast")


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
    """`auto`'s AttnRes rule names cluster / vec / alpha (measured at dim 7168): a dim they fit keeps them, one
    they do not (a small test model) runs the kernel's own choice, and the record's `why` says so."""
    from k3lab.components import attnres, dispatch

    seen = {}
    monkeypatch.setattr(dispatch, "select", lambda op, be, B: ("cute", {"cluster": 2, "vec": 8, "alpha": "twopass"},
                                                              "measured rule"))
    monkeypatch.setattr(dispatch, "kernel", lambda op, be: (lambda *a, **kw: seen.update(kw)))
    g = torch.Generator().manual_seed(0)
    blocks = [torch.randn(2, dim, generator=g).to(torch.bfloat16) for _ in range(3)]
    prefix = torch.randn(2, dim, generator=g).to(torch.bfloat16)
    w = torch.randn(dim, generator=g).to(torch.bfloat16)
    ran = []
    attnres.update_mix_norm(blocks, prefix, None, w, w, w, update="none", backend="auto", ran=ran)
    if kept:
        assert seen["cluster"] == 2 and seen["vec"] == 8 and seen["alpha"] == "twopass"
        assert "do not fit" not in ran[-1].why
    else:
        assert "cluster" not in seen and "vec" not in seen and "do not fit" in ran[-1].why
