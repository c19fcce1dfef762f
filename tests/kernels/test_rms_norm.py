"""RMSNorm and residual-add fused RMSNorm against kernels.reference."""
import pytest
import torch

from kernels import reference
from kernels.rms_norm import fused_add_rms_norm, rms_norm
from tests.kernels.paged import DEVICE, param_id

# fp32 differs by the order of the sum of squares; fp16 by at most an ulp of the output
TOL = {torch.float32: dict(atol=1e-5, rtol=1e-5), torch.float16: dict(atol=2e-3, rtol=2e-3),
       torch.bfloat16: dict(atol=2e-2, rtol=2e-2)}
EPS = 1e-6


def _inputs(shape, dtype, seed=0):
    gen = torch.Generator().manual_seed(seed)
    x, residual = (torch.randn(shape, generator=gen).to(dtype).to(DEVICE) for _ in range(2))
    weight = (1 + 0.1 * torch.randn(shape[-1], generator=gen)).to(dtype).to(DEVICE)
    return x, residual, weight


# 96: a hidden size that is not a power of two (masked tail); [3, 4, 64]: q/k norm over heads
@pytest.mark.parametrize("shape", [(5, 64), (5, 96), (3, 4, 64), (2, 1024)], ids=param_id)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=param_id)
def test_rms_norm_matches_reference(dtype, shape):
    x, _, weight = _inputs(shape, dtype)
    torch.testing.assert_close(rms_norm(x, weight, EPS), reference.rms_norm(x, weight, EPS),
                               **TOL[dtype])


@pytest.mark.parametrize("shape", [(5, 64), (5, 96), (2, 1024)], ids=param_id)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=param_id)
def test_fused_add_rms_norm_matches_reference(dtype, shape):
    x, residual, weight = _inputs(shape, dtype)
    ref_out, ref_residual = reference.fused_add_rms_norm(x, residual, weight, EPS)
    out, new_residual = fused_add_rms_norm(x, residual, weight, EPS)
    assert new_residual is residual, "the residual is updated in place"
    torch.testing.assert_close(new_residual, ref_residual, **TOL[dtype])
    torch.testing.assert_close(out, ref_out, **TOL[dtype])


@pytest.mark.cuda
def test_bf16_on_gpu():
    x, residual, weight = _inputs((64, 4096), torch.bfloat16)
    ref_out, ref_residual = reference.fused_add_rms_norm(x, residual, weight, EPS)
    out, new_residual = fused_add_rms_norm(x, residual, weight, EPS)
    torch.testing.assert_close(new_residual, ref_residual, **TOL[torch.bfloat16])
    torch.testing.assert_close(out, ref_out, **TOL[torch.bfloat16])
