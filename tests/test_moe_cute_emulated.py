"""The CuTe DSL MoE experts of one token (kernels/cute/moe_experts.py) on the CPU emulator (tests/cute_emulate.py):
their logic without a GPU or nvidia-cutlass-dsl, through the shared checker (fresh inputs, output poisoned, the fp64
reference on the dequantized weights, the registry's MXFP4 tolerance), at a small pool (latent and intermediate
128: a partial last round of blocks a lane in both launches; latent 1152 and intermediate 384: a full round and a
partial one in both) with int64 and int32 ids, the routing weights and
pdl; the integer / f16x2 PTX as the emulator models it, bit for bit against the Triton simt path's interpreter twin;
then what the wrapper refuses, by name."""
import pytest
import torch

import cute_emulate as emulate
from k3lab import registry
from k3lab.harness import checker

pytestmark = pytest.mark.cute_emu
OP = registry.get("moe_experts")
SMALL = dict(dtype="mxfp4", batch=1, tp=1, latent=128, inter=128, n_experts=6, top_k=3, routing="uniform")
# latent 1152: 36 blocks a row of w1 / w3 (one full round of 32 lanes and a partial one); I 384, three pairs: 36 (pair,
# block) products in the down kernel (a full round and a partial one)
ROUNDS = dict(SMALL, latent=1152, inter=384)
# intermediate 96: three scale bytes a w2 row (rows straddle 32-bit words, as TP16's 192 does with six)
ODD = dict(SMALL, inter=96, n_experts=4)
# latent 512: 16 blocks a row, so the up kernel runs UP_HALVES groups of 16 threads (one warp, split at lane 16)
HALF = dict(SMALL, latent=512, inter=96, n_experts=4)


def run(z, idx, wk, moe, y, pdl=False, seed=0, rows=None, glue=None, settings=None):
    t = emulate.moe_tensors(z, idx, wk, moe, y)
    if glue is not None:
        t.update(gam=glue[0], yg=glue[1], ssp=glue[2])
    emulate._PDL["early"] = frozenset()  # no tensor may be read before a kernel's griddepcontrol.wait

    def call(m, **a):
        mod = m.mod["moe_experts"]
        saved = mod.DOWN_ROWS, mod.UP_ROWS
        old = {k: getattr(mod, k) for k in (settings or {})}
        if rows:  # both kernels' rows a CTA
            mod.DOWN_ROWS, mod.UP_ROWS = rows, rows
        for k, v in (settings or {}).items():  # module settings, set inside the run (the emulator reloads the module)
            setattr(mod, k, v)
        try:
            mod.moe_experts(a["z"], a["idx"], a["wk"], a["w1"], a["w3"], a["w2"], a["s1"], a["s3"], a["s2"], a["y"],
                            b1=moe.shared[0].b1 if moe.shared else 4.0, b2=moe.shared[0].b2 if moe.shared else 25.0,
                            pdl=pdl, glue=None if glue is None else (a["gam"], a["yg"], a["ssp"]))
        finally:
            mod.DOWN_ROWS, mod.UP_ROWS = saved
            for k, v in old.items():
                setattr(mod, k, v)
    emulate._run(call, t, seed)
    return t


def impl(pdl=False, idx32=False, rows=None, settings=None):
    def f(d):
        idx = d["idx"].to(torch.int32) if idx32 else d["idx"]
        run(d["z"], idx, d["weights_k"], d["moe"], d["y"], pdl=pdl, rows=rows, settings=settings)
    f.__name__ = f"emulated cute moe_experts(pdl={pdl}, int32 ids={idx32}, rows a CTA={rows}, {settings})"
    return f


# the down kernel's CTA: K * I/32 product threads rounded up to whole warps (SMALL: 12 of 32, ODD: 9; ROUNDS: 36 of
# 64), DOWN_ROWS latent rows; the up kernel's: L/32 block threads (SMALL: 4 of 32; ROUNDS: 36 of 64), UP_ROWS rows
# of W1 and W3 (ODD at 8 rows for both, ROUNDS at 2 for both)
@pytest.mark.parametrize("pdl,idx32,shape,rows", [
    (True, True, SMALL, None), (False, False, ODD, 8),
    (False, True, ODD, None),  # the default rows a CTA on a shape they divide (I 96: UP_ROWS 6; L 128: DOWN_ROWS 8)
    (True, True, HALF, None),  # the up kernel's two thread groups (UP_HALVES), each 3 rows of W1 and of W3
    pytest.param(False, True, SMALL, None, marks=pytest.mark.slow),  # CI's 10 minutes: pdl and int64 ids run above
    pytest.param(True, False, ROUNDS, 2, marks=pytest.mark.slow)])  # ~1 min
