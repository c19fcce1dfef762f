"""In-place neox rotary embedding against kernels.reference.apply_rope."""
import pytest
import torch

from kernels import reference
from kernels.rotary import rotary
from tests.kernels.paged import DEVICE, HEADS, param_id

TOL = {torch.float32: dict(atol=1e-6, rtol=1e-6), torch.float16: dict(atol=4e-3, rtol=4e-3),
       torch.bfloat16: dict(atol=3e-2, rtol=3e-2)}
LLAMA3 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
          "original_max_position_embeddings": 8192}
MAX_POSITIONS = 4096


@pytest.mark.parametrize("scaling", [None, LLAMA3], ids=["default", "llama3"])
@pytest.mark.parametrize("gqa", [1, 4, 8])
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=param_id)
def test_rotary_matches_reference(dtype, head_dim, gqa, scaling):
    gen = torch.Generator().manual_seed(0)
    num_heads, num_kv_heads = HEADS[gqa]
    cos, sin = reference.rope_cos_sin(reference.rope_inv_freq(head_dim, 500000.0, scaling),
                                      MAX_POSITIONS)
    cos, sin = cos.to(dtype).to(DEVICE), sin.to(dtype).to(DEVICE)
    positions = torch.tensor([0, 1, 7, 300, MAX_POSITIONS - 1, 2], device=DEVICE)
    n = len(positions)
    q = torch.randn((n, num_heads, head_dim), generator=gen).to(dtype).to(DEVICE)
    k = torch.randn((n, num_kv_heads, head_dim), generator=gen).to(dtype).to(DEVICE)
    ref_q = reference.apply_rope(q, cos[positions], sin[positions])
    ref_k = reference.apply_rope(k, cos[positions], sin[positions])
    out_q, out_k = rotary(q, k, positions, cos, sin)
    assert out_q is q and out_k is k, "rotated in place"
    torch.testing.assert_close(q, ref_q, **TOL[dtype])
    torch.testing.assert_close(k, ref_k, **TOL[dtype])
