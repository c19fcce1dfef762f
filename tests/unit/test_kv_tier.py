"""The second KV tier's accounting without a model: which blocks are stored into which slots when
the cache evicts them, which slots come back into which blocks on a hit, and LRU order."""
from hypothesis import given, settings, strategies as st

from services.scheduler.block_hash import extend_block_hashes
from services.scheduler.kv_cache_manager import KVCacheManager
from services.scheduler.tier import QUARANTINE_S, TierPool

BS = 4


def hashes(tokens):
    out: list[bytes] = []
    extend_block_hashes(out, tokens, BS, "")
    return out


_steps = iter(range(1, 1 << 30))


def _ran(kv: KVCacheManager):
    """The tier copies of the worker's next plan, whose step then answers."""
    event = ("step", next(_steps))
    stores, loads, _ = kv.take_tier_copies(event)
    kv.done(event)
    return stores, loads


def admit(kv: KVCacheManager, rid: str, tokens: list[int]) -> tuple[int, int]:
    """As Prefill admits a prompt: (blocks hit in the cache, blocks loaded from the tier)."""
    h = hashes(tokens)
    prefix = kv.find_prefix(h, len(tokens))
    in_tier = kv.find_tier(h, len(tokens), len(prefix))
    assert kv.allocate_slots(rid, len(tokens), prefix, in_tier) is not None
    kv.cache_blocks(rid, h, len(tokens))
    return len(prefix), len(in_tier)


def _stored(tier: TierPool, hashes, worker="w", event=("step", 0)) -> list[int | None]:
    """Stores as one step of `worker` that has answered."""
    slots = [tier.store(h, worker) for h in hashes]
    tier.seal(event, worker, [s for s in slots if s is not None], [])
    tier.done(event)
    return slots


def test_tier_slots_in_order_then_least_recently_used():
    tier = TierPool(3)
    a, b, c, d = (bytes([i]) * 16 for i in range(4))
    assert _stored(tier, [a, b, c]) == [0, 1, 2]
    assert _stored(tier, [a]) == [None]  # held already: now the most recent
    assert tier.lru_order() == [b, c, a]
    assert _stored(tier, [d]) == [1] and b not in tier  # b was least recent
    assert tier.find([c, a, d], "w") == [2, 0, 1] and tier.find([b, a], "w") == []
    assert tier.load([c], "w") == [2]  # pinned until its step answers, and the most recent
    tier.seal(("step", 1), "w", [], [2])
    assert tier.lru_order() == [a, d, c]
    assert _stored(tier, [b], event=("step", 2)) == [0]  # a's: c's slot is pinned
    assert tier.load([d, c], "w") == [1, 2] and tier.lru_order() == [b, d, c]
    tier.seal(("step", 3), "w", [], [1, 2])
    assert _stored(tier, [a], event=("step", 4)) == [0]  # b's: the one not pinned
    assert tier.lru_order() == [d, c, a]
    tier.done(("step", 1))
    assert _stored(tier, [b], event=("step", 5)) == [0]  # c is still pinned by step 3
    tier.done(("step", 3))
    assert tier.num_evicted == 4


def test_every_slot_pinned_or_pending_stores_nothing():
    tier = TierPool(2)
    a, b, c = (bytes([i]) * 16 for i in range(3))
    _stored(tier, [a, b])
    tier.load([a], "w")
    tier.seal(("step", 1), "w", [], [0])
    assert tier.store(c, "w") == 1  # b's, pending until step 2 answers
    tier.seal(("step", 2), "w", [1], [])
    assert tier.store(bytes([9]) * 16, "w") is None  # a pinned, c pending
    tier.done(("step", 1))
    tier.done(("step", 2))
    assert tier.store(bytes([9]) * 16, "w") == 0  # a's slot, the least recent


def test_a_shared_tier_shows_a_store_to_others_only_once_written():
    """Workers of a host share one tier: worker x's store is pending until the step that
    writes it answers; x itself may load it at once (its plans run in order), y may not."""
    tier = TierPool(4)
    h = bytes([7]) * 16
    slot = tier.store(h, "x")
    assert slot == 0 and tier.find([h], "x") == [0] and tier.find([h], "y") == []
    assert tier.store(h, "y") is None  # held already: y need not store it too
    tier.seal(("step", 1), "x", [slot], [])
    assert tier.find([h], "y") == []
    tier.done(("step", 1))
    assert tier.load([h], "y") == [0]


