"""Random paged KV caches and block tables for the kernel tests."""
from __future__ import annotations

import torch

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"

# kernel vs reference, both in the tested dtype: fp32 differs by summation order only; fp16 by a
# few ulps of outputs of magnitude ~1 (probabilities are rounded to fp16 before the PV product)
ATTN_TOL = {torch.float32: dict(atol=2e-5, rtol=2e-5), torch.float16: dict(atol=5e-3, rtol=5e-3),
            torch.bfloat16: dict(atol=3e-2, rtol=3e-2)}
# GQA ratio -> (num_heads, num_kv_heads): MHA, GQA, and MQA (one kv head)
HEADS = {1: (2, 2), 2: (8, 4), 4: (8, 2), 8: (8, 1)}


def random_cache(num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int,
                 dtype: torch.dtype, gen: torch.Generator, device: str = DEVICE) -> torch.Tensor:
    """[2, num_blocks, block_size, num_kv_heads, head_dim], random everywhere: a kernel reading a
    slot it should not gets garbage, not a convenient zero."""
    shape = (2, num_blocks, block_size, num_kv_heads, head_dim)
    return torch.randn(shape, generator=gen).to(dtype).to(device)


def block_tables(seq_lens: list[int], block_size: int, num_blocks: int,
                 gen: torch.Generator, device: str = DEVICE) -> torch.Tensor:
    """[num_seqs, max_blocks] of distinct, scattered block ids (rows zero-padded)."""
    need = [-(-n // block_size) for n in seq_lens]
    ids = torch.randperm(num_blocks, generator=gen)[:sum(need)].tolist()
    assert len(ids) == sum(need), "cache too small for the test's sequences"
    table = torch.zeros((len(seq_lens), max(need)), dtype=torch.long)
    for i, n in enumerate(need):
        table[i, :n] = torch.tensor(ids[:n])
        ids = ids[n:]
    return table.to(device)


def slots_of(table: torch.Tensor, start: int, end: int, block_size: int) -> torch.Tensor:
    """Slots of positions [start, end) of the sequence with this block table row."""
    pos = torch.arange(start, end, device=table.device)
    return table[pos // block_size] * block_size + pos % block_size


def param_id(value) -> str:
    """Readable test ids: float16-64-4-16 rather than dtype1-64-4-16."""
    return str(value).removeprefix("torch.")
