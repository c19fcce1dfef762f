"""Prefix caching in the block pool and KV cache manager: exact block ids, ref counts, eviction."""
from hypothesis import given, settings, strategies as st

from services.scheduler.block_hash import extend_block_hashes
import pytest

from services.scheduler.kv_cache_manager import KVCacheManager, NoFreeBlocks

BS = 4


def hashes(tokens, salt=""):
    out = []
    extend_block_hashes(out, tokens, BS, salt)
    return out


def admit(kv, rid, tokens, salt=""):
    h = hashes(tokens, salt)
    prefix = kv.find_prefix(h, len(tokens))
    assert kv.allocate_slots(rid, len(tokens), prefix) is not None
    kv.cache_blocks(rid, h, len(tokens))
    return prefix


def test_chained_hashes_and_salt():
    a = hashes(list(range(10)))
    assert len(a) == 2  # only full blocks
    assert hashes(list(range(8)) + [99, 98]) == a  # the partial tail does not count
    assert hashes([0, 1, 2, 3, 9, 9, 9, 9])[0] == a[0]
    assert hashes([0, 1, 2, 3, 9, 9, 9, 9])[1] != a[1]
    assert hashes([7, 1, 2, 3, 4, 5, 6, 7])[1] != a[1]  # chained: same tokens, other parent
    assert hashes(list(range(10)), salt="tenant-a") != a
    grown = list(a)
    extend_block_hashes(grown, list(range(12)), BS)
    assert grown[:2] == a and len(grown) == 3


def test_shared_prefix_reuses_blocks_with_ref_counts():
    kv = KVCacheManager(num_blocks=10, block_size=BS)
    prompt = list(range(10))
    assert admit(kv, "a", prompt) == []
    assert kv.get_block_ids("a") == [0, 1, 2]
    # same first 8 tokens: two full blocks hit; the last token's block never does
    assert admit(kv, "b", prompt[:8] + [50, 51]) == [0, 1]
    assert kv.get_block_ids("b") == [0, 1, 3]
    assert kv.pool.ref_cnt[:4] == [2, 2, 1, 1]
    # a prompt of exactly two blocks hits only the first: its last token must be computed
    assert admit(kv, "c", prompt[:8]) == [0]
    assert kv.get_block_ids("c") == [0, 4]
    for rid in "abc":
        kv.free(rid)
    assert kv.num_free_blocks == 10 and kv.pool.ref_cnt == [0] * 10


def test_lru_eviction_order_and_hits_on_free_blocks():
    kv = KVCacheManager(num_blocks=6, block_size=BS)
    admit(kv, "a", list(range(9)))          # blocks 0 1 2, full ones 0 1 cached
    kv.free("a")                            # free queue: 3 4 5 | 2 1 0 (tail of a first)
    assert kv.pool.free_block_ids() == [3, 4, 5, 2, 1, 0]
    # a hit on a free cached block takes it out of the free queue
    assert admit(kv, "b", list(range(8)) + [7]) == [0, 1]
    assert kv.pool.free_block_ids() == [4, 5, 2]
    assert kv.get_block_ids("b") == [0, 1, 3]
    kv.free("b")
    # allocation evicts from the front: block 2 had no hash, then 3 ... 0 and 1 go last
    assert kv.allocate_slots("c", 4 * BS) == [4, 5, 2, 3]
    assert kv.pool.get_cached(hashes(list(range(8)))[0]) == 0  # still cached, still free
    assert kv.allocate_slots("c", 5 * BS) == [1]
    assert kv.pool.get_cached(hashes(list(range(8)))[1]) is None  # evicted with block 1


def test_disabled_caching_never_hits():
    kv = KVCacheManager(num_blocks=6, block_size=BS, enable_caching=False)
    admit(kv, "a", list(range(9)))
    assert admit(kv, "b", list(range(9))) == []
    assert not kv.pool.cached