def test_one_token(pdl, idx32, shape, rows):
    checker.require(checker.check(OP, OP.case(**shape), impl=impl(pdl, idx32, rows=rows), seed=int(pdl),
                                  device="cpu"))
    launches = emulate.LAST["launches"]
    assert [x["use_pdl"] for x in launches[-2:]] == [pdl, True]  # down always waits for up's activations
    nt = -(-shape["top_k"] * shape["inter"] // shape["tp"] // 32 // 32) * 32
    from k3lab_kernels.cute import moe_experts as km

    down = rows or (km.DOWN_ROWS if shape["latent"] % km.DOWN_ROWS == 0 else 1)
    assert launches[-1]["block"] == nt and launches[-1]["grid"][0] == shape["latent"] // down
    inter = shape["inter"] // shape["tp"]
    up = rows or (km.UP_ROWS if inter % km.UP_ROWS == 0 else 4)
    nb = shape["latent"] // 32
    halves = km.UP_HALVES if nb % 16 == 0 and up % km.UP_HALVES == 0 else 1
    assert launches[-2]["block"] == -(-halves * nb // 32) * 32
    assert launches[-2]["grid"][0] == shape["top_k"] * inter // up


def test_glue_outputs():
    """With `glue` the down kernel also writes yg = bf16(y gamma) and one partial sum of y^2 a CTA (the MoE output's
    routed norm folded, k3lab.step.moe_glue_fold): yg equal to y (as written) times gamma rounded once, the partials
    equal to each CTA's rows' squares summed (fp32, a shuffle tree: within 1e-6); y itself is the checked output of
    test_one_token (the option adds stores after it)."""
    c = OP.case(**SMALL)
    d = OP.make_inputs(c, 3, "cpu")
    L = d["z"].shape[1]
    gam = (1 + 0.1 * torch.randn(L, generator=torch.Generator().manual_seed(2))).to(torch.bfloat16)
    yg = torch.full((1, L + 8), float("nan"), dtype=torch.bfloat16)[:, :L]  # a column slice of a wider buffer
    from k3lab_kernels.cute.moe_experts import glue_partials

    P = glue_partials(L)
    ssp = torch.full((1, P), float("nan"))
    y1 = torch.full_like(d["y"], float("nan"))
    run(d["z"], d["idx"], d["weights_k"], d["moe"], y1, seed=2, glue=(gam, yg, ssp))
    assert torch.isfinite(y1).all() and torch.equal(yg, (y1 * gam.float()).to(torch.bfloat16))
    want = (y1.double() ** 2).view(P, -1).sum(1)
    assert ((ssp.double().view(-1) - want).abs() <= 1e-6 * want + 1e-30).all()


def test_block_ptx_matches_the_simt_twin():
    """One block through the emulator's model of block_ptx() equals the Triton simt path's interpreter arithmetic
    (the parts by the same bit operations, mask `_M0` on the word and on its bit reversal; the f16 products summed in
    f16 per half; the two halves' sum times the factor plus the accumulator in fp32): random words, f16 pairs and
    scales, bit for bit."""
    from k3lab_kernels.cute.moe_experts import block_ptx
    from k3lab_kernels.triton import moe_experts as tm

    g = torch.Generator().manual_seed(5)
    m0 = tm._M0.value & 0xFFFFFFFF

    def brev(x):
        return int(f"{x & 0xFFFFFFFF:032b}"[::-1], 2)
    for _ in range(20):
        w = torch.randint(-2**31, 2**31 - 1, (4,), generator=g, dtype=torch.int64).to(torch.int32)
        pairs = (torch.randn(32, generator=g) * 4).to(torch.float16).view(torch.int32).tolist()  # pair q: 2q, 2q+1
        fbits = (int(torch.randint(100, 140, (1,), generator=g)) + 8) << 23
        got = float(emulate._ptx_b32(w.tolist() + pairs + [fbits, 0.5], block_ptx(), "=f," + "r," * 21 + "f"))
        ws = [int(x) & 0xFFFFFFFF for x in w]
        parts = [[x & m0 for x in ws], [(x << 8) & m0 for x in ws], [brev(x) & m0 for x in ws],
                 [(brev(x) << 8) & m0 for x in ws]]
        h = [0.0, 0.0]
        for j in range(4):
            for p in range(4):
                dv, xv = int(parts[p][j]) & 0xFFFFFFFF, pairs[4 * p + j] & 0xFFFFFFFF
                for half in range(2):
                    prod = emulate._f16_of_bits(dv >> (16 * half)) * emulate._f16_of_bits(xv >> (16 * half))
                    h[half] = emulate._f16_of_bits(emulate._bits_of_f16(prod + h[half]))
        want = emulate._fma32(emulate._f32(h[0] + h[1]), emulate._f32_of_bits(fbits), 0.5)
        assert got == want


def test_refused_by_name():
    d = OP.make_inputs(OP.case(**SMALL), 0, "cpu")
    z2 = torch.zeros(2, 128, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="'z' must be one token"):
        run(z2, d["idx"], d["weights_k"], d["moe"], d["y"])
    with pytest.raises(ValueError, match="'wk' must have dtype"):
        run(d["z"], d["idx"], d["weights_k"].double(), d["moe"], d["y"])
    with pytest.raises(ValueError, match="'pdl' must be None or a bool"):
        run(d["z"], d["idx"], d["weights_k"], d["moe"], d["y"], pdl=1)
