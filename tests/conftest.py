import os

import torch

if not torch.cuda.is_available():
    # Triton kernels then run on CPU tensors under the interpreter, which must be chosen before
    # any @triton.jit is defined
    os.environ.setdefault("TRITON_INTERPRET", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import pytest  # noqa: E402

from common.models.tiny import KNOWN_ARCHS, make_tiny_model  # noqa: E402


@pytest.fixture(scope="session")
def tiny_models(tmp_path_factory):
    """arch -> directory of the tiny model, made once per session."""
    root = tmp_path_factory.mktemp("models")
    return {arch: make_tiny_model(root / arch, arch=arch, seed=0) for arch in KNOWN_ARCHS}


@pytest.fixture(scope="session")
def tiny_llama(tiny_models):
    return tiny_models["llama"]


def pytest_collection_modifyitems(config, items):
    """Tests marked `cuda` need a real GPU: skipped without one."""
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU (the interpreter cannot capture graphs or "
                                   "run bf16 and GPU-sized shapes)")
    for item in items:
        if "cuda" in item.keywords:
            item.add_marker(skip)
