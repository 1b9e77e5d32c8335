"""The CuTe DSL AttnRes + RMSNorm kernel (kernels/cute/attnres_norm.py) through the component API (backend "cute")
against the fp64 reference, on the GPU.

Needs nvidia-cutlass-dsl and a CUDA GPU of compute capability >= 9.0; skipped cleanly otherwise. The shared checker
(k3lab.harness.checker) runs `attnres.update_mix_norm` on fresh random inputs with out and partial_out poisoned:
partial_out bit-exact, out relative-norm error < 4e-3, inputs unchanged (tolerances: k3lab/ops/trunk.py). Then
the partial sum's bits against the triton backend, every (cluster, vec) the kernel takes at D = 7168, strided
rows, the in-place partial and mix_norm; the large-batch options (alpha "threads" with cluster 8 / 4 and vec 8 or
4, "twopass" with cluster 8 / 4 / 2) at batch 32, 33, 64 against fp64 and the partial's bits against triton.
"""
import pytest
import torch
from cute_gate import require_cute_gpu

pytestmark = [pytest.mark.cute, pytest.mark.gpu]
require_cute_gpu()

from k3lab import registry  # noqa: E402
from k3lab.components import attnres  # noqa: E402
from k3lab.harness import checker  # noqa: E402
from k3lab.ops import trunk as ops  # noqa: E402

OP = registry.get("attnres_norm")


def check(batch, n_blocks, update, dim=7168, seed=0, **options):
    case = OP.case(batch=batch, n_blocks=n_blocks, update=update, dim=dim)
    return checker.require(checker.check(OP, case, backend="cute", options=options, seed=seed, device="cuda"))


@pytest.mark.parametrize("update", ops.UPDATES)
@pytest.mark.parametrize("n_blocks", [0, 1, 5, 9])
@pytest.mark.parametrize("batch", [1, 2, 5, 16, 64])
def test_attnres_cute_matches_fp64(batch, n_blocks, update):
    check(batch, n_blocks, update, seed=batch * 10 + n_blocks)


@pytest.mark.parametrize("cluster,vec", [(8, 2), (8, 4), (8, 8), (4, 4), (4, 8)])
@pytest.mark.parametrize("batch", [1, 64])
def test_attnres_cute_options(batch, cluster, vec):
    check(batch, 9, "add", seed=cluster * vec, cluster=cluster, vec=vec)


LARGE = [dict(alpha="threads", cluster=8, vec=8), dict(alpha="threads", cluster=4, vec=8),
         dict(alpha="threads", cluster=8, vec=4), dict(alpha="threads")]
# alpha "twopass" (two exchanges: the scores' sums, then the mix's): the same checks as "threads"
TWOPASS = [dict(alpha="twopass", cluster=2, vec=8), dict(alpha="twopass", cluster=4, vec=8),
           dict(alpha="twopass", cluster=8, vec=8), dict(alpha="twopass")]


@pytest.mark.parametrize("update", ops.UPDATES)
@pytest.mark.parametrize("opts", LARGE + TWOPASS, ids=lambda o: "-".join(f"{k}{v}" for k, v in o.items()))
@pytest.mark.parametrize("batch", [32, 64, 33, 1])
def test_attnres_cute_large(batch, opts, update):
    """The large-batch options (both forms) against fp64 at batch 32 / 64 (and odd 33, 1), every update."""
    check(batch, 9, update, seed=batch + len(update), **opts)


@pytest.mark.parametrize("n_blocks", [0, 1, 5])
@pytest.mark.parametrize("opts", LARGE[:3] + TWOPASS[:1], ids=lambda o: "-".join(f"{k}{v}" for k, v in o.items()))
def test_attnres_cute_large_blocks(opts, n_blocks):
    check(5, n_blocks, "add", seed=n_blocks, **opts)


@pytest.mark.parametrize("update", ["add", "fresh"])
@pytest.mark.parametrize("opts", LARGE + TWOPASS[:1], ids=lambda o: "-".join(f"{k}{v}" for k, v in o.items()))
@pytest.mark.parametrize("batch", [32, 64])
def test_attnres_cute_large_partial_bits_match_triton(batch, opts, update):
    """The large-batch options: the stored partial bit-equal to the triton backend's, out within 4e-3 of it."""
    case = OP.case(batch=batch, n_blocks=9, update=update, dim=7168)
    d = OP.make_inputs(case, 5, "cuda")
    got = {}
    for be, o in (("triton", {}), ("cute", opts)):
        d["out"].fill_(float("nan"))
        d["partial_out"].fill_(float("nan"))
        ran = []
        ops.call_attnres(d, case, be, o, ran)
        assert ran[-1].backend == be
        got[be] = (d["out"].clone(), d["partial_out"].clone())
    assert torch.equal(got["cute"][1].view(torch.int16), got["triton"][1].view(torch.int16))
    a, b = got["cute"][0].double(), got["triton"][0].double()
    assert ((a - b).norm() / b.norm()).item() < 4e-3


@pytest.mark.parametrize("dim", [64, 200, 1, 300])
def test_attnres_cute_odd_widths(dim):
    check(3, 9, "add", dim=dim, seed=dim)


