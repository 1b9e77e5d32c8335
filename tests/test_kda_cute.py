"""CuTe DSL KDA kernels (kernels/cute/kda_decode.py, kda_verify.py) against the fp64 reference, on the GPU.

Needs nvidia-cutlass-dsl and a CUDA GPU of compute capability >= 9.0; skipped cleanly otherwise. The
shared checker (k3lab.harness.checker) runs each kernel entry point on fresh random inputs with outputs
poisoned: out relative-norm error < 1e-2 (bf16 output), state / history < 1e-4 (fp32 maths), conv state
bit-exact, ragged entries untouched, inputs unchanged (tolerances: k3lab/ops/kda.py).
"""
import pytest
import torch
from cute_gate import require_cute_gpu

pytestmark = [pytest.mark.cute, pytest.mark.gpu]
require_cute_gpu()

import kda_impls as K  # noqa: E402
from k3lab.harness import checker  # noqa: E402
from k3lab_kernels.cute.kda_decode import kda_decode  # noqa: E402
from k3lab_kernels.cute.kda_verify import kda_verify  # noqa: E402


def check_decode(B, H, seed, tile_v=128, pdl=False):
    return checker.require(checker.check(K.DEC, K.dcase(B, H), impl=K.decode(kda_decode, tile_v=tile_v, pdl=pdl),
                                         seed=seed))


def check_verify(B, H, T, ragged, seed, tile_v=128, row_warps=None, pdl=False):
    return checker.require(checker.check(K.VER, K.vcase(B, H, T, ragged), seed=seed,
                                         impl=K.verify(kda_verify, tile_v=tile_v, row_warps=row_warps, pdl=pdl)))


@pytest.mark.parametrize("H", [6, 12, 96])
@pytest.mark.parametrize("B", [1, 2, 8, 64])
def test_kda_decode_matches_fp64_reference(B, H):
    check_decode(B, H, seed=B * 100 + H)


@pytest.mark.parametrize("B,H,T,ragged", [
    (1, 12, 4, False), (2, 6, 8, False), (8, 12, 2, False), (64, 12, 4, False), (1, 96, 3, False),
    (8, 12, 4, True), (5, 6, 8, True),
])
def test_kda_verify_matches_fp64_reference(B, H, T, ragged):
    r = check_verify(B, H, T, ragged=ragged, seed=B + H + T)
    assert r.inputs_unchanged and r.untouched_ok


@pytest.mark.parametrize("tile_v", [64, 32, 16])
@pytest.mark.parametrize("B,H", [(1, 12), (8, 6), (64, 12), (2, 96)])
def test_kda_decode_column_tiles(B, H, tile_v):
    """tile_v < 128: a cluster of 128/tile_v CTAs per head, output norm joined through DSMEM."""
    check_decode(B, H, seed=B * 100 + H + tile_v, tile_v=tile_v)


@pytest.mark.parametrize("tile_v", [64, 32, 16])
@pytest.mark.parametrize("B,H,T,ragged", [(1, 12, 4, False), (2, 6, 8, False), (8, 12, 4, True)])
def test_kda_verify_column_tiles(B, H, T, ragged, tile_v):
    check_verify(B, H, T, ragged=ragged, seed=B + H + T + tile_v, tile_v=tile_v)


@pytest.mark.parametrize("c", [2, 4, 8])
@pytest.mark.parametrize("B,tile_v,row_warps", [(1, 16, None), (8, 128, None), (8, 64, 2), (64, 128, None)])
def test_kda_verify_checkpoint(B, tile_v, row_warps, c):
    """checkpoint c at T = 8 (and T = 4): only the slots' states stored; ragged slots past lengths[b] untouched;
    then the commit (the cute backend: the Triton replay) of every n_b through the shared checker."""
    from k3lab import registry

    for T, ragged in ((8, False), (8, True), (4, True)):
        if c > T:
            continue
        checker.require(checker.check(K.VER, K.VER.case(heads=12, batch=B, T=T, ragged=ragged, checkpoint=c),
                                      seed=B + T + c, impl=K.verify(kda_verify, tile_v=tile_v, row_warps=row_warps,
                                                                    checkpoint=c)))
    com = registry.get("kda_commit")
    checker.require(checker.check(com, com.case(heads=12, batch=max(B, 8), T=8, checkpoint=c, accepted="each"),
                                  backend="cute", seed=B + c))


def test_kda_cute_refuses_unsupported_inputs():
    """The wrapper refuses what it does not support, with a clear error (never a crash in the kernel)."""
    d = K.DEC.make_inputs(K.dcase(1, 6), 0, "cuda")
    a = list(K._a(d))
    bad = {"tile_v=8": (a, dict(tile_v=8)),
           "noncontig state": (a[:5] + [d["state"].transpose(2, 3)] + a[6:], {}),
           "fp32 qkv": ([a[0].float()] + a[1:], {}),
           "cpu": ([a[0].cpu()] + a[1:], {})}
    for _name, (args, kw) in bad.items():
        with pytest.raises((ValueError, TypeError, NotImplementedError)):
            kda_decode(*args, **kw)
        torch.cuda.synchronize()


@pytest.mark.parametrize("row_warps", [1, 2, 4, 8])
@pytest.mark.parametrize("tile_v", [128, 64, 32, 16])
@pytest.mark.parametrize("B,H,T,ragged", [(1, 12, 4, False), (5, 6, 8, True)])
def test_kda_verify_every_row_split(B, H, T, ragged, tile_v, row_warps):
    """Every row_warps value of the column layout (1: no CTA barrier per position; > 1: partial sums
    through shared memory, double-buffered by position). Tile 16 takes row_warps 2, 4, 8."""
    if tile_v == 16 and row_warps == 1:
        pytest.skip("tile 16 needs row_warps >= 2 (refused by name: test_kda_cute_api.py)")
    check_verify(B, H, T, ragged=ragged, seed=B + T + tile_v + row_warps, tile_v=tile_v, row_warps=row_warps)


@pytest.mark.parametrize("B,H,T,ragged,tile_v", [(1, 12, 4, False, 16), (5, 6, 8, True, 32), (64, 12, 4, False, 128)])
def test_kda_verify_pdl(B, H, T, ragged, tile_v):
    """Programmatic dependent launch (kda_pdl) of the verify: same contract as the plain launch."""
    check_verify(B, H, T, ragged=ragged, seed=B + T + tile_v, tile_v=tile_v, pdl=True)


@pytest.mark.parametrize("tile_v", [128, 64, 32, 16])
@pytest.mark.parametrize("B,H", [(1, 12), (64, 12), (3, 96)])
def test_kda_decode_pdl(B, H, tile_v):
    """Programmatic dependent launch (kda_pdl): launched while the previous kernel on the stream may still
    run; same contract as the plain launch."""
    check_decode(B, H, seed=B * 11 + H + tile_v, tile_v=tile_v, pdl=True)
