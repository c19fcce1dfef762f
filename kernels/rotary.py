"""Neox-style rotary embedding of q and k, in place, from cos/sin caches indexed by position.

Reference: `kernels.reference.apply_rope` on `cos_cache[positions]`, `sin_cache[positions]`.
The caches are `reference.rope_cos_sin(reference.rope_inv_freq(...))`: `[max_positions,
head_dim]` with the two halves equal, so only the first half is read; any rope scaling (llama3,
linear) is already in them. The rotation pairs dimension i with i + head_dim / 2:

    out[:half] = x[:half] * cos - x[half:] * sin
    out[half:] = x[half:] * cos + x[:half] * sin
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _rotate(x_ptr, stride_h, cos, sin,
            NUM_HEADS: tl.constexpr, HEADS_P2: tl.constexpr, HALF: tl.constexpr):
    offs_h = tl.arange(0, HEADS_P2)[:, None]
    offs = tl.arange(0, HALF)[None, :]
    mask = offs_h < NUM_HEADS
    lo = x_ptr + offs_h * stride_h + offs                                 # [HEADS_P2, HALF]
    x1 = tl.load(lo, mask=mask, other=0.0)
    x2 = tl.load(lo + HALF, mask=mask, other=0.0).to(tl.float32)
    dtype = x1.dtype
    x1 = x1.to(tl.float32)
    tl.store(lo, (x1 * cos - x2 * sin).to(dtype), mask=mask)
    tl.store(lo + HALF, (x2 * cos + x1 * sin).to(dtype), mask=mask)


@triton.jit
def _rotary_kernel(
    q_ptr,                       # [num_tokens, num_heads, head_dim]
    k_ptr,                       # [num_tokens, num_kv_heads, head_dim]
    pos_ptr,                     # [num_tokens]
    cos_ptr, sin_ptr,            # [max_positions, head_dim]
    stride_qt, stride_qh, stride_kt, stride_kh, stride_cos, stride_sin,
    NUM_HEADS: tl.constexpr, Q_HEADS_P2: tl.constexpr,
    NUM_KV_HEADS: tl.constexpr, K_HEADS_P2: tl.constexpr, HALF: tl.constexpr,
):
    t = tl.program_id(0)
    pos = tl.load(pos_ptr + t).to(tl.int64)
    offs = tl.arange(0, HALF)
    cos = tl.load(cos_ptr + pos * stride_cos + offs).to(tl.float32)[None, :]  # [1, HALF]
    sin = tl.load(sin_ptr + pos * stride_sin + offs).to(tl.float32)[None, :]
    _rotate(q_ptr + t * stride_qt, stride_qh, cos, sin, NUM_HEADS, Q_HEADS_P2, HALF)
    _rotate(k_ptr + t * stride_kt, stride_kh, cos, sin, NUM_KV_HEADS, K_HEADS_P2, HALF)


def rotary(q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor, cos_cache: torch.Tensor,
           sin_cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """q: [num_tokens, num_heads, head_dim], k: [num_tokens, num_kv_heads, head_dim], rotated in
    place (and returned); positions: [num_tokens]; caches: [max_positions, head_dim]."""
    num_tokens, num_heads, head_dim = q.shape
    assert k.shape[0] == num_tokens and k.shape[2] == head_dim, (
        f"k {tuple(k.shape)} vs q {tuple(q.shape)}")
    assert positions.shape == (num_tokens,), f"positions {tuple(positions.shape)}"
    assert not positions.dtype.is_floating_point, "positions are integers"
    assert cos_cache.shape == sin_cache.shape and cos_cache.shape[1] == head_dim, (
        f"caches {tuple(cos_cache.shape)}, {tuple(sin_cache.shape)} for head_dim {head_dim}")
    assert q.dtype == k.dtype, f"q {q.dtype} != k {k.dtype}"
    assert q.stride(-1) == k.stride(-1) == cos_cache.stride(1) == sin_cache.stride(1) == 1
    half = head_dim // 2
    assert head_dim % 2 == 0 and half & (half - 1) == 0, f"head_dim {head_dim} unsupported"
    if num_tokens:
        _rotary_kernel[(num_tokens,)](
            q, k, positions, cos_cache, sin_cache,
            q.stride(0), q.stride(1), k.stride(0), k.stride(1),
            cos_cache.stride(0), sin_cache.stride(0),
            NUM_HEADS=num_heads, Q_HEADS_P2=triton.next_power_of_2(num_heads),
            NUM_KV_HEADS=k.shape[1], K_HEADS_P2=triton.next_power_of_2(k.shape[1]), HALF=half,
        )
    return q, k
