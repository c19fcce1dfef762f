"""Fixtures of the CPU kernel tests: each build that can run here (the one this CPU takes, AVX2
or AVX512, and the portable DEFAULT one) and 1 or 2 threads."""
import pytest
import torch

from kernels import cpu_attention

ISAS = sorted({cpu_attention.cpu_isa(), "DEFAULT"})


@pytest.fixture(params=ISAS)
def ops(request):
    return cpu_attention.load(request.param)


@pytest.fixture(params=[1, 2], ids=lambda n: f"{n}thr")
def threads(request):
    before = torch.get_num_threads()
    torch.set_num_threads(request.param)
    yield request.param
    torch.set_num_threads(before)