@pytest.mark.parametrize("update", ["add", "fresh"])
@pytest.mark.parametrize("batch", [1, 7, 64])
def test_attnres_cute_partial_bits_match_triton(batch, update):
    """The stored partial sum: the same bits as the triton backend's (and the fp64 reference's), out close."""
    case = OP.case(batch=batch, n_blocks=9, update=update, dim=7168)
    d = OP.make_inputs(case, 3, "cuda")
    got = {}
    for be in ("triton", "cute"):
        d["out"].fill_(float("nan"))
        d["partial_out"].fill_(float("nan"))
        ops.call_attnres(d, case, be, {})
        got[be] = (d["out"].clone(), d["partial_out"].clone())
    assert torch.equal(got["cute"][1].view(torch.int16), got["triton"][1].view(torch.int16))
    want = OP.reference(d, case)
    assert torch.equal(got["cute"][1].double(), want["partial_out"])
    a, b = got["cute"][0].double(), got["triton"][0].double()
    assert ((a - b).norm() / b.norm()).item() < 4e-3


@pytest.mark.parametrize("update", ["add", "none", "fresh"])
def test_attnres_cute_early_in_a_pdl_chain(update, monkeypatch):
    """EARLY (the blocks and the prefix read before griddepcontrol.wait) inside a pdl chain where the kernel just
    before rewrites `new` each round (a CuTe GEMV, as out_proj does in the step): every round's out and partial_out
    equal the plain launch's on the same inputs, bit for bit."""
    from k3lab.components import trunk
    from k3lab_kernels.cute import attnres_norm as ka
    from k3lab_kernels.triton.pdl import pdl_chain

    case = OP.case(batch=1, n_blocks=9, update=update, dim=7168)
    d = OP.make_inputs(case, 4, "cuda")
    g = torch.Generator("cuda").manual_seed(5)
    w = (torch.randn(7168, 1536, device="cuda", generator=g) / 40).to(torch.bfloat16)
    xs = [torch.randn(1, 1536, device="cuda", generator=g).to(torch.bfloat16) for _ in range(4)]
    # the GEMV's output: `new` (add / fresh), a scratch row with update "none" (its mix reads no new)
    tgt = d["new"] if update != "none" else torch.empty(1, 7168, dtype=torch.bfloat16, device="cuda")
    runs = {}
    for early in (False, True):
        monkeypatch.setattr(ka, "EARLY", early)
        outs = []
        with pdl_chain(True):
            for x in xs:
                trunk.proj(x, w, tgt, backend="cute")
                d["out"].fill_(float("nan"))
                d["partial_out"].fill_(float("nan"))
                ops.call_attnres(d, case, "cute", {})
                outs.append((d["out"].clone(), d["partial_out"].clone()))
        runs[early] = outs
    torch.cuda.synchronize()
    for (o0, p0), (o1, p1) in zip(runs[False], runs[True]):
        assert torch.isfinite(o1.float()).all() and torch.equal(o0, o1) and torch.equal(p0, p1)


def test_attnres_cute_strided_rows_and_in_place():
    """Blocks as views of one [B, n, D] buffer (row stride n D), the partial updated in place, out strided."""
    B, n, D = 5, 9, 7168
    case = OP.case(batch=B, n_blocks=n, update="add", dim=D)
    d = OP.make_inputs(case, 11, "cuda")
    want = OP.reference(d, case)
    stack = torch.stack([d[f"block{i}"] for i in range(n)], 1)  # [B, n, D]
    blocks = [stack[:, i] for i in range(n)]
    p = d["prefix"].clone()
    wide = torch.full((B, 2 * D), float("nan"), dtype=torch.bfloat16, device="cuda")
    out = wide[:, :D]
    ran = []
    attnres.update_mix_norm(blocks, p, d["new"], d["w_norm"], d["w_proj"], d["norm_w"], out=out, partial_out=p,
                            update="add", backend="cute", ran=ran)
    assert ran[-1].backend == "cute" and ran[-1].kernel.endswith("cute.attnres_norm:attnres_norm")
    assert torch.equal(p.double(), want["partial_out"])
    assert ((out.double() - want["out"]).norm() / want["out"].norm()).item() < 4e-3
    y = attnres.mix_norm(blocks, p, d["w_norm"], d["w_proj"], d["norm_w"], backend="cute")
    assert ((y.double() - want["out"]).norm() / want["out"].norm()).item() < 4e-3


def test_attnres_cute_option_errors():
    case = OP.case(batch=1, n_blocks=1, update="add", dim=7168)
    d = OP.make_inputs(case, 0, "cuda")
    with pytest.raises(ValueError, match="'cluster'"):
        ops.call_attnres(d, case, "cute", dict(cluster=1))  # 7168 columns of one CTA: 896 threads even at vec 8
    with pytest.raises(ValueError, match="'vec'"):
        ops.call_attnres(d, case, "triton", dict(vec=4))
    with pytest.raises(ValueError, match="'num_warps'"):
        ops.call_attnres(d, case, "cute", dict(num_warps=4))
    with pytest.raises(ValueError, match="'alpha'"):
        ops.call_attnres(d, case, "cute", dict(alpha="fast"))
    with pytest.raises(ValueError, match="'alpha'"):
        ops.call_attnres(d, case, "triton", dict(alpha="threads"))
    with pytest.raises(ValueError, match="'alpha'"):
        ops.call_attnres(d, case, "cute", dict(alpha="warp"))  # retired (git history)
    with pytest.raises(ValueError, match="'cluster'"):
        ops.call_attnres(d, case, "cute", dict(cluster=2, alpha="threads"))  # 448 threads of vec 8: not with "threads"
