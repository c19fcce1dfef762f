"""Kernel tests run on CUDA when there is a GPU, else on CPU under the Triton interpreter
(tests/conftest.py sets TRITON_INTERPRET=1 first). Tests marked `cuda` need a real GPU."""
import pytest
import torch


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU (the interpreter cannot capture graphs or "
                                   "run bf16 and GPU-sized shapes)")
    for item in items:
        if "cuda" in item.keywords:
            item.add_marker(skip)
