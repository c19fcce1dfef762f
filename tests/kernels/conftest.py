"""Fixtures of the CPU kernel tests: each build that can run here (the one this CPU takes, AVX2
or AVX512, and the portable DEFAULT one) on 1 or 2 threads: OpenMP's, or the kernels' own pool's."""
import pytest
import torch

from kernels import cpu_attention

ISAS = sorted({cpu_attention.cpu_isa(), "DEFAULT"})


@pytest.fixture(params=ISAS)
def ops(request):
    return cpu_attention.load(request.param)


@pytest.fixture(params=[1, 2, "pool"], ids=lambda n: f"{n}thr" if n != "pool" else "pool2thr")
def threads(request, ops):
    """1 or 2 of OpenMP's threads, or 2 of the kernels' own pool's (csrc/pool.h) with torch on
    one, as a worker whose steps run on the pool has them."""
    before = torch.get_num_threads()
    pooled = request.param == "pool"
    torch.set_num_threads(1 if pooled else request.param)
    ops.set_pool_threads(2 if pooled else 0)
    try:
        yield 2 if pooled else request.param
    finally:
        ops.set_pool_threads(0)
        torch.set_num_threads(before)
