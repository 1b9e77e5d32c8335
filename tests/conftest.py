"""Minimal: without a CUDA GPU, run Triton kernels in the interpreter (must be set before triton is
imported anywhere); tests marked `gpu` are skipped cleanly without CUDA."""
import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
