"""KV write at a slot mapping against kernels.reference.write_kv: an exact copy."""
import pytest
import torch

from kernels import reference
from kernels.reshape_and_cache import reshape_and_cache
from tests.kernels.paged import DEVICE, param_id, random_cache


@pytest.mark.parametrize("block_size", [16, 32])
@pytest.mark.parametrize("num_kv_heads", [1, 2, 3])
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=param_id)
def test_write_matches_reference(dtype, head_dim, num_kv_heads, block_size):
    gen = torch.Generator().manual_seed(0)
    num_blocks, num_tokens = 6, 23
    cache = random_cache(num_blocks, block_size, num_kv_heads, head_dim, dtype, gen)
    expected = cache.clone()
    slots = torch.randperm(num_blocks * block_size, generator=gen)[:num_tokens].to(DEVICE)
    # k a strided view (as sliced from a fused qkv projection), v contiguous
    kv = torch.randn((num_tokens, 2 * num_kv_heads, head_dim), generator=gen).to(dtype).to(DEVICE)
    k, v = kv[:, :num_kv_heads], kv[:, num_kv_heads:].contiguous()
    reshape_and_cache(k, v, cache, slots)
    reference.write_kv(k, v, expected, slots)
    assert torch.equal(cache, expected)


def test_negative_slot_is_padding():
    gen = torch.Generator().manual_seed(1)
    cache = random_cache(2, 16, 2, 64, torch.float32, gen)
    expected = cache.clone()
    k, v = (torch.randn((3, 2, 64), generator=gen).to(DEVICE) for _ in range(2))
    slots = torch.tensor([5, -1, 20], device=DEVICE)
    reshape_and_cache(k, v, cache, slots)
    keep = torch.tensor([0, 2], device=DEVICE)
    reference.write_kv(k[keep], v[keep], expected, slots[keep])
    assert torch.equal(cache, expected)
