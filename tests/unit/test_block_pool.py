from services.scheduler.block_pool import BlockPool
from services.scheduler.kv_cache_manager import KVCacheManager


def test_pool_hands_out_in_order_and_reuses_tail_first():
    pool = BlockPool(8)
    assert pool.allocate(3) == [0, 1, 2]
    assert pool.allocate(2) == [3, 4]
    pool.free([0, 1, 2])
    assert pool.num_free_blocks == 6
    # queue now: 5 6 7 then 2 1 0 (a sequence's tail is reused before its head)
    assert pool.allocate(5) == [5, 6, 7, 2, 1]
    assert pool.ref_cnt == [0, 1, 1, 1, 1, 1, 1, 1]


def test_manager_grows_requests_block_by_block():
    kv = KVCacheManager(num_blocks=6, block_size=4)
    assert kv.allocate_slots("a", 5) == [0, 1]
    assert kv.allocate_slots("a", 8) == []        # still fits in block 1
    assert kv.allocate_slots("a", 9) == [2]
    assert kv.allocate_slots("b", 4) == [3]
    assert kv.get_block_ids("a") == [0, 1, 2]
    assert kv.allocate_slots("c", 12) is None      # needs 3, only 2 free: nothing changes
    assert not kv.holds("c") and kv.num_free_blocks == 2
    kv.free("a")
    assert kv.num_free_blocks == 5
    assert kv.allocate_slots("c", 12) == [4, 5, 2]
    kv.free("b")
    kv.free("c")
    assert kv.num_free_blocks == kv.num_blocks == 6
    assert kv.pool.ref_cnt == [0] * 6


def test_a_release_after_an_event_waits_for_it():
    kv = KVCacheManager(num_blocks=4, block_size=2)
    kv.allocate_slots("a", 4)
    kv.allocate_slots("b", 2)
    kv.free("a", after=("step", 7))
    assert not kv.holds("a") and kv.num_free_blocks == 1 and kv.num_deferred(("step", 7)) == 2
    kv.hold([2])  # the scheduler's own reference: b's block stays while a copy reads it
    kv.free("b")
    kv.release([2], after=("step", 7))
    kv.done(("step", 8))
    assert kv.num_free_blocks == 1
    kv.done(("step", 7))
    assert kv.num_free_blocks == 4 and kv.pool.ref_cnt == [0] * 4
    assert kv.pool.free_block_ids() == [3, 1, 0, 2]  # a's tail first, then the copy source
