"""Block copies between caches `[layers, 2, blocks, ...]`: one copy per run of consecutive ids,
or (scattered ids within one GPU) gathered in bounded pieces. Both land exactly the blocks named,
in a whole cache and in a head-sliced view of one, and touch nothing else."""
import pytest
import torch

from common.kv_cache import block_runs, copy_blocks, gather_blocks

SHAPE = (3, 2, 16, 4, 2, 8)  # layers, k/v, blocks, block size, kv heads, head dim


def _caches():
    g = torch.Generator().manual_seed(0)
    return torch.randn(SHAPE, generator=g), torch.randn(SHAPE, generator=g)


def _want(dst, dst_ids, src, src_ids):
    want = dst.clone()
    for d, s in zip(dst_ids, src_ids):
        want[:, :, d] = src[:, :, s]
    return want


def test_runs_are_where_both_lists_advance_by_one():
    assert block_runs([4, 5, 6, 7, 1], [0, 1, 7, 8, 2]) == [(4, 0, 2), (6, 7, 2), (1, 2, 1)]
    assert block_runs([], []) == []


@pytest.mark.parametrize("max_bytes", [1, 3 * 2 * 4 * 2 * 8 * 4 * 3, 1 << 30],
                         ids=["a block at a time", "three blocks at a time", "all at once"])
def test_gathered_copies_land_exactly_the_named_blocks(max_bytes):
    src, dst = _caches()
    src_ids, dst_ids = [3, 15, 0, 7, 8, 9, 2], [11, 2, 5, 6, 14, 0, 9]
    want = _want(dst, dst_ids, src, src_ids)
    gather_blocks(dst, dst_ids, src, src_ids, max_bytes)
    assert torch.equal(dst, want)


def test_copies_into_a_head_slice_of_a_cache_leave_the_other_heads():
    src, dst = _caches()
    src_ids, dst_ids = [1, 2, 3, 10], [4, 5, 6, 0]
    view = dst[..., 1:, :]  # a rank's heads of a wider cache: not contiguous
    want = dst.clone()
    want[..., 1:, :] = _want(view, dst_ids, src[..., :1, :], src_ids)
    gather_blocks(view, dst_ids, src[..., :1, :], src_ids, max_bytes=1)
    assert torch.equal(dst, want)
    src, dst = _caches()
    view = dst[..., 1:, :]
    copy_blocks(view, dst_ids, src[..., :1, :], src_ids)  # runs: [1-3 -> 4-6], [10 -> 0]
    assert torch.equal(dst, want)


@pytest.mark.cuda
def test_scattered_ids_on_a_gpu_are_gathered():
    src, dst = (t.cuda() for t in _caches())
    src_ids, dst_ids = [3, 15, 0, 7, 8], [11, 2, 5, 6, 14]
    want = _want(dst, dst_ids, src, src_ids)
    copy_blocks(dst, dst_ids, src, src_ids)
    assert torch.equal(dst, want)
