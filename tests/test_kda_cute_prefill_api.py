"""The CuTe KDA prefill wrapper (kernels/cute/kda_prefill.py) refuses bad switch values and CPU tensors
by name before touching the GPU, and the KDA component dispatches backend='cute' to it. Runs on CPU
without nvidia-cutlass-dsl (the module imports cutlass only when a kernel is built)."""
import importlib.util

import pytest
import torch

from k3lab.components import kda
from k3lab.ref import kda as ref
from k3lab.switches import BackendUnavailable

try:
    from k3lab_kernels.cute import kda_prefill as kp
except ImportError:  # the checkout's kernels/ folder
    from kernels.cute import kda_prefill as kp


def _args(B=1, H=2, D=128, L=5):
    inp, p, st, cs = ref.make_kda_inputs(B, H, D, T=L, seed=0)
    out = torch.empty(B, L, H * D, dtype=torch.bfloat16)
    return (inp["qkv"], inp["f"], inp["b"], inp["gate"], p, st, cs, out)


@pytest.mark.parametrize("chunk", [48, 128, 8, "64", True])
def test_chunk_is_refused_by_name(chunk):
    with pytest.raises(ValueError, match="chunk"):
        kp.kda_prefill(*_args(), chunk=chunk)


@pytest.mark.parametrize("inverse", ["fp16", "FP32", None])
def test_inverse_is_refused_by_name(inverse):
    with pytest.raises(ValueError, match="inverse"):
        kp.kda_prefill(*_args(), inverse=inverse)


@pytest.mark.parametrize("grouped", [1, 0, "yes", None])
def test_grouped_must_be_a_bool(grouped):
    with pytest.raises(ValueError, match="grouped"):
        kp.kda_prefill(*_args(), grouped=grouped)


@pytest.mark.parametrize("tile_v", [4, 8, 256, 48, True])
def test_tile_v_is_refused_by_name(tile_v):
    with pytest.raises(ValueError, match="tile_v"):
        kp.kda_prefill(*_args(), tile_v=tile_v)


def test_cpu_tensors_are_refused_by_name():
    with pytest.raises(ValueError, match="CUDA"):
        kp.kda_prefill(*_args())


def test_switch_sets_match_the_component():
    assert kp.PREFILL_CHUNKS == (16, 32, 64)
    assert kp.PREFILL_INVERSES == kda.INVERSES
    assert set(kp.PREFILL_TILES) <= set(kda.TILE_V_ALLOWED) and min(kp.PREFILL_TILES) == 16


def test_floor_bytes():
    # B=1, L=4096, H=12: 77.3 MB, 18.1 us at 4.275 TB/s (the docstring's floor)
    from k3lab.ops.kda import kda_bytes

    assert abs(kda_bytes(1, 12, 4096, prefill=True) / 1e6 - 77.3) < 0.1


def test_component_cute_prefill_is_wired():
    """backend='cute' reaches the CuTe prefill: without CuTe DSL it is refused as unavailable naming
    cutlass; with it (and a GPU) the CPU tensors are refused by the kernel wrapper. Never the old
    "has no KDA prefill"."""
    qkv, f, b, gate, p, st, cs, _ = _args(L=3)
    with pytest.raises((BackendUnavailable, ValueError)) as ei:
        kda.prefill(qkv, f, b, gate, p, st, cs, backend="cute")
    assert "has no KDA prefill" not in str(ei.value)
    if importlib.util.find_spec("cutlass") is None:
        assert isinstance(ei.value, BackendUnavailable)
        assert "cutlass" in str(ei.value)
