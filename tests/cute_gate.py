"""The gate of the CuTe DSL GPU test modules: call `require_cute_gpu()` at module level, before importing
anything that builds kernels. Skips the whole module cleanly without nvidia-cutlass-dsl or without a
CUDA GPU of compute capability >= 9.0 (the kernels are built for sm_90a)."""
import importlib.util

import pytest
import torch


def require_cute_gpu() -> None:
    if importlib.util.find_spec("cutlass") is None:
        pytest.skip("nvidia-cutlass-dsl (cutlass) is not importable", allow_module_level=True)
    if not (torch.cuda.is_available() and torch.cuda.get_device_capability()[0] >= 9):
        pytest.skip("no CUDA GPU with compute capability >= 9.0", allow_module_level=True)
