"""The grouped CuTe DSL MoE experts (kernels/cute/moe_grouped.py: MXFP4 on tensor-core fragments, several tokens) on
the CPU emulator (tests/cute_emulate.py, which models the f16 m16n8k16 MMA and the decode PTX): the kernels' logic
without a GPU or nvidia-cutlass-dsl, through the shared checker (fresh inputs, y poisoned, the fp64 reference on the
dequantized weights, the registry's MXFP4 tolerance). Cases: ragged routing over a small pool (experts with zero, one
and several tokens), every token on the same experts at 9 tokens (a group of 9: two member tiles of the MMA's 8),
int32 and int64 ids, pdl, both shapes of the kernels (few pairs: FEW_UP_SPLIT warps an up tile over parts of L,
FEW_DOWN_TILES a warp; more pairs: a warp an up tile, DOWN_TILES a warp; there the groups of 9 share their work among
their members' CTAs: up in 2 shares of the row block, down in 4 of a warp's tiles, two member tiles), W1 / W3
quad-transposed; a token that lists an expert twice; then what the wrapper refuses, by name."""
import pytest
import torch

import cute_emulate as emulate
from k3lab import registry
from k3lab.harness import checker
from k3lab.ops import moe as ops_moe

pytestmark = pytest.mark.cute_emu
OP = registry.get("moe_experts")
# latent 256 (four down CTAs of 64 rows in the few-pairs shape), intermediate 64 (one up CTA of 64 rows, two of 32 in
# the few-pairs shape); the other shape's down CTA takes 64 DOWN_TILES = 512 latent rows (LARGE)
SMALL = dict(dtype="mxfp4", batch=3, tp=1, latent=256, inter=64, n_experts=8, top_k=3, routing="ragged")
LARGE = 512


def run(z, idx, wk, moe, y, pdl=False, seed=0, few=True, settings=None):
    quad2 = moe.w2.data.shape[-1] % 64 == 0  # W2 quad-transposed where I % 128 == 0, as the component passes it
    t = emulate.moe_tensors(z, idx, wk, moe, y, quad_up=True, quad_down=quad2)
    emulate._PDL["early"] = frozenset()  # neither kernel reads anything before its wait

    def call(m, **a):
        mod = m.mod["moe_grouped"]
        mod.FEW_PAIRS = 10 ** 6 if few else 0
        # the defaults, then the case's
        for k, v in {"SHARE_FROM": 4, "UP_UNROLL": 8, "UP_LSPLIT": "auto", "UP_SHARE": 4,
                     **(settings or {})}.items():
            setattr(mod, k, v)
        mod.moe_grouped(a["z"], a["idx"], a["wk"], a["w1"], a["w3"], a["w2"], a["s1"], a["s3"], a["s2"], a["y"],
                        b1=float(moe.b1), b2=float(moe.b2), pdl=pdl, w2_quad=quad2)
    emulate._run(call, t, seed)


def impl(pdl=False, idx32=False, few=True, settings=None):
    def f(d):
        idx = d["idx"].to(torch.int32) if idx32 else d["idx"]
        run(d["z"], idx, d["weights_k"], d["moe"], d["y"], pdl=pdl, few=few, settings=settings)
    f.__name__ = f"emulated cute moe_grouped(pdl={pdl}, int32 ids={idx32}, few-pairs shape={few}, {settings or {}})"
    return f


@pytest.mark.parametrize("few", [True, False])
@pytest.mark.parametrize("pdl,idx32,shape", [
    (True, True, SMALL),
    (False, False, dict(SMALL, batch=9, routing="same16", n_experts=4))])
