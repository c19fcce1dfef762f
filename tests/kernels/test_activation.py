"""SiLU-and-mul against kernels.reference.silu_and_mul."""
import pytest
import torch

from kernels import reference
from kernels.activation import silu_and_mul, silu_mul
from tests.kernels.paged import DEVICE, param_id

TOL = {torch.float32: dict(atol=1e-6, rtol=1e-6), torch.float16: dict(atol=2e-3, rtol=2e-3),
       torch.bfloat16: dict(atol=2e-2, rtol=2e-2)}


# 1500 spans two 1024-wide column blocks with a masked tail
@pytest.mark.parametrize("n", [64, 1500])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=param_id)
def test_silu_and_mul_matches_reference(dtype, n):
    gate_up = (3 * torch.randn((5, 2 * n), generator=torch.Generator().manual_seed(0)))
    gate_up = gate_up.to(dtype).to(DEVICE)
    ref = reference.silu_and_mul(gate_up)
    torch.testing.assert_close(silu_and_mul(gate_up), ref, **TOL[dtype])
    gate, up = gate_up.chunk(2, dim=-1)
    torch.testing.assert_close(silu_mul(gate.contiguous(), up.contiguous()), ref, **TOL[dtype])
