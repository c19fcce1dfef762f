"""benchmarks/attention_resident.py's plain read, which read_ceiling.py sets beside the decode
kernels: it reads each sequence's own blocks (up to its length, not its padded table), keys and
values, and nothing else."""
import numpy as np
import pytest
import torch

from benchmarks.attention import HEAD_DIM, KV_HEADS, padded_tables
from benchmarks.attention_resident import block_reader, read_over


def xor_sum(cache: torch.Tensor, blocks: list[int]) -> int:
    """read_blocks' sum: each 8-byte word of a key block xor its value word, summed mod 2**64."""
    k = cache[0, blocks].contiguous().view(torch.int64).numpy().view(np.uint64)
    v = cache[1, blocks].contiguous().view(torch.int64).numpy().view(np.uint64)
    return int(np.bitwise_xor(k, v).sum(dtype=np.uint64))


@pytest.mark.parametrize("dtype, block", [(torch.float32, 16), (torch.bfloat16, 16),
                                          (torch.bfloat16, 32)])
def test_the_plain_read_takes_each_sequences_blocks_up_to_its_length(dtype, block):
    gen = torch.Generator().manual_seed(0)
    rows = [[7, 2], [0, 5, 9, 3], [11]]  # 2, 4 and 1 blocks; the tables pad to 4
    lens = torch.tensor([block + 1, 3 * block + 2, 1])  # use 2, 4 and 1 of them
    caches = [torch.randn((2, 12, block, KV_HEADS, HEAD_DIM), generator=gen).to(dtype)
              for _ in range(2)]
    call = read_over((None, caches, padded_tables(rows), lens), block_reader())
    used = [7, 2, 0, 5, 9, 3, 11]
    assert call() == xor_sum(caches[0], used)
    assert call() == xor_sum(caches[1], used)  # each call the next layer's cache
    assert xor_sum(caches[0], used) != xor_sum(caches[0], used + [0])  # padding would show