def test_fork_shares_full_blocks_and_copies_the_partial_one():
    kv = KVCacheManager(num_blocks=5, block_size=BS)
    admit(kv, "a", list(range(10)))                      # blocks 0 1 | 2 (2 tokens)
    assert kv.fork("b", "a", 10) == (2, 3)               # copy a's partial block 2 into 3
    assert kv.get_block_ids("b") == [0, 1, 3]
    assert kv.fork("c", "a", 8) is None                  # a whole number of blocks: no copy
    assert kv.get_block_ids("c") == [0, 1]
    assert kv.pool.ref_cnt == [3, 3, 1, 1, 0]
    assert kv.num_registered("b") == kv.num_registered("c") == 2
    kv.allocate_slots("c", 9)                            # c's own next block
    assert kv.get_block_ids("c") == [0, 1, 4]
    with pytest.raises(NoFreeBlocks):                    # no block left for d's copy
        kv.fork("d", "a", 10)
    assert not kv.holds("d") and kv.pool.ref_cnt == [3, 3, 1, 1, 1]
    kv.free("a")
    assert kv.pool.ref_cnt == [2, 2, 0, 1, 1] and kv.pool.free_block_ids() == [2]
    kv.free("b")
    kv.free("c")
    assert kv.num_free_blocks == 5


# ---- property test -------------------------------------------------------------------------

ops = st.lists(st.tuples(st.sampled_from(["admit", "append", "free", "preempt", "fork"]),
                         st.integers(0, 5), st.integers(1, 14), st.integers(0, 2)),
               min_size=1, max_size=60)


@settings(max_examples=150, deadline=None)
@given(ops)
def test_invariants_under_random_traffic(ops):
    """After every step: no block owned twice by one request, ref counts equal live references,
    free + referenced = total, cached hashes point at blocks holding those tokens."""
    kv = KVCacheManager(num_blocks=12, block_size=BS)
    live: dict[str, list[int]] = {}
    content: dict[int, tuple] = {}  # block -> the tokens its KV holds (full blocks only)
    for op, rid_n, n, variant in ops:
        rid = f"r{rid_n}"
        if op == "admit" and rid not in live:
            tokens = [variant] * 3 + list(range(n))  # few variants: many shared prefixes
            h = hashes(tokens)
            prefix = kv.find_prefix(h, len(tokens))
            for i, b in enumerate(prefix):
                assert content[b] == tuple(tokens[i * BS:(i + 1) * BS])
            if kv.allocate_slots(rid, len(tokens), prefix) is not None:
                live[rid] = tokens
                _fill(kv, rid, tokens, content)
        elif op == "append" and rid in live:
            tokens = live[rid] + [variant] * n
            if kv.allocate_slots(rid, len(tokens)) is not None:
                live[rid] = tokens
                _fill(kv, rid, tokens, content)
        elif op == "fork" and rid not in live and f"r{variant}" in live:
            parent = live[f"r{variant}"]  # a sample of r<variant>'s sequence so far
            try:
                copy = kv.fork(rid, f"r{variant}", len(parent))
            except NoFreeBlocks:
                copy = "refused"
            if copy != "refused":
                live[rid] = list(parent)
                _fill(kv, rid, parent, content)
        elif op in ("free", "preempt") and rid in live:
            kv.free(rid)
            del live[rid]
        _check(kv, live, content)
    for rid in list(live):
        kv.free(rid)
    assert kv.num_free_blocks == 12


def _fill(kv, rid, tokens, content):
    """The worker computes the KV; then the full blocks are registered."""
    blocks = kv.get_block_ids(rid)
    for i in range(len(tokens) // BS):
        if kv.pool.block_hash[blocks[i]] is None:
            content[blocks[i]] = tuple(tokens[i * BS:(i + 1) * BS])
    kv.cache_blocks(rid, hashes(tokens), len(tokens))


def _check(kv, live, content):
    refs = [0] * kv.num_blocks
    for rid in live:
        blocks = kv.get_block_ids(rid)
        assert len(blocks) == len(set(blocks)), "a request owns a block twice"
        assert len(blocks) == kv.blocks_for(len(live[rid]))
        for b in blocks:
            refs[b] += 1
    assert refs == kv.pool.ref_cnt
    free = kv.pool.free_block_ids()
    assert sorted(free) == [b for b in range(kv.num_blocks) if refs[b] == 0]
    assert kv.num_free_blocks + sum(r > 0 for r in refs) == kv.num_blocks
    for h, b in kv.pool.cached.items():
        assert kv.pool.block_hash[b] == h
        assert content.get(b) is not None