def test_grouped(pdl, idx32, shape, few):
    # the other shape at 2 blocks of W2 a row (a scale word a block) and at 4 (one scale word a row)
    shape = shape if few else dict(shape, latent=LARGE, inter=64 if pdl else 128)
    checker.require(checker.check(OP, OP.case(**shape), impl=impl(pdl, idx32, few), seed=int(pdl), device="cpu"))
    launches = emulate.LAST["launches"]
    assert [x["use_pdl"] for x in launches[-2:]] == [pdl, True]  # down always waits for up's activations
    pairs = shape["batch"] * shape["top_k"]
    up_rows, down_rows = (32, 64) if few else (64, 512)  # FEW_UP_SPLIT 2, FEW_DOWN_TILES 1; else DOWN_TILES 8
    assert launches[-2]["grid"][0] == pairs * (shape["inter"] // up_rows)
    assert launches[-1]["grid"][0] == pairs * (shape["latent"] // down_rows)


@pytest.mark.parametrize("lsplit", [True, False])
def test_up_lsplit(lsplit):
    """UP_LSPLIT: a shared group's h up CTAs each run every tile of the row block over their part of L (staging only
    that part of z), the parts joined through the global workspace by the CTA whose ticket comes last, in rank order;
    groups of 9 in member tiles of 8, and the tickets are zero again after the call (a second call passes);
    False: the shares by tiles (every CTA stages all of z)."""
    shape = dict(SMALL, batch=9, routing="same16", n_experts=4, latent=LARGE, inter=128)
    settings = {"UP_LSPLIT": lsplit}
    for seed in (3, 4):
        checker.require(checker.check(OP, OP.case(**shape), impl=impl(few=False, settings=settings), seed=seed,
                                      device="cpu"))


def test_more_than_one_round_of_pairs():
    """More than 128 pairs: the group listing's second round of ids (its offsets summed across rounds)."""
    shape = dict(SMALL, batch=43)  # 129 pairs over 8 experts: groups of ~16, two or three member tiles
    checker.require(checker.check(OP, OP.case(**shape), impl=impl(), seed=5, device="cpu"))


def test_repeated_id():
    """A token that lists an expert twice adds it twice (each time with its weight), as the reference does."""
    case = OP.case(**SMALL)
    d = OP.make_inputs(case, 4, "cpu")
    d["idx"][1, 2] = d["idx"][1, 0]
    want = ops_moe.ref_experts({k: (v.double() if isinstance(v, torch.Tensor) and v.is_floating_point() else v)
                                for k, v in d.items()}, case)["y"]
    y = torch.full_like(d["y"], float("nan"))
    run(d["z"], d["idx"], d["weights_k"], d["moe"], y)
    assert float((y.double() - want).norm() / want.norm()) < ops_moe.TOL


def test_refused_by_name():
    d = OP.make_inputs(OP.case(**SMALL), 0, "cpu")
    with pytest.raises(ValueError, match="latent % 64 "):
        run(d["z"][:, :96].contiguous(), d["idx"], d["weights_k"], d["moe"], d["y"])
    with pytest.raises(ValueError, match="latent % 512 "):  # 256 rows: the few-pairs shape only
        run(d["z"], d["idx"], d["weights_k"], d["moe"], d["y"], few=False)
    with pytest.raises(ValueError, match="'wk' must have dtype"):
        run(d["z"], d["idx"], d["weights_k"].double(), d["moe"], d["y"])
    with pytest.raises(ValueError, match="'w2_quad' needs the intermediate a multiple of 128"):  # I = 64
        t = emulate.moe_tensors(d["z"], d["idx"], d["weights_k"], d["moe"], d["y"], quad_up=True)
        emulate._run(lambda m, **a: m.mod["moe_grouped"].moe_grouped(
            a["z"], a["idx"], a["wk"], a["w1"], a["w3"], a["w2"], a["s1"], a["s3"], a["s2"], a["y"], w2_quad=True),
            t, 0)
    with pytest.raises(ValueError, match="'SHARE_FROM' .* must be a positive int"):
        run(d["z"], d["idx"], d["weights_k"], d["moe"], d["y"], settings={"SHARE_FROM": 0})
    with pytest.raises(ValueError, match="'UP_UNROLL' .* must be a positive multiple of 4, got 2"):
        run(d["z"], d["idx"], d["weights_k"], d["moe"], d["y"], settings={"UP_UNROLL": 2})
    with pytest.raises(ValueError, match="'UP_LSPLIT' .* must be True, False or 'auto', got 1"):
        run(d["z"], d["idx"], d["weights_k"], d["moe"], d["y"], settings={"UP_LSPLIT": 1})
    with pytest.raises(ValueError, match="'UP_SHARE' .* must be 1, 2 or 4 .*, got 8"):
        run(d["z"], d["idx"], d["weights_k"], d["moe"], d["y"], settings={"UP_SHARE": 8})
    with pytest.raises(ValueError, match="'pdl' must be None or a bool"):
        run(d["z"], d["idx"], d["weights_k"], d["moe"], d["y"], pdl=1)


def test_share_config():
    """The shares a kernel is compiled for: powers of two; up's only where a warp a tile runs (split 1) and each of
    a tile's warps gets a step of L; down's dividing the warp's tiles (else a share would skip tiles)."""
    from k3lab_kernels.cute import moe_grouped as mg  # the host module imports without nvidia-cutlass-dsl
    assert mg.share_config(3584, 1, 8) == (4, 4) == mg.share_config(3584, 1, 8, 8 * 16)
    assert mg.share_config(3584, 1, 8, 16 * 16) == (2, 4)   # up shares of 2 from batch 16 (measured, module doc)
    assert mg.share_config(3584, 2, 1) == (1, 1)     # the few-pairs shape
    assert mg.share_config(256, 1, 8)[0] == 1        # one step of 8 blocks over L: nothing to split
    for tiles in range(1, 17):
        up, down = mg.share_config(3584, 1, tiles)
        assert tiles % down == 0 and down & (down - 1) == 0 and down <= mg.DOWN_SHARE