def test_a_worker_gone_mid_store_leaves_nothing_readable_and_its_pins_go():
    now = [0.0]
    tier = TierPool(2, clock=lambda: now[0])
    a, b, c = bytes([1]) * 16, bytes([2]) * 16, bytes([3]) * 16
    _stored(tier, [a], worker="y")
    assert tier.store(b, "x") == 1
    tier.seal(("step", 1), "x", [1], [])
    assert tier.load([a], "x") == [0]
    tier.seal(("step", 2), "x", [], [0])
    tier.worker_gone("x")  # dropped before either step answered
    assert b not in tier and tier.find([a], "y") == [0]
    # x's slot waits out the quarantine (x may still be writing it); a is not pinned any more
    assert tier.store(b, "y") == 0 and a not in tier
    tier.seal(("step", 3), "y", [0], [])
    assert tier.store(c, "y") is None  # slot 0 pending, slot 1 in quarantine
    now[0] = QUARANTINE_S
    assert tier.store(c, "y") == 1


def test_evicted_blocks_are_stored_and_a_hit_comes_back_into_fresh_blocks():
    kv = KVCacheManager(num_blocks=4, block_size=BS, tier=TierPool(8), owner="w")
    first = list(range(13))                  # blocks 0 1 2 3; 0 1 2 full and cached
    assert admit(kv, "a", first) == (0, 0)
    assert kv.get_block_ids("a") == [0, 1, 2, 3]
    kv.free("a")                             # free queue 3 2 1 0 (the tail first)
    assert _ran(kv) == ([], [])
    other = [100 + t for t in range(9)]      # three blocks: reuses 3, 2, 1
    assert admit(kv, "b", other) == (0, 0)
    assert kv.get_block_ids("b") == [3, 2, 1]
    # 3 held no full block; 2 and 1 held first's blocks 2 and 1 (evicted in that order)
    stores, loads = _ran(kv)
    assert stores == [(2, 0), (1, 1)] and loads == []
    kv.free("b")                             # free queue 0 1 2 3; b's 3 and 2 cached
    # first again: block 0 still caches its first block; its blocks 1 and 2 are in the tier
    assert admit(kv, "c", first) == (1, 2)
    assert kv.get_block_ids("c") == [0, 1, 2, 3]
    stores, loads = _ran(kv)
    # b's full blocks (2, then 3) were evicted for c's: stored first, then first's come back
    assert stores == [(2, 2), (3, 3)]
    assert loads == [(1, 1), (0, 2)]
    assert kv.num_tier_hit_tokens == 2 * BS and kv.num_hit_tokens == 3 * BS
    # the loaded blocks are cached at once: a later request hits them in the cache
    kv.free("c")
    assert admit(kv, "d", first[:12] + [7]) == (3, 0)
    assert kv.get_block_ids("d") == [0, 1, 2, 3]
    assert _ran(kv) == ([], [])


def test_blocks_next_in_line_for_eviction_are_stored_ahead_and_need_no_store_later():
    kv = KVCacheManager(num_blocks=6, block_size=BS, tier=TierPool(8), owner="w")
    a = list(range(9))
    admit(kv, "a", a)                      # blocks 0 1 2; 0 and 1 cached
    kv.free("a")                           # free queue 3 4 5 2 1 0
    stores, loads, early = kv.take_tier_copies(("step", 1), ahead=5)
    # the next five to go: 3 4 5 2 1, of which only 1 holds a cached block; 0 is further back
    assert (stores, loads, early) == ([], [], [(1, 0)])
    assert kv.tier.find(hashes(a)[:2], "other worker") == []  # pending until step 1 answers
    kv.done(("step", 1))
    assert kv.tier.find(hashes(a)[1:2], "other worker") == [0]
    assert kv.take_tier_copies(("step", 2), ahead=5) == ([], [], [])  # held already
    admit(kv, "b", [50 + t for t in range(17)])  # five blocks: 3 4 5 2 1 go
    assert _ran(kv) == ([], [])                  # 1's block is in the tier: nothing to store
    kv.free("b")
    assert admit(kv, "a2", a) == (1, 1)          # 0 still cached, 1 back from the tier
    assert kv.take_tier_copies(("step", 3))[1] == [(0, kv.get_block_ids("a2")[1])]


