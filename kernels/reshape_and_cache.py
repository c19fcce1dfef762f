"""Write a step's new keys and values into the paged KV cache at their slots.

Reference: `kernels.reference.write_kv`. One program per token; a negative slot means a padding
token (a CUDA-graph bucket larger than the batch) and writes nothing.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _reshape_and_cache_kernel(
    key_ptr, value_ptr,          # [num_tokens, num_kv_heads, head_dim]
    cache_ptr,                   # [2, num_blocks, block_size, num_kv_heads, head_dim]
    slot_ptr,                    # [num_tokens]
    stride_kt, stride_kh, stride_vt, stride_vh,
    stride_ckv, stride_cb, stride_cs, stride_ch,
    NUM_KV_HEADS: tl.constexpr, HEADS_P2: tl.constexpr, HEAD_DIM: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
):
    t = tl.program_id(0)
    slot = tl.load(slot_ptr + t).to(tl.int64)
    block, offset = slot // BLOCK_SIZE, slot % BLOCK_SIZE
    offs_h = tl.arange(0, HEADS_P2)
    offs_d = tl.arange(0, HEAD_DIM)
    # a padding token masks every head (not `& (slot >= 0)`: the interpreter turns a
    # scalar & tensor of booleans into integers)
    mask = offs_h[:, None] < tl.where(slot >= 0, NUM_KV_HEADS, 0)       # [HEADS_P2, 1]
    # all heads of the token at once: [HEADS_P2, HEAD_DIM]
    k = tl.load(key_ptr + t * stride_kt + offs_h[:, None] * stride_kh + offs_d[None, :], mask=mask)
    v = tl.load(value_ptr + t * stride_vt + offs_h[:, None] * stride_vh + offs_d[None, :],
                mask=mask)
    dst = (cache_ptr + block * stride_cb + offset * stride_cs
           + offs_h[:, None] * stride_ch + offs_d[None, :])
    tl.store(dst, k, mask=mask)
    tl.store(dst + stride_ckv, v, mask=mask)


def reshape_and_cache(key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor,
                      slot_mapping: torch.Tensor) -> None:
    """key/value: [num_tokens, num_kv_heads, head_dim] -> their slots of kv_cache, in place."""
    num_tokens, num_kv_heads, head_dim = key.shape
    two, _, block_size, cache_heads, cache_dim = kv_cache.shape
    assert two == 2 and (cache_heads, cache_dim) == (num_kv_heads, head_dim), (
        f"cache {tuple(kv_cache.shape)} does not hold keys of shape {tuple(key.shape)}")
    assert value.shape == key.shape, f"value {tuple(value.shape)} != key {tuple(key.shape)}"
    assert slot_mapping.shape == (num_tokens,), f"slot_mapping {tuple(slot_mapping.shape)}"
    assert key.dtype == value.dtype == kv_cache.dtype, (
        f"dtypes: key {key.dtype}, value {value.dtype}, cache {kv_cache.dtype}")
    assert not slot_mapping.dtype.is_floating_point, "slot_mapping holds integer slots"
    assert key.stride(-1) == value.stride(-1) == kv_cache.stride(-1) == 1, (
        "head_dim must be contiguous")
    assert head_dim & (head_dim - 1) == 0, f"head_dim {head_dim} is not a power of two"
    if num_tokens == 0:
        return
    _reshape_and_cache_kernel[(num_tokens,)](
        key, value, kv_cache, slot_mapping,
        key.stride(0), key.stride(1), value.stride(0), value.stride(1),
        kv_cache.stride(0), kv_cache.stride(1), kv_cache.stride(2), kv_cache.stride(3),
        NUM_KV_HEADS=num_kv_heads, HEADS_P2=triton.next_power_of_2(num_kv_heads),
        HEAD_DIM=head_dim, BLOCK_SIZE=block_size,
    )
