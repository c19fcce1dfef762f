"""Varlen causal prefill over the paged cache against kernels.reference.prefill_attention."""
import itertools

import pytest
import torch

from kernels import reference
from kernels.paged_prefill_attention import PrefillConfig, paged_prefill_attention
from kernels.reshape_and_cache import reshape_and_cache
from tests.kernels.paged import (ATTN_TOL, DEVICE, HEADS, block_tables, param_id, random_cache,
                                 slots_of)

# (num_cached, chunk) per sequence, one batch: a one-token prompt, a fresh prompt, prefix-cached
# chunks (prefix a non-multiple and a multiple of the block size), and a chunk longer than one
# 64-row query tile
SEQS = [(0, 1), (0, 37), (13, 20), (32, 7), (5, 70)]


def _check(seqs, dtype, head_dim, gqa, block_size, seed=0, config=None):
    gen = torch.Generator().manual_seed(seed)
    num_heads, num_kv_heads = HEADS[gqa]
    lens = [c + n for c, n in seqs]
    num_blocks = sum(-(-n // block_size) for n in lens) + 3
    cache = random_cache(num_blocks, block_size, num_kv_heads, head_dim, dtype, gen)
    tables = block_tables(lens, block_size, num_blocks, gen)
    num_tokens = sum(n for _, n in seqs)

    def rand(heads):
        return torch.randn((num_tokens, heads, head_dim), generator=gen).to(dtype).to(DEVICE)

    q, k, v = rand(num_heads), rand(num_kv_heads), rand(num_kv_heads)
    starts = [0]
    for _, n in seqs:
        starts.append(starts[-1] + n)
    # the prefixes are whatever the random cache holds; the chunks are written first
    slots = torch.cat([slots_of(tables[i], c, c + n, block_size) for i, (c, n) in enumerate(seqs)])
    reshape_and_cache(k, v, cache, slots)
    scale = head_dim ** -0.5
    out = paged_prefill_attention(
        q, cache, tables, torch.tensor(starts, device=DEVICE),
        torch.tensor([c for c, _ in seqs], device=DEVICE), max(n for _, n in seqs), scale,
        config=config)
    # bf16 is checked against fp32 math: a bf16 reference would add its own rounding
    ref_dtype = torch.float32 if dtype == torch.bfloat16 else dtype
    q, k, v, cache = (t.to(ref_dtype) for t in (q, k, v, cache))
    for i, (c, _) in enumerate(seqs):
        a, b = starts[i], starts[i + 1]
        ref = reference.prefill_attention(q[a:b], k[a:b], v[a:b], cache, tables[i], c, scale)
        torch.testing.assert_close(out[a:b].to(ref_dtype), ref, **ATTN_TOL[dtype],
                                   msg=lambda m: f"seq {i}: {m}")


SHAPES = list(itertools.product([torch.float32, torch.float16], [64, 128], [1, 4, 8], [16, 32]))
# Under the CPU interpreter (~1.7 s a case here) a pairwise cover of them: every value of each
# parameter beside every value of each other one at least once; on a GPU all of them.
PAIRWISE = [(torch.float32, 64, 1, 16), (torch.float16, 128, 1, 32),
            (torch.float32, 128, 4, 32), (torch.float16, 64, 4, 16),
            (torch.float32, 64, 8, 32), (torch.float16, 128, 8, 16)]


def test_the_pairwise_cover_covers_every_pair():
    for i, j in itertools.combinations(range(4), 2):
        assert ({(c[i], c[j]) for c in PAIRWISE} == {(c[i], c[j]) for c in SHAPES}), (i, j)


@pytest.mark.parametrize("dtype,head_dim,gqa,block_size", SHAPES if DEVICE == "cuda" else PAIRWISE,
                         ids=param_id)
def test_prefill_matches_reference(dtype, head_dim, gqa, block_size):
    _check(SEQS, dtype, head_dim, gqa, block_size)


@pytest.mark.parametrize("config", [PrefillConfig(block_m=16, block_n=16, num_warps=4),
                                    PrefillConfig(block_m=32, block_n=64, num_warps=4)],
                         ids=["m16n16", "m32n64"])
def test_small_tiles_cross_many_unmasked_key_tiles(config):
    """Tiles smaller than the prefixes and chunks: most key tiles lie wholly before their rows
    (the unmasked loop), and key tiles wider than row tiles cross the diagonal."""
    _check(SEQS + [(40, 50)], torch.float32, 64, 4, 16, config=config)


def test_single_sequence_and_strided_out():
    """One sequence; writes a view of a larger output (the backend's out[num_decodes:])."""
    gen = torch.Generator().manual_seed(3)
    cache = random_cache(4, 16, 2, 64, torch.float32, gen)
    tables = block_tables([40], 16, 4, gen)
    q = torch.randn((3 + 40, 4, 64), generator=gen).to(DEVICE)
    k, v = (torch.randn((40, 2, 64), generator=gen).to(DEVICE) for _ in range(2))
    reshape_and_cache(k, v, cache, slots_of(tables[0], 0, 40, 16))
    out = torch.full_like(q, 7.0)
    paged_prefill_attention(q[3:], cache, tables, torch.tensor([0, 40], device=DEVICE),
                            torch.tensor([0], device=DEVICE), 40, 0.125, out=out[3:])
    ref = reference.prefill_attention(q[3:], k, v, cache, tables[0], 0, 0.125)
    torch.testing.assert_close(out[3:], ref, **ATTN_TOL[torch.float32])
    assert (out[:3] == 7).all()


@pytest.mark.cuda
def test_long_prompts_bf16_on_gpu():
    _check([(0, 1000), (512, 300), (0, 1)], torch.bfloat16, head_dim=128, gqa=4, block_size=16)
