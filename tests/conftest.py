import contextlib
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


def _segments_held() -> set[str]:
    """The pdserve /dev/shm segments (KV caches, tiers, core boards) this process holds open
    under their names: a worker built here and not closed keeps its segment, and a later worker
    given the same id fails to start beside it."""
    held = set()
    for fd in os.listdir("/proc/self/fd"):
        with contextlib.suppress(OSError):
            target = os.readlink(f"/proc/self/fd/{fd}")
            if target.startswith("/dev/shm/pdserve-") and not target.endswith(" (deleted)"):
                held.add(target)
    return held


@pytest.fixture(scope="module", autouse=True)
def no_segment_left_open(request):
    """Every test module closes the workers, caches and boards it makes (Worker.close)."""
    before = _segments_held()
    yield
    left = sorted(_segments_held() - before)
    assert not left, f"{request.module.__name__} left shm segments open: {left}"


def pytest_collection_modifyitems(config, items):
    """Tests marked `cuda` need a real GPU: skipped without one."""
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU (the interpreter cannot capture graphs or "
                                   "run bf16 and GPU-sized shapes)")
    for item in items:
        if "cuda" in item.keywords:
            item.add_marker(skip)
