"""Kernel tests run Triton's interpreter on CPU. TRITON_INTERPRET must be set before triton is imported,
so this runs first; on a machine with CUDA the kernels compile for the GPU instead (the `gpu` tests)."""

import os

if "TRITON_INTERPRET" not in os.environ:
    import torch

    if not torch.cuda.is_available():
        os.environ["TRITON_INTERPRET"] = "1"

import pytest  # noqa: E402
import torch  # noqa: E402


def pytest_collection_modifyitems(config, items):
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords and not torch.cuda.is_available():
            item.add_marker(skip)
