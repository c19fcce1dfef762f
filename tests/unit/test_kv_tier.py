"""The second KV tier's accounting without a model: which blocks are stored into which slots when
the cache evicts them, which slots come back into which blocks on a hit, and LRU order."""
from hypothesis import given, settings, strategies as st

from services.scheduler.block_hash import extend_block_hashes
from services.scheduler.kv_cache_manager import KVCacheManager
from services.scheduler.tier import TierPool

BS = 4


def hashes(tokens):
    out: list[bytes] = []
    extend_block_hashes(out, tokens, BS, "")
    return out


def admit(kv: KVCacheManager, rid: str, tokens: list[int]) -> tuple[int, int]:
    """As Prefill admits a prompt: (blocks hit in the cache, blocks loaded from the tier)."""
    h = hashes(tokens)
    prefix = kv.find_prefix(h, len(tokens))
    in_tier = h[len(prefix):len(prefix) + kv.find_tier(h, len(tokens), len(prefix))]
    assert kv.allocate_slots(rid, len(tokens), prefix, in_tier) is not None
    kv.cache_blocks(rid, h, len(tokens))
    return len(prefix), len(in_tier)


def test_tier_slots_in_order_then_least_recently_used():
    tier = TierPool(3)
    a, b, c, d = (bytes([i]) * 16 for i in range(4))
    assert [tier.store(x) for x in (a, b, c)] == [0, 1, 2]
    assert tier.store(a) is None  # held already: now the most recent
    assert tier.lru_order() == [b, c, a]
    assert tier.store(d) == 1 and b not in tier  # b was least recent
    assert tier.find([c, a, d]) == [2, 0, 1] and tier.find([b, a]) == []
    assert tier.load([c]) == [2]  # pinned until unpinned, and the most recent
    assert tier.lru_order() == [a, d, c]
    assert tier.store(b) == 0  # a's slot: c's is pinned though c is not least recent
    assert tier.load([d, c]) == [1, 2] and tier.lru_order() == [b, d, c]
    assert tier.store(a) == 0 and tier.lru_order() == [d, c, a]  # b's: the one not pinned
    tier.unpin_all()
    assert tier.num_evicted == 3


def test_every_slot_pinned_stores_nothing():
    tier = TierPool(2)
    a, b, c = (bytes([i]) * 16 for i in range(3))
    tier.store(a), tier.store(b)
    tier.load([a, b])
    assert tier.store(c) is None and c not in tier
    tier.unpin_all()
    assert tier.store(c) == 0  # a's slot, the least recent


def test_evicted_blocks_are_stored_and_a_hit_comes_back_into_fresh_blocks():
    kv = KVCacheManager(num_blocks=4, block_size=BS, num_tier_slots=8)
    first = list(range(13))                  # blocks 0 1 2 3; 0 1 2 full and cached
    assert admit(kv, "a", first) == (0, 0)
    assert kv.get_block_ids("a") == [0, 1, 2, 3]
    kv.free("a")                             # free queue 3 2 1 0 (the tail first)
    assert kv.take_tier_copies() == ([], [])
    other = [100 + t for t in range(9)]      # three blocks: reuses 3, 2, 1
    assert admit(kv, "b", other) == (0, 0)
    assert kv.get_block_ids("b") == [3, 2, 1]
    # 3 held no full block; 2 and 1 held first's blocks 2 and 1 (evicted in that order)
    stores, loads = kv.take_tier_copies()
    assert stores == [(2, 0), (1, 1)] and loads == []
    kv.free("b")                             # free queue 0 1 2 3; b's 3 and 2 cached
    # first again: block 0 still caches its first block; its blocks 1 and 2 are in the tier
    assert admit(kv, "c", first) == (1, 2)
    assert kv.get_block_ids("c") == [0, 1, 2, 3]
    stores, loads = kv.take_tier_copies()
    # b's full blocks (2, then 3) were evicted for c's: stored first, then first's come back
    assert stores == [(2, 2), (3, 3)]
    assert loads == [(1, 1), (0, 2)]
    assert kv.num_tier_hit_tokens == 2 * BS and kv.num_hit_tokens == 3 * BS
    # the loaded blocks are cached at once: a later request hits them in the cache
    kv.free("c")
    assert admit(kv, "d", first[:12] + [7]) == (3, 0)
    assert kv.get_block_ids("d") == [0, 1, 2, 3]
    assert kv.take_tier_copies() == ([], [])


def test_a_slot_loaded_by_the_plan_is_not_reused_by_its_stores():
    kv = KVCacheManager(num_blocks=3, block_size=BS, num_tier_slots=2)
    x = list(range(9))
    y = [50 + t for t in range(9)]
    admit(kv, "x", x)                         # blocks 0 1 2, 0 1 cached
    kv.free("x")                              # free: 2 1 0
    admit(kv, "y", y)                         # 2 1 0 again: x's 1, 0 go to slots 0, 1
    assert kv.take_tier_copies() == ([(1, 0), (0, 1)], [])
    kv.free("y")                              # free: 0 1 2, y's 1 and 2 cached
    # x: both its blocks in the tier (slots 1, 0). The blocks it gets evict y's; their stores
    # must not take slots 1 or 0 while this plan loads from them: the tier stores nothing
    assert admit(kv, "x2", x) == (0, 2)
    stores, loads = kv.take_tier_copies()
    assert loads == [(1, 0), (0, 1)] and stores == []
    assert hashes(y)[0] not in kv.tier and kv.tier.lru_order() == hashes(x)[:2]


@given(st.lists(st.tuples(st.integers(0, 5), st.integers(1, 14), st.booleans()), max_size=40))
@settings(max_examples=150, deadline=None)
def test_the_tier_never_hands_out_a_slot_twice_and_loads_read_what_was_stored(ops):
    """Random admissions and frees over a few prompt families: each slot holds one hash, every
    load reads a slot whose last store (or an earlier plan's) was that very hash, and blocks are
    conserved."""
    kv = KVCacheManager(num_blocks=6, block_size=BS, num_tier_slots=4)
    slot_holds: dict[int, bytes] = {}   # what the worker's tier would hold, slot by slot
    block_holds: dict[int, bytes] = {}  # hash of the tokens each cached block holds
    live: list[str] = []
    for i, (family, length, free_one) in enumerate(ops):
        if free_one and live:
            kv.free(live.pop(0))
            continue
        tokens = [family * 1000 + t for t in range(length)]
        if not kv.can_fit(f"r{i}", length):
            continue
        h = hashes(tokens)
        prefix = kv.find_prefix(h, length)
        in_tier = h[len(prefix):len(prefix) + kv.find_tier(h, length, len(prefix))]
        if kv.allocate_slots(f"r{i}", length, prefix, in_tier) is None:
            continue
        live.append(f"r{i}")
        stores, loads = kv.take_tier_copies()
        for b, s in stores:  # run as the worker would: stores first
            slot_holds[s] = block_holds[b]
        for s, b in loads:
            assert slot_holds[s] in in_tier
            block_holds[b] = slot_holds[s]
        for j, b in enumerate(kv.get_block_ids(f"r{i}")[:len(h)]):
            block_holds[b] = h[j]
        kv.cache_blocks(f"r{i}", h, length)
        held = kv.tier.lru_order()
        assert len(set(held)) == len(held) <= 4
        assert all(slot_holds[kv.tier.find([x])[0]] == x for x in held)
    for rid in live:
        kv.free(rid)
    assert kv.num_free_blocks == 6
