"""The CuTe KDA decode / verify wrappers refuse bad switch values by name before touching the GPU, and keep
the signatures k3lab.components.kda calls (runs on CPU, without nvidia-cutlass-dsl)."""
import inspect

import pytest
import torch

from k3lab.ref import kda as ref

kv = pytest.importorskip("k3lab_kernels.cute.kda_verify")


def _args(B=1, H=2, D=16, T=3):
    inp, p, st, cs = ref.make_kda_inputs(B, H, D, T=T, seed=0)
    out = torch.empty(B, T, H * D, dtype=torch.bfloat16)
    sh = torch.empty(B, T, H, D, D)
    ch = torch.empty(B, T, 3 * H * D, 3, dtype=torch.bfloat16)
    return (inp["qkv"], inp["f"], inp["b"], inp["gate"], p, st, cs, out, sh, ch)


@pytest.mark.parametrize("rw", [0, 3, 16, "4"])
def test_row_warps_values(rw):
    with pytest.raises(ValueError, match="row_warps"):
        kv.kda_verify(*_args(), row_warps=rw)


@pytest.mark.parametrize("ck", [0, 4, 2.0, True, "2"])
def test_checkpoint_values(ck):
    """checkpoint: None or an int in 1..T (T = 3 here)."""
    with pytest.raises(ValueError, match="checkpoint"):
        kv.kda_verify(*_args(), checkpoint=ck)


def test_cpu_tensors_are_refused_by_name():
    with pytest.raises(ValueError, match="CUDA"):
        kv.kda_verify(*_args())


def test_defaults_cover_every_tile():
    assert set(kv.ROW_WARPS) == {128, 64, 32, 16} and set(kv.ROW_WARPS.values()) <= {1, 2, 4, 8}
    assert all(kv.ROW_WARPS[t] in kv.ROW_WARPS_ALLOWED[t] for t in kv.ROW_WARPS)


def test_default_row_warps_rule():
    """ROW_WARPS, except tile 128 at T >= 8 on one CTA per SM (1) and tile 64 at T = 3..4 on a resident grid (2)."""
    for tv in (128, 64, 32, 16):
        for B, T in ((1, 2), (8, 4), (8, 8), (64, 8), (64, 4)):
            assert kv.default_row_warps(tv, B, 12, T) in kv.ROW_WARPS_ALLOWED[tv]
    assert kv.default_row_warps(128, 8, 12, 8) == 1 and kv.default_row_warps(128, 16, 12, 8) == 4
    assert kv.default_row_warps(128, 8, 12, 4) == 4
    assert kv.default_row_warps(64, 8, 12, 4) == 2 and kv.default_row_warps(64, 8, 12, 2) == 4
    assert kv.default_row_warps(64, 64, 12, 4) == 4 and kv.default_row_warps(32, 8, 12, 4) == 4


def test_tile16_refuses_one_row_warp():
    with pytest.raises(ValueError, match="row_warps"):
        kv.kda_verify(*_args(), tile_v=16, row_warps=1)


def test_pdl_must_be_a_bool():
    with pytest.raises(TypeError, match="pdl"):
        kv.kda_verify(*_args(), pdl="yes")
    from k3lab_kernels.cute import kda_decode as kd
    inp, p, st, cs = ref.make_kda_inputs(1, 2, 16, seed=0)
    out = torch.empty(1, 32, dtype=torch.bfloat16)
    with pytest.raises(TypeError, match="pdl"):
        kd.kda_decode(inp["qkv"], inp["f"], inp["b"], inp["gate"], p, st, cs, out, pdl=1)


def test_public_signatures():
    """Only the switches users toggle: tile_v and pdl (decode); lengths, tile_v, row_warps, pdl and checkpoint
    (verify)."""
    from k3lab_kernels.cute import kda_decode as kd
    head = ["qkv", "f", "b", "gate", "params", "state", "conv_state", "out"]
    assert list(inspect.signature(kd.kda_decode).parameters) == head + ["tile_v", "pdl"]
    assert list(inspect.signature(kv.kda_verify).parameters) == head + ["state_hist", "conv_hist", "lengths",
                                                                        "tile_v", "row_warps", "pdl", "checkpoint"]
