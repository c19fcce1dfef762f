"""Paged decode attention (single pass and split-KV) against kernels.reference.decode_attention."""
import pytest
import torch

from kernels import reference
from kernels.paged_decode_attention import choose_num_splits, paged_decode_attention
from tests.kernels.paged import ATTN_TOL, DEVICE, HEADS, block_tables, param_id, random_cache

# 1 (the query alone), non-multiples of both block sizes, and more than one 64-key tile
SEQ_LENS = [1, 15, 33, 70]


def _check(seq_lens, dtype, head_dim, gqa, block_size, num_splits=None, seed=0):
    gen = torch.Generator().manual_seed(seed)
    num_heads, num_kv_heads = HEADS[gqa]
    num_blocks = sum(-(-n // block_size) for n in seq_lens) + 3
    cache = random_cache(num_blocks, block_size, num_kv_heads, head_dim, dtype, gen)
    tables = block_tables(seq_lens, block_size, num_blocks, gen)
    lens = torch.tensor(seq_lens, device=DEVICE)
    q = torch.randn((len(seq_lens), num_heads, head_dim), generator=gen).to(dtype).to(DEVICE)
    scale = head_dim ** -0.5
    out = paged_decode_attention(q, cache, tables, lens, scale, num_splits=num_splits)
    ref = reference.decode_attention(q, cache, tables, lens, scale)
    torch.testing.assert_close(out, ref, **ATTN_TOL[dtype])


@pytest.mark.parametrize("block_size", [16, 32])
@pytest.mark.parametrize("gqa", [1, 4, 8])
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=param_id)
def test_decode_matches_reference(dtype, head_dim, gqa, block_size):
    _check(SEQ_LENS, dtype, head_dim, gqa, block_size)


@pytest.mark.parametrize("dtype,head_dim,gqa,block_size,num_splits", [
    (torch.float32, 64, 1, 16, 2),
    (torch.float16, 64, 4, 32, 3),
    (torch.float32, 128, 8, 16, 3),
    (torch.float16, 128, 4, 16, 4),   # more splits than one row needs: empty splits weigh 0
], ids=param_id)
def test_split_kv_matches_reference(dtype, head_dim, gqa, block_size, num_splits):
    _check([1, 130, 47, 200], dtype, head_dim, gqa, block_size, num_splits=num_splits)


def test_out_of_place_rows_and_padding_row():
    """Writes into a strided view (the backend's out[:num_decodes]); a padding row of length 0
    (a CUDA-graph bucket) gets zeros, not NaN, and leaves the other rows alone."""
    gen = torch.Generator().manual_seed(1)
    cache = random_cache(8, 16, 2, 64, torch.float32, gen)
    tables = block_tables([20, 5], 16, 8, gen)
    q = torch.randn((2, 8, 64), generator=gen).to(DEVICE)
    big = torch.full((5, 8, 64), 7.0, device=DEVICE)
    lens = torch.tensor([20, 0], device=DEVICE)
    paged_decode_attention(q, cache, tables, lens, 0.125, out=big[1:3])
    ref = reference.decode_attention(q[:1], cache, tables[:1], lens[:1], 0.125)
    torch.testing.assert_close(big[1:2], ref, **ATTN_TOL[torch.float32])
    assert torch.equal(big[2], torch.zeros_like(big[2]))
    assert (big[0] == 7).all() and (big[3:] == 7).all()


def test_num_splits_fill_the_gpu_only_when_needed():
    assert choose_num_splits(num_programs=1024, max_len=32768) == 1   # the batch fills it
    assert choose_num_splits(num_programs=8, max_len=256) == 1        # too short to split
    assert choose_num_splits(num_programs=8, max_len=4096) == 16      # 4096 / 256 per split
    assert choose_num_splits(num_programs=8, max_len=1 << 20) == 32   # capped


@pytest.mark.cuda
@pytest.mark.parametrize("num_splits", [None, 1])
def test_long_context_bf16_on_gpu(num_splits):
    """GPU-sized: 8B-like heads, contexts up to 4096; None takes the split heuristic."""
    gen = torch.Generator().manual_seed(2)
    seq_lens, block_size = [4096, 1, 3001, 77], 16
    num_blocks = sum(-(-n // block_size) for n in seq_lens) + 8
    cache = random_cache(num_blocks, block_size, 8, 128, torch.bfloat16, gen)
    tables = block_tables(seq_lens, block_size, num_blocks, gen)
    lens = torch.tensor(seq_lens, device=DEVICE)
    q = torch.randn((4, 32, 128), generator=gen).to(torch.bfloat16).to(DEVICE)
    out = paged_decode_attention(q, cache, tables, lens, 128 ** -0.5, num_splits=num_splits)
    ref = reference.decode_attention(q.float(), cache.float(), tables, lens, 128 ** -0.5)
    torch.testing.assert_close(out.float(), ref, **ATTN_TOL[torch.bfloat16])
