"""Causal prefill attention of a variable-length batch over the paged KV cache.

Reference: `kernels.reference.prefill_attention`, once per sequence. The chunk's own keys and
values must already be in the cache (`reshape_and_cache` first): every key is then read through
the block table, cached prefix and new chunk alike. For sequence i:

    positions   [0, num_cached[i])  |  [num_cached[i], num_cached[i] + q_len[i])
                cached prefix          this chunk: q rows query_start_loc[i] .. query_start_loc[i+1]

A query at position p sees keys [0, p]. A program owns BLOCK_M query rows of one sequence and one
query head, and walks the keys up to its last row's position (flash attention, online softmax).
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from kernels.paged_decode_attention import dot_precision


@dataclass(frozen=True)
class PrefillConfig:
    block_m: int = 64         # query rows per program
    block_n: int = 64         # keys per loop step
    num_warps: int = 8
    num_stages: int = 3


def default_config(dtype: torch.dtype, head_dim: int) -> PrefillConfig:
    """16-bit: 64 x 64 tiles, four warps, two stages (`benchmarks/kernels.py --sweep` on an H200,
    bf16, head_dim 128: the best of 30 configurations on three of four shapes and within 3% on
    the fourth; half the time of eight warps and three stages at 4k tokens). fp32 tiles take
    twice the shared memory: half the keys per step."""
    if dtype == torch.float32:
        return PrefillConfig(block_n=32, num_warps=4 if head_dim <= 64 else 8)
    return PrefillConfig(num_warps=4, num_stages=2)


@triton.jit
def _attend_tile(q, m_i, l_i, acc, tile, k_base, v_base, table_ptr, q_pos, kv_end, offs_n, offs_d,
                 scale_log2, stride_cb, stride_cs,
                 BLOCK_SIZE: tl.constexpr, MASKED: tl.constexpr, DOT_PRECISION: tl.constexpr):
    """One key tile's online-softmax update; MASKED only for tiles that cross the diagonal or
    the end (the others are visible to every row, and skip the compare and select)."""
    pos = tile + offs_n                                                   # [BLOCK_N]
    if MASKED:
        n_mask = pos < kv_end
        block = tl.load(table_ptr + pos // BLOCK_SIZE, mask=n_mask, other=0)
    else:
        block = tl.load(table_ptr + pos // BLOCK_SIZE)
    row = block.to(tl.int64) * stride_cb + (pos % BLOCK_SIZE) * stride_cs
    if MASKED:
        k = tl.load(k_base + row[:, None] + offs_d[None, :], mask=n_mask[:, None], other=0.0)
        v = tl.load(v_base + row[:, None] + offs_d[None, :], mask=n_mask[:, None], other=0.0)
    else:
        k = tl.load(k_base + row[:, None] + offs_d[None, :])
        v = tl.load(v_base + row[:, None] + offs_d[None, :])
    s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * scale_log2  # [BLOCK_M, BLOCK_N]
    if MASKED:
        s = tl.where(pos[None, :] <= q_pos[:, None], s, float("-inf"))   # also masks pos >= kv_end
    m_new = tl.maximum(m_i, tl.max(s, 1))
    alpha = tl.exp2(m_i - m_new)
    p = tl.exp2(s - m_new[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
    return m_new, l_i, acc


@triton.jit(do_not_specialize=["stride_tb"])  # the table's width follows the longest sequence
def _prefill_kernel(
    q_ptr,                       # [num_tokens, num_heads, head_dim]
    cache_ptr,                   # [2, num_blocks, block_size, num_kv_heads, head_dim]
    table_ptr,                   # [num_seqs, max_blocks]
    query_start_ptr,             # [num_seqs + 1]
    num_cached_ptr,              # [num_seqs]
    out_ptr,                     # [num_tokens, num_heads, head_dim]
    scale_log2,
    stride_qt, stride_qh, stride_ot, stride_oh, stride_tb,
    stride_ckv, stride_cb, stride_cs, stride_ch,
    GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_SIZE: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, DOT_PRECISION: tl.constexpr,
):
    # heads vary fastest and the longest row tiles (the last ones, which see the most keys)
    # start first, so that the short tiles fill in behind them
    head, seq = tl.program_id(0), tl.program_id(1)
    m_block = tl.num_programs(2) - 1 - tl.program_id(2)
    q_start = tl.load(query_start_ptr + seq)
    q_len = tl.load(query_start_ptr + seq + 1) - q_start
    if m_block * BLOCK_M >= q_len:
        return  # the grid is sized for the longest chunk
    num_cached = tl.load(num_cached_ptr + seq)
    kv_head = head // GROUP

    offs_m = m_block * BLOCK_M + tl.arange(0, BLOCK_M)                  # rows of the chunk
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, HEAD_DIM)
    m_mask = offs_m < q_len
    q_pos = num_cached + offs_m                                           # [BLOCK_M]

    # load q: it stays in registers for the whole loop                   # [BLOCK_M, HEAD_DIM]
    rows = (q_start + offs_m)[:, None]
    q = tl.load(q_ptr + rows * stride_qt + head * stride_qh + offs_d[None, :],
                mask=m_mask[:, None], other=0.0)
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM], tl.float32)
    k_base = cache_ptr + kv_head * stride_ch
    v_base = k_base + stride_ckv
    table = table_ptr + seq * stride_tb

    # keys before the tile's first query position are visible to all its rows: no mask; causal:
    # nothing past its last query position
    full_end = (num_cached + m_block * BLOCK_M) // BLOCK_N * BLOCK_N
    kv_end = tl.minimum(num_cached + q_len, num_cached + (m_block + 1) * BLOCK_M)
    for tile in range(0, full_end, BLOCK_N):
        m_i, l_i, acc = _attend_tile(q, m_i, l_i, acc, tile, k_base, v_base, table, q_pos,
                                     kv_end, offs_n, offs_d, scale_log2, stride_cb, stride_cs,
                                     BLOCK_SIZE, False, DOT_PRECISION)
    for tile in range(full_end, kv_end, BLOCK_N):
        m_i, l_i, acc = _attend_tile(q, m_i, l_i, acc, tile, k_base, v_base, table, q_pos,
                                     kv_end, offs_n, offs_d, scale_log2, stride_cb, stride_cs,
                                     BLOCK_SIZE, True, DOT_PRECISION)

    out = acc / l_i[:, None]  # every row sees at least key 0
    tl.store(out_ptr + rows * stride_ot + head * stride_oh + offs_d[None, :],
             out.to(out_ptr.dtype.element_ty), mask=m_mask[:, None])


def paged_prefill_attention(q: torch.Tensor, kv_cache: torch.Tensor, block_tables: torch.Tensor,
                            query_start_loc: torch.Tensor, num_cached: torch.Tensor,
                            max_query_len: int, scale: float,
                            out: torch.Tensor | None = None,
                            config: PrefillConfig | None = None) -> torch.Tensor:
    """q: [num_tokens, num_heads, head_dim], the chunks one after another; block_tables:
    [num_seqs, max_blocks]; query_start_loc: [num_seqs + 1] (0 first, num_tokens last);
    num_cached: [num_seqs]; max_query_len: the longest chunk, a host int (sizes the grid without
    a device sync). Returns [num_tokens, num_heads, head_dim]."""
    _, num_heads, head_dim = q.shape
    two, _, block_size, num_kv_heads, cache_dim = kv_cache.shape
    num_seqs = num_cached.shape[0]
    assert two == 2 and cache_dim == head_dim, (
        f"cache {tuple(kv_cache.shape)} vs q {tuple(q.shape)}")
    assert num_heads % num_kv_heads == 0, f"{num_heads} heads over {num_kv_heads} kv heads"
    assert block_tables.dim() == 2 and block_tables.shape[0] == num_seqs, (
        f"block_tables {tuple(block_tables.shape)} for {num_seqs} sequences")
    assert query_start_loc.shape == (num_seqs + 1,), (
        f"query_start_loc {tuple(query_start_loc.shape)} for {num_seqs} sequences")
    assert q.dtype == kv_cache.dtype, f"q {q.dtype} != cache {kv_cache.dtype}"
    assert not any(t.dtype.is_floating_point for t in (block_tables, query_start_loc, num_cached))
    assert q.stride(-1) == kv_cache.stride(-1) == 1, "head_dim must be contiguous"
    assert block_tables.stride(1) == 1 and query_start_loc.stride(0) == num_cached.stride(0) == 1
    assert head_dim & (head_dim - 1) == 0 and head_dim >= 16, f"head_dim {head_dim} unsupported"
    if out is None:
        out = torch.empty_like(q)
    assert out.shape == q.shape and out.dtype == q.dtype and out.stride(-1) == 1
    if num_seqs == 0 or max_query_len == 0:
        return out
    cfg = config or default_config(q.dtype, head_dim)
    grid = (num_heads, num_seqs, triton.cdiv(max_query_len, cfg.block_m))
    _prefill_kernel[grid](
        q, kv_cache, block_tables, query_start_loc, num_cached, out,
        scale * math.log2(math.e),
        q.stride(0), q.stride(1), out.stride(0), out.stride(1), block_tables.stride(0),
        kv_cache.stride(0), kv_cache.stride(1), kv_cache.stride(2), kv_cache.stride(3),
        GROUP=num_heads // num_kv_heads, HEAD_DIM=head_dim, BLOCK_SIZE=block_size,
        BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, DOT_PRECISION=dot_precision(q.dtype),
        num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )
    return out
