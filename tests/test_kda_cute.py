"""CuTe DSL KDA kernels (kernels/cute/kda_decode.py, kda_verify.py) against the fp64 reference.

Needs nvidia-cutlass-dsl and a CUDA GPU of compute capability >= 9.0; skipped cleanly otherwise.
Fresh random inputs from make_kda_inputs (never zeros), outputs poisoned with NaN before the run,
oracle = k3lab.ref.kda in float64: out relative-norm error < 1e-2 (bf16 output), state relative
error < 1e-4 (fp32 maths), conv_state exactly equal. The checks live in
kernels/cute/check_kda.py so the GPU script and these tests assert the same thing.
"""
import importlib.util

import pytest
import torch

pytestmark = [pytest.mark.cute, pytest.mark.gpu]

_HAVE_CUTLASS = importlib.util.find_spec("cutlass") is not None
_HAVE_GPU = torch.cuda.is_available() and torch.cuda.get_device_capability()[0] >= 9

if not _HAVE_CUTLASS:
    pytest.skip("nvidia-cutlass-dsl (cutlass) is not importable", allow_module_level=True)
if not _HAVE_GPU:
    pytest.skip("no CUDA GPU with compute capability >= 9.0", allow_module_level=True)

try:
    from k3lab_kernels.cute.check_kda import OUT_TOL, STATE_TOL, check_decode, check_errors, check_verify
except ImportError:  # not installed: the checkout's kernels/ folder
    from kernels.cute.check_kda import OUT_TOL, STATE_TOL, check_decode, check_errors, check_verify


@pytest.mark.parametrize("H", [6, 12, 96])
@pytest.mark.parametrize("B", [1, 2, 8, 64])
def test_kda_decode_matches_fp64_reference(B, H):
    r = check_decode(B, H, seed=B * 100 + H, steps=2 if B <= 8 else 1)
    assert r["out_finite"], r
    assert r["out_err"] < OUT_TOL, r
    assert r["state_err"] < STATE_TOL, r
    assert r["conv_exact"], r


@pytest.mark.parametrize("B,H,T,ragged", [
    (1, 12, 4, False), (2, 6, 8, False), (8, 12, 2, False), (64, 12, 4, False), (1, 96, 3, False),
    (8, 12, 4, True), (5, 6, 8, True),
])
def test_kda_verify_matches_fp64_reference(B, H, T, ragged):
    r = check_verify(B, H, T, ragged=ragged, seed=B + H + T)
    assert r["out_finite"], r
    assert r["out_err"] < OUT_TOL, r
    assert r["state_err"] < STATE_TOL, r
    assert r["conv_exact"], r
    assert r["inputs_unchanged"], r
    assert r["untouched"], r


@pytest.mark.parametrize("tile_v", [64, 32, 16])
@pytest.mark.parametrize("B,H", [(1, 12), (8, 6), (64, 12), (2, 96)])
def test_kda_decode_column_tiles(B, H, tile_v):
    """tile_v < 128: a cluster of 128/tile_v CTAs per head, output norm joined through DSMEM."""
    r = check_decode(B, H, seed=B * 100 + H + tile_v, steps=2, tile_v=tile_v)
    assert r["ok"], r


@pytest.mark.parametrize("tile_v", [64, 32, 16])
@pytest.mark.parametrize("B,H,T,ragged", [(1, 12, 4, False), (2, 6, 8, False), (8, 12, 4, True)])
def test_kda_verify_column_tiles(B, H, T, ragged, tile_v):
    r = check_verify(B, H, T, ragged=ragged, seed=B + H + T + tile_v, tile_v=tile_v)
    assert r["ok"], r


def test_kda_cute_refuses_unsupported_inputs():
    r = check_errors()
    assert r["ok"], r


@pytest.mark.parametrize("row_warps", [1, 2, 4, 8])
@pytest.mark.parametrize("tile_v", [128, 64, 32, 16])
@pytest.mark.parametrize("B,H,T,ragged", [(1, 12, 4, False), (5, 6, 8, True)])
def test_kda_verify_every_row_split(B, H, T, ragged, tile_v, row_warps):
    """Every row_warps value of the column layout (1: no CTA barrier per position; > 1: partial sums
    through shared memory, double-buffered by position). Tile 16 takes row_warps 2, 4, 8."""
    if tile_v == 16 and row_warps == 1:
        pytest.skip("tile 16 needs row_warps >= 2 (refused by name: test_kda_cute_api.py)")
    r = check_verify(B, H, T, ragged=ragged, seed=B + T + tile_v + row_warps, tile_v=tile_v, row_warps=row_warps)
    assert r["ok"], r


@pytest.mark.parametrize("B,H,T,ragged,tile_v", [(1, 12, 4, False, 16), (5, 6, 8, True, 32), (64, 12, 4, False, 128)])
def test_kda_verify_pdl(B, H, T, ragged, tile_v):
    """Programmatic dependent launch (kda_pdl) of the verify: same contract as the plain launch."""
    r = check_verify(B, H, T, ragged=ragged, seed=B + T + tile_v, tile_v=tile_v, pdl=True)
    assert r["ok"], r


@pytest.mark.parametrize("tile_v", [128, 64, 32, 16])
@pytest.mark.parametrize("B,H", [(1, 12), (64, 12), (3, 96)])
def test_kda_decode_pdl(B, H, tile_v):
    """Programmatic dependent launch (kda_pdl): two steps, each launched while the previous kernel on the
    stream may still run; same contract as the plain launch."""
    r = check_decode(B, H, seed=B * 11 + H + tile_v, steps=2, tile_v=tile_v, pdl=True)
    assert r["ok"], r