def test_a_slot_loaded_by_the_plan_is_not_reused_by_its_stores():
    kv = KVCacheManager(num_blocks=3, block_size=BS, tier=TierPool(2), owner="w")
    x = list(range(9))
    y = [50 + t for t in range(9)]
    admit(kv, "x", x)                         # blocks 0 1 2, 0 1 cached
    kv.free("x")                              # free: 2 1 0
    admit(kv, "y", y)                         # 2 1 0 again: x's 1, 0 go to slots 0, 1
    assert _ran(kv) == ([(1, 0), (0, 1)], [])
    kv.free("y")                              # free: 0 1 2, y's 1 and 2 cached
    # x: both its blocks in the tier (slots 1, 0). The blocks it gets evict y's; their stores
    # must not take slots 1 or 0 while this plan loads from them: the tier stores nothing
    assert admit(kv, "x2", x) == (0, 2)
    stores, loads = _ran(kv)
    assert loads == [(1, 0), (0, 1)] and stores == []
    assert hashes(y)[0] not in kv.tier and kv.tier.lru_order() == hashes(x)[:2]


@given(st.lists(st.tuples(st.integers(0, 5), st.integers(1, 14), st.booleans()), max_size=40))
@settings(max_examples=150, deadline=None)
def test_the_tier_never_hands_out_a_slot_twice_and_loads_read_what_was_stored(ops):
    """Random admissions and frees over a few prompt families: each slot holds one hash, every
    load reads a slot whose last store (or an earlier plan's) was that very hash, and blocks are
    conserved."""
    kv = KVCacheManager(num_blocks=6, block_size=BS, tier=TierPool(4), owner="w")
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
        in_tier = kv.find_tier(h, length, len(prefix))
        if kv.allocate_slots(f"r{i}", length, prefix, in_tier) is None:
            continue
        live.append(f"r{i}")
        stores, loads = _ran(kv)
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
        assert all(slot_holds[kv.tier.find([x], "w")[0]] == x for x in held)
    for rid in live:
        kv.free(rid)
    assert kv.num_free_blocks == 6


def test_workers_of_a_host_map_one_shared_tier_and_the_last_one_removes_it(tmp_path):
    import os

    import torch

    from common.kv_cache import SharedTier
    from common.kv_layout import KVLayout
    from common.shm_segments import sweep_stale_segments
    layout = KVLayout(num_layers=2, num_kv_heads=2, head_dim=8, block_size=4, dtype="float32")
    x = SharedTier(layout, 6, "host-a|model", shm_dir=tmp_path)
    y = SharedTier(layout, 10, "host-a|model", shm_dir=tmp_path)  # maps x's, at x's size
    other = SharedTier(layout, 3, "host-a|another model", shm_dir=tmp_path)
    assert x.tier_id == y.tier_id != other.tier_id and y.num_blocks == 6
    x.tensor[:, :, 4] = 2.5
    assert torch.equal(y.tensor[:, :, 4], torch.full_like(y.tensor[:, :, 4], 2.5))
    x.close()  # y still holds it
    assert y.path.exists() and sweep_stale_segments(tmp_path) == []
    y.close()
    assert not y.path.exists()
    # a segment whose workers all died (its lock went with them) is swept; the next worker
    # makes a new one, under a new id: the scheduler's index of the old one means nothing there
    os.close(other._fd)
    other._fd = None
    assert sweep_stale_segments(tmp_path) == [other.tier_id]
    z = SharedTier(layout, 3, "host-a|another model", shm_dir=tmp_path)
    assert z.tier_id != other.tier_id and z.path.exists()
    z.close()


def test_a_host_tier_is_shared_within_one_deployment_only(tiny_llama):
    """Two deployments on one host (two schedulers) never share a tier: each scheduler keeps
    the index of its own, and a shared segment would let one overwrite the other's blocks."""
    import torch

    from common.kv_layout import KVLayout
    from common.worker.config import WorkerConfig
    from common.worker.service import second_tier
    layout = KVLayout(num_layers=2, num_kv_heads=2, head_dim=8, block_size=4, dtype="float32")

    def tier(scheduler):
        cfg = WorkerConfig(role="decode", model=str(tiny_llama), scheduler=scheduler,
                           kv_offloading_blocks=4, kv_offloading_backend="host")
        return second_tier(cfg, layout, "host-a", "model", torch.device("cpu"))
    tiers = [tier("127.0.0.1:7001"), tier("127.0.0.1:7001"), tier("127.0.0.1:7002")]
    try:
        assert tiers[0].tier_id == tiers[1].tier_id != tiers[2].tier_id
    finally:
        for t in tiers:
            t.close()
    assert not any(t.path.exists() for t in tiers)
