"""Decode attention over a paged KV cache: one query token per sequence.

Reference: `kernels.reference.decode_attention`. A program owns one (sequence, kv head, split):
it loads the whole query-head group that shares the kv head (GQA/MQA), so every key and value is
read from memory once per group, not once per query head. The group is padded to at least 16
rows because `tl.dot` needs it on tensor cores; decode is memory-bound, the padding is free.

Split-KV (flash-decoding): with few sequences and long contexts, (batch x kv heads) programs
cannot fill the GPU, so the context is cut into num_splits ranges of split_len positions, each
writes a partial (max, sum, unnormalized output) and a second kernel combines them:

    positions  [0, split_len) | [split_len, 2 * split_len) | ... | [.., seq_len)
    partials       m0, l0, o0 |                m1, l1, o1 | ...
    out = sum_i 2^(m_i - M) o_i / sum_i 2^(m_i - M) l_i,   M = max_i m_i

Scores live in the log2 domain (scale * log2(e) folded into the scale) so that exp2 is used.

Nothing that follows the context's length is a compile-time constant or a specialized argument:
split_len, num_splits and the block table's row stride change from step to step where steps run
eagerly (mixed steps, batches past the largest CUDA graph, --enforce-eager), and Triton compiles
a kernel again (0.5-0.7 s on an H200) for each new constant, and for each new case of an integer
argument being 1, a multiple of 16 or neither. Two variants remain (one split or several), both
compiled when a worker captures its CUDA graphs.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

TILE_N = 64               # key positions per loop step; independent of the cache's block size
MIN_SPLIT_LEN = 256       # a split shorter than this costs more in the combine than it saves
TARGET_PROGRAMS = 512     # about 4 programs per SM on an H100: enough to hide memory latency
MAX_SPLITS = 32


@dataclass(frozen=True)
class DecodeConfig:
    tile_n: int = TILE_N
    num_warps: int = 4
    num_stages: int = 3
    target_programs: int = TARGET_PROGRAMS


def default_decode_config(dtype: torch.dtype) -> DecodeConfig:
    """16-bit caches: two warps per program (`benchmarks/kernels.py --sweep` on an H200, bf16,
    head_dim 128: 17-24% less time than four at batch 8-64 and 1-4k contexts, 84-90% of peak
    bandwidth from batch 16; one microsecond more at batch 1, where launches dominate). fp32
    tiles are twice the registers: four."""
    if dtype == torch.float32:
        return DecodeConfig()
    return DecodeConfig(num_warps=2)


@triton.jit(do_not_specialize=["stride_tb", "split_len", "num_splits"])
def _decode_kernel(
    q_ptr,                       # [batch, num_heads, head_dim]
    cache_ptr,                   # [2, num_blocks, block_size, num_kv_heads, head_dim]
    table_ptr,                   # [batch, max_blocks]
    seq_lens_ptr,                # [batch]
    out_ptr,                     # [batch, num_heads, head_dim]          (not SPLIT)
    part_out_ptr,                # [batch, num_heads, num_splits, head_dim] fp32  (SPLIT)
    part_m_ptr, part_l_ptr,      # [batch, num_heads, num_splits] fp32
    scale_log2,
    stride_qb, stride_qh, stride_ob, stride_oh, stride_tb,
    stride_ckv, stride_cb, stride_cs, stride_ch,
    split_len, num_splits,       # a multiple of TILE_N; the grid's third dimension
    GROUP: tl.constexpr, GROUP_P2: tl.constexpr, HEAD_DIM: tl.constexpr,
    BLOCK_SIZE: tl.constexpr, TILE_N: tl.constexpr, SPLIT: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    seq, kv_head, split = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    seq_len = tl.load(seq_lens_ptr + seq)
    start = split * split_len
    end = tl.minimum(seq_len, start + split_len)

    offs_g = tl.arange(0, GROUP_P2)
    offs_d = tl.arange(0, HEAD_DIM)
    offs_n = tl.arange(0, TILE_N)
    heads = kv_head * GROUP + offs_g                                      # [GROUP_P2]
    g_mask = offs_g < GROUP

    # load the query-head group: it stays in registers for the whole loop
    q = tl.load(q_ptr + seq * stride_qb + heads[:, None] * stride_qh + offs_d[None, :],
                mask=g_mask[:, None], other=0.0)                         # [GROUP_P2, HEAD_DIM]
    m_i = tl.full([GROUP_P2], float("-inf"), tl.float32)
    l_i = tl.zeros([GROUP_P2], tl.float32)
    acc = tl.zeros([GROUP_P2, HEAD_DIM], tl.float32)
    k_base = cache_ptr + kv_head * stride_ch
    v_base = k_base + stride_ckv

    for tile in range(start, end, TILE_N):
        # gather the tile's keys and values through the block table
        pos = tile + offs_n                                               # [TILE_N]
        n_mask = pos < end
        block = tl.load(table_ptr + seq * stride_tb + pos // BLOCK_SIZE, mask=n_mask, other=0)
        row = block.to(tl.int64) * stride_cb + (pos % BLOCK_SIZE) * stride_cs
        k = tl.load(k_base + row[:, None] + offs_d[None, :], mask=n_mask[:, None], other=0.0)
        v = tl.load(v_base + row[:, None] + offs_d[None, :], mask=n_mask[:, None], other=0.0)
        # online softmax, fp32 statistics                                 # [GROUP_P2, TILE_N]
        s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * scale_log2
        s = tl.where(n_mask[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
        m_i = m_new

    if not SPLIT:
        # a padding row (seq_len 0) writes zeros, not NaN
        out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
        tl.store(out_ptr + seq * stride_ob + heads[:, None] * stride_oh + offs_d[None, :],
                 out.to(out_ptr.dtype.element_ty), mask=g_mask[:, None])
    else:
        num_heads = tl.num_programs(1) * GROUP
        part = (seq * num_heads + heads) * num_splits + split             # [GROUP_P2]
        tl.store(part_out_ptr + part[:, None] * HEAD_DIM + offs_d[None, :], acc,
                 mask=g_mask[:, None])
        tl.store(part_m_ptr + part, m_i, mask=g_mask)
        tl.store(part_l_ptr + part, l_i, mask=g_mask)


@triton.jit(do_not_specialize=["num_splits"])
def _combine_kernel(
    part_out_ptr,                # [batch, num_heads, num_splits, head_dim] fp32
    part_m_ptr, part_l_ptr,      # [batch, num_heads, num_splits] fp32
    out_ptr,                     # [batch, num_heads, head_dim]
    stride_ob, stride_oh, num_splits,
    HEAD_DIM: tl.constexpr, SPLITS_P2: tl.constexpr,
):
    seq, head = tl.program_id(0), tl.program_id(1)
    offs_s = tl.arange(0, SPLITS_P2)
    offs_d = tl.arange(0, HEAD_DIM)
    s_mask = offs_s < num_splits
    part = (seq * tl.num_programs(1) + head) * num_splits + offs_s        # [SPLITS_P2]
    # an empty split (past its sequence's end) has m = -inf, l = 0, o = 0: weight 0
    m_part = tl.load(part_m_ptr + part, mask=s_mask, other=float("-inf"))
    l_part = tl.load(part_l_ptr + part, mask=s_mask, other=0.0)
    o_part = tl.load(part_out_ptr + part[:, None] * HEAD_DIM + offs_d[None, :],
                     mask=s_mask[:, None], other=0.0)                     # [SPLITS_P2, HEAD_DIM]
    m_max = tl.max(m_part, 0)
    m_max = tl.where(m_max == float("-inf"), 0.0, m_max)
    w = tl.exp2(m_part - m_max)
    den = tl.sum(l_part * w, 0)
    out = tl.sum(o_part * w[:, None], 0) / tl.where(den > 0, den, 1.0)    # [HEAD_DIM]
    tl.store(out_ptr + seq * stride_ob + head * stride_oh + offs_d,
             out.to(out_ptr.dtype.element_ty))


def choose_num_splits(num_programs: int, max_len: int, target: int = TARGET_PROGRAMS) -> int:
    """Splits per sequence so that about `target` programs run; 1 when already there."""
    if num_programs >= target or max_len <= MIN_SPLIT_LEN:
        return 1
    return max(1, min(MAX_SPLITS, -(-target // num_programs), max_len // MIN_SPLIT_LEN))


def paged_decode_attention(q: torch.Tensor, kv_cache: torch.Tensor, block_tables: torch.Tensor,
                           seq_lens: torch.Tensor, scale: float, out: torch.Tensor | None = None,
                           num_splits: int | None = None,
                           config: DecodeConfig | None = None) -> torch.Tensor:
    """q: [batch, num_heads, head_dim]; block_tables: [batch, max_blocks]; seq_lens: [batch]
    (the query's own key included, already in the cache) -> [batch, num_heads, head_dim].

    num_splits: None picks it from the table's width, a host-side shape: no device sync, and a
    CUDA graph captured with a fixed table width keeps a fixed split count."""
    batch, num_heads, head_dim = q.shape
    two, _, block_size, num_kv_heads, cache_dim = kv_cache.shape
    assert two == 2 and cache_dim == head_dim, (
        f"cache {tuple(kv_cache.shape)} vs q {tuple(q.shape)}")
    assert num_heads % num_kv_heads == 0, f"{num_heads} heads over {num_kv_heads} kv heads"
    assert block_tables.dim() == 2 and block_tables.shape[0] == batch, (
        f"block_tables {tuple(block_tables.shape)} for a batch of {batch}")
    assert seq_lens.shape == (batch,), f"seq_lens {tuple(seq_lens.shape)} for a batch of {batch}"
    assert q.dtype == kv_cache.dtype, f"q {q.dtype} != cache {kv_cache.dtype}"
    assert not block_tables.dtype.is_floating_point and not seq_lens.dtype.is_floating_point
    assert q.stride(-1) == kv_cache.stride(-1) == 1, "head_dim must be contiguous"
    assert block_tables.stride(1) == 1 and seq_lens.stride(0) == 1, "tables and lens contiguous"
    assert head_dim & (head_dim - 1) == 0 and head_dim >= 16, f"head_dim {head_dim} unsupported"
    if out is None:
        out = torch.empty_like(q)
    assert out.shape == q.shape and out.dtype == q.dtype and out.stride(-1) == 1
    if batch == 0:
        return out

    cfg = config or default_decode_config(q.dtype)
    group = num_heads // num_kv_heads
    max_len = max(1, block_tables.shape[1] * block_size)
    if num_splits is None:
        num_splits = choose_num_splits(batch * num_kv_heads, max_len, cfg.target_programs)
    split_len = triton.cdiv(triton.cdiv(max_len, num_splits), cfg.tile_n) * cfg.tile_n
    num_splits = triton.cdiv(max_len, split_len)
    if num_splits > 1:
        part_out = torch.empty((batch, num_heads, num_splits, head_dim), dtype=torch.float32,
                               device=q.device)
        part_m = torch.empty((batch, num_heads, num_splits), dtype=torch.float32, device=q.device)
        part_l = torch.empty_like(part_m)
    else:
        part_out = part_m = part_l = out  # unused
    _decode_kernel[(batch, num_kv_heads, num_splits)](
        q, kv_cache, block_tables, seq_lens, out, part_out, part_m, part_l,
        scale * math.log2(math.e),
        q.stride(0), q.stride(1), out.stride(0), out.stride(1), block_tables.stride(0),
        kv_cache.stride(0), kv_cache.stride(1), kv_cache.stride(2), kv_cache.stride(3),
        split_len, num_splits,
        GROUP=group, GROUP_P2=max(16, triton.next_power_of_2(group)), HEAD_DIM=head_dim,
        BLOCK_SIZE=block_size, TILE_N=cfg.tile_n, SPLIT=num_splits > 1,
        DOT_PRECISION=dot_precision(q.dtype), num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )
    if num_splits > 1:  # one variant for every count it picks: tiny partials, masked past it
        _combine_kernel[(batch, num_heads)](
            part_out, part_m, part_l, out, out.stride(0), out.stride(1), num_splits,
            HEAD_DIM=head_dim, SPLITS_P2=triton.next_power_of_2(max(num_splits, MAX_SPLITS)),
        )
    return out


def dot_precision(dtype: torch.dtype) -> str:
    """fp32 inputs multiply in full precision (tf32 would miss the torch path by ~1e-3);
    16-bit inputs ignore the setting."""
    return "ieee" if dtype == torch.float32 else "tf32"
