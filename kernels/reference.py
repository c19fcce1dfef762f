"""Pure-torch reference of every kernel; also the CPU backend.

The paged KV cache of one layer is `[2, num_blocks, block_size, num_kv_heads, head_dim]`
(index 0 keys, 1 values). A token at position p of a sequence lives in slot
`block_table[p // block_size] * block_size + p % block_size`.
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    # [..., hidden]; computed in fp32 like HF, cast back
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * xf.to(x.dtype)


def fused_add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                       eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """The decoder layer's `residual = x + residual; out = rms_norm(residual)`: (out, residual)."""
    residual = x + residual
    return rms_norm(residual, weight, eps), residual


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up


def rope_inv_freq(head_dim: int, theta: float, scaling: dict | None) -> torch.Tensor:
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    if not scaling:
        return inv_freq
    kind = scaling.get("rope_type", scaling.get("type"))
    if kind == "llama3":
        return _llama3_scale(inv_freq, scaling)
    if kind == "linear":
        return inv_freq / scaling["factor"]
    raise ValueError(f"unsupported rope scaling {kind!r}; known: default, linear, llama3")


def _llama3_scale(inv_freq: torch.Tensor, s: dict) -> torch.Tensor:
    factor, low, high = s["factor"], s["low_freq_factor"], s["high_freq_factor"]
    old_len = s["original_max_position_embeddings"]
    low_wavelen, high_wavelen = old_len / low, old_len / high
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_len / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
    return torch.where(medium, smoothed, scaled)


def rope_cos_sin(inv_freq: torch.Tensor, max_positions: int) -> tuple[torch.Tensor, torch.Tensor]:
    t = torch.arange(max_positions, dtype=torch.int64).float()
    freqs = torch.outer(t, inv_freq)          # [max_positions, head_dim / 2]
    emb = torch.cat((freqs, freqs), dim=-1)   # [max_positions, head_dim]
    return emb.cos(), emb.sin()


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Neox-style rotation. x: [num_tokens, num_heads, head_dim];
    cos/sin: [num_tokens, head_dim]."""
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos.unsqueeze(1) + rotated * sin.unsqueeze(1)


def write_kv(key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor,
             slot_mapping: torch.Tensor) -> None:
    """key/value: [num_tokens, num_kv_heads, head_dim] -> their slots in the paged cache."""
    _, num_blocks, block_size, num_kv_heads, head_dim = kv_cache.shape
    flat = kv_cache.view(2, num_blocks * block_size, num_kv_heads, head_dim)
    flat[0].index_copy_(0, slot_mapping, key)
    flat[1].index_copy_(0, slot_mapping, value)


def gather_kv(kv_cache: torch.Tensor,
              block_table: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """block_table: [..., max_blocks]
    -> keys, values [..., max_blocks * block_size, kv_heads, dim]."""
    k = kv_cache[0][block_table]  # [..., max_blocks, block_size, kv_heads, head_dim]
    v = kv_cache[1][block_table]
    shape = (*block_table.shape[:-1], -1, *k.shape[-2:])
    return k.reshape(shape), v.reshape(shape)


def decode_attention(q: torch.Tensor, kv_cache: torch.Tensor, block_tables: torch.Tensor,
                     seq_lens: torch.Tensor, scale: float) -> torch.Tensor:
    """One query token per sequence.

    q: [batch, num_heads, head_dim]; block_tables: [batch, max_blocks]; seq_lens: [batch]
    (the query's own key included). Returns [batch, num_heads, head_dim].
    """
    k, v = gather_kv(kv_cache, block_tables)           # [batch, ctx, kv_heads, head_dim]
    k, v = k.transpose(1, 2), v.transpose(1, 2)          # [batch, kv_heads, ctx, head_dim]
    ctx = torch.arange(k.shape[2], device=q.device)
    visible = ctx[None, :] < seq_lens[:, None]           # [batch, ctx]
    out = F.scaled_dot_product_attention(q.unsqueeze(2), k, v, attn_mask=visible[:, None, None, :],
                                         scale=scale, enable_gqa=True)
    return out.squeeze(2)                                # [batch, heads, head_dim]


def prefill_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor,
                      block_table: torch.Tensor, num_cached: int, scale: float) -> torch.Tensor:
    """Causal attention of one sequence's chunk.

    q/k/v: [chunk, heads, head_dim] for positions [num_cached, num_cached + chunk); keys of
    positions [0, num_cached) are read from the paged cache through block_table.
    """
    chunk = q.shape[0]
    if num_cached > 0:
        ck, cv = gather_kv(kv_cache, block_table)
        k = torch.cat((ck[:num_cached], k), dim=0)
        v = torch.cat((cv[:num_cached], v), dim=0)
    qt, kt, vt = (t.transpose(0, 1).unsqueeze(0) for t in (q, k, v))  # [1, heads, len, dim]
    if num_cached == 0:
        out = F.scaled_dot_product_attention(qt, kt, vt, is_causal=True, scale=scale,
                                             enable_gqa=True)
    else:
        rows = torch.arange(chunk, device=q.device)[:, None] + num_cached
        cols = torch.arange(num_cached + chunk, device=q.device)[None, :]
        out = F.scaled_dot_product_attention(qt, kt, vt, attn_mask=cols <= rows, scale=scale,
                                             enable_gqa=True)
    return out.squeeze(0).transpose(0, 1)  # [chunk, heads, head_dim]


_MASK32 = 0xFFFFFFFF


def _mul32(x: torch.Tensor, c: int) -> torch.Tensor:
    """x * c mod 2^32 for int64 tensors of 32-bit values, in halves of c so that no product
    passes 2^49."""
    low, high = c & 0xFFFF, c >> 16
    return (x * low + (((x * high) & 0xFFFF) << 16)) & _MASK32


def _mix32(x: torch.Tensor) -> torch.Tensor:
    """lowbias32 on int64 tensors holding 32-bit values."""
    x = x ^ (x >> 16)
    x = _mul32(x, 0x7FEB352D)
    x = x ^ (x >> 15)
    x = _mul32(x, 0x846CA68B)
    return x ^ (x >> 16)


def exponential_race(probs: torch.Tensor, keys: list[int], logits: bool = False,
                     cut: torch.Tensor | None = None) -> torch.Tensor:
    """[B] one draw per row of probs [B, V] (rows need not sum to 1; with `logits`, log-weights):
    argmax over i of probs[b, i] / E[b, i], E = -log U, U the top 23 bits of a hash of
    (keys[b], i) centred in their interval; keys are 64-bit. With `cut` [B] (logits only), a
    row's logits below its cut are -inf first. The sampler's race on the CPU
    (csrc/sampling.cpp)."""
    if cut is not None:
        probs = probs.masked_fill(probs < cut.unsqueeze(1), float("-inf"))
    if logits:
        probs = (probs.double() - probs.double().amax(dim=-1, keepdim=True)).exp()
    i = torch.arange(probs.shape[1], dtype=torch.int64, device=probs.device)
    low = torch.tensor([k & _MASK32 for k in keys], device=probs.device).unsqueeze(1)
    high = torch.tensor([(k >> 32) & _MASK32 for k in keys], device=probs.device).unsqueeze(1)
    bits = _mix32((_mix32(i ^ low) + high) & _MASK32)
    u = ((bits >> 9).double() + 0.5) / 2 ** 23
    return (probs.double() / -torch.log(u)).argmax(dim=-1)
