"""Per-request view of one worker's blocks: which blocks each request holds, prefix hits, and
which of its full blocks are registered in the prefix cache. The only way to the block pool: the
scheduler never touches a reference count.

A request's blocks:

    [0, num_hit)            cached prefix found at admission (shared, ref counted)
    [num_hit, len(blocks))  its own, filled by compute (or by a KV transfer)

Blocks that something may still read or write (a planned step, an ordered KV send) are released
after that event rather than now: `free(request_id, after=event)` / `release(blocks, after=...)`
keep them referenced until `done(event)`.

With a second tier (tier.py, the worker's own or its host's), a cached block the pool evicts is
stored there first, and a request's prefix continues from the cache into the tier: those blocks
are new blocks of the request that the worker loads from the tier before its step computes. The
stores and loads go out with the worker's next plan (`take_tier_copies`), stores first.
"""
from __future__ import annotations

from collections import defaultdict
from collections.abc import Hashable, Iterable, Sequence

from services.scheduler.block_hash import HASH_BYTES
from services.scheduler.block_pool import BlockPool
from services.scheduler.tier import TierPool


class NoFreeBlocks(Exception):
    pass


class KVCacheManager:
    def __init__(self, num_blocks: int, block_size: int, enable_caching: bool = True,
                 tier: TierPool | None = None, owner: str = ""):
        self.block_size = block_size
        self.pool = BlockPool(num_blocks, enable_caching)
        self.tier = tier if enable_caching else None
        self.owner = owner  # the worker, as the tier knows it
        self._tier_stores: list[tuple[int, int]] = []  # (block, slot) for the next plan
        self._tier_loads: list[tuple[int, int]] = []   # (slot, block), after the stores
        if self.tier is not None:
            self.pool.on_evict = self._store
        self._blocks: dict[str, list[int]] = {}
        self._num_registered: dict[str, int] = {}  # leading blocks already in the prefix cache
        self._deferred: defaultdict[Hashable, list[list[int]]] = defaultdict(list)
        # cached blocks the worker has not been told of (it reports them to a new scheduler)
        self._announce: dict[int, bytes] = {}
        # prefix-cache lookups that led to an allocation, in tokens (vLLM's units for metrics)
        self.num_queried_tokens = 0
        self.num_hit_tokens = 0
        self.num_tier_hit_tokens = 0  # ... of the hits, those loaded from the tier
        self.num_tier_stores = 0

    @property
    def num_blocks(self) -> int:
        return self.pool.num_blocks

    @property
    def num_free_blocks(self) -> int:
        return self.pool.num_free_blocks

    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def find_prefix(self, block_hashes: list[bytes], num_tokens: int) -> list[int]:
        """Cached blocks holding the longest prefix of the sequence. At least one token is left
        to compute (its logits give the next token), so the last token's block never counts."""
        if not self.pool.enable_caching:
            return []
        hits = []
        for h in block_hashes[:(num_tokens - 1) // self.block_size]:
            b = self.pool.get_cached(h)
            if b is None:
                break
            hits.append(b)
        return hits

    def find_tier(self, block_hashes: list[bytes], num_tokens: int,
                  num_cached: int) -> list[bytes]:
        """The hashes of the blocks the tier holds of the sequence past its first num_cached
        (those the cache holds), the last token's block never counting (as find_prefix)."""
        if self.tier is None:
            return []
        run = block_hashes[num_cached:(num_tokens - 1) // self.block_size]
        return run[:len(self.tier.find(run, self.owner))]

    def num_hit_blocks(self, block_hashes: list[bytes], num_tokens: int) -> int:
        """Blocks of the sequence it would not compute: cached, then in the tier after that."""
        cached = len(self.find_prefix(block_hashes, num_tokens))
        return cached + len(self.find_tier(block_hashes, num_tokens, cached))

    def can_fit(self, request_id: str, num_tokens: int, prefix: Sequence[int] = ()) -> bool:
        held = self._blocks.get(request_id)
        if held is None:
            need = self.blocks_for(num_tokens) - len(prefix)
            need += sum(self.pool.ref_cnt[b] == 0 for b in prefix)  # they leave the free queue
        else:
            need = self.blocks_for(num_tokens) - len(held)
        return need <= self.pool.num_free_blocks

    def allocate_slots(self, request_id: str, num_tokens: int, prefix: Sequence[int] = (),
                       tier_hashes: Sequence[bytes] = (), lookup: bool = True) -> list[int] | None:
        """Grows the request's blocks to hold num_tokens tokens in all; a new request starts
        from the cached `prefix` blocks, then blocks loaded from the tier holding `tier_hashes`
        (find_tier's run after the prefix), and counts as a prefix-cache lookup unless not
        `lookup` (blocks for something other than a request, a prefix fill). Returns the newly
        allocated block ids (possibly none), or None when the pool cannot supply them, in which
        case nothing changes."""
        if not self.can_fit(request_id, num_tokens, prefix):
            return None
        held = self._blocks.get(request_id)
        loads: list[int] = []
        if held is None:
            if self.pool.enable_caching and lookup:
                self.num_queried_tokens += num_tokens
                self.num_hit_tokens += (len(prefix) + len(tier_hashes)) * self.block_size
                self.num_tier_hit_tokens += len(tier_hashes) * self.block_size
            self.pool.touch(list(prefix))
            held = self._blocks[request_id] = list(prefix)
            self._num_registered[request_id] = len(prefix)
            if tier_hashes:
                assert self.tier is not None, "tier hits without a tier"
                loads = self.tier.load(tier_hashes, self.owner)
                assert len(loads) == len(tier_hashes), "the tier lost a hit before its load"
        new = self._allocate(max(0, self.blocks_for(num_tokens) - len(held)))
        held.extend(new)
        if loads:  # cached at once: the plan's loads run before anything reads them
            self._tier_loads.extend(zip(loads, new))
            for b, h in zip(new, tier_hashes):
                if self.pool.cache(b, h):
                    self._announce[b] = h
            self._num_registered[request_id] += len(loads)
        return new

    def _store(self, block_id: int, block_hash: bytes) -> None:
        """BlockPool.on_evict with a tier: the block goes to a slot before it is reused."""
        assert self.tier is not None
        slot = self.tier.store(block_hash, self.owner)
        if slot is not None:
            self._tier_stores.append((block_id, slot))
            self.num_tier_stores += 1

    @property
    def has_tier_copies(self) -> bool:
        """Stores or loads wait for the worker's next plan (a plan that makes them)."""
        return bool(self._tier_stores or self._tier_loads)

    def take_tier_copies(self, event: Hashable, ahead: int = 0) -> tuple[
            list[tuple[int, int]], list[tuple[int, int]], list[tuple[int, int]]]:
        """For the worker's next plan, the step `event` (its done() ends them in the tier):
        (block, slot) stores and then (slot, block) loads since the last call, which it runs in
        that order before anything else; and (block, slot) stores ahead: the cached blocks among
        the next `ahead` the pool would evict that the tier lacks, which it copies in the
        background while the step computes. None of those blocks is written before the step
        has answered (the worker's later plans run after it), and once they are evicted their
        hashes are in the tier already: no store on a later step's path."""
        stores, loads = self._tier_stores, self._tier_loads
        self._tier_stores, self._tier_loads = [], []
        early: list[tuple[int, int]] = []
        if self.tier is None:
            return stores, loads, early
        for b in self.pool.next_evicted(ahead):
            h = self.pool.block_hash[b]
            if h is not None and h not in self.tier:
                slot = self.tier.store(h, self.owner)
                if slot is None:
                    break  # every slot pending or pinned
                early.append((b, slot))
        self.num_tier_stores += len(early)
        self.tier.seal(event, self.owner, [s for _, s in stores + early],
                       [s for s, _ in loads])
        return stores, loads, early

    def close(self) -> None:
        """The worker is gone: what it was to store in the tier, or was storing, is dropped
        there (nobody may read a block it may have half written), its loads unpinned."""
        if self.tier is not None:
            self.tier.abandon([s for _, s in self._tier_stores], [s for s, _ in self._tier_loads])
            self.tier.worker_gone(self.owner)
        self._tier_stores, self._tier_loads = [], []

    def fork(self, child_id: str, parent_id: str, num_tokens: int) -> tuple[int, int] | None:
        """Gives child_id the parent's first num_tokens tokens: their full blocks shared (one
        more reference each), a fresh block for the partial last one. Returns the copy the
        worker must make (parent's partial block, child's block), or None if nothing is copied.
        Raises NoFreeBlocks, changing nothing, when no block is free for the copy."""
        assert child_id not in self._blocks, f"{child_id} holds blocks already"
        parent = self._blocks[parent_id]
        full, partial = divmod(num_tokens, self.block_size)
        assert len(parent) >= full + (partial > 0), f"{parent_id} holds too few blocks"
        if partial and self.pool.num_free_blocks == 0:
            raise NoFreeBlocks(f"no block for {child_id}'s copy")
        shared = parent[:full]
        self.pool.touch(shared)
        self._blocks[child_id] = list(shared)
        self._num_registered[child_id] = min(full, self._num_registered[parent_id])
        if not partial:
            return None
        own = self._allocate(1)[0]
        self._blocks[child_id].append(own)
        return parent[full], own

    def cache_blocks(self, request_id: str, block_hashes: list[bytes], num_tokens: int) -> None:
        """Registers the request's full blocks among its first num_tokens (computed) tokens."""
        held = self._blocks.get(request_id)
        if held is None:
            return
        start = self._num_registered[request_id]
        end = min(num_tokens // self.block_size, len(block_hashes), len(held))
        for i in range(start, end):
            if self.pool.cache(held[i], block_hashes[i]):
                self._announce[held[i]] = block_hashes[i]
        self._num_registered[request_id] = max(start, end)

    def take_announcements(self) -> list[tuple[int, bytes]]:
        """(block id, hash) cached since the last call and still cached: for the worker's
        next plan."""
        out, self._announce = list(self._announce.items()), {}
        return out

    def seed(self, cached: Iterable[tuple[int, bytes]]) -> int:
        """A worker's report of the blocks its cache holds (a scheduler that starts anew):
        each becomes a free cached block, evicted after the blocks that hold nothing. Ids out
        of range, malformed hashes and repeats are left out. Returns how many were taken."""
        n = 0
        for b, h in cached:
            if 0 <= b < self.pool.num_blocks and len(h) == HASH_BYTES and \
                    self.pool.block_hash[b] is None and self.pool.ref_cnt[b] == 0 \
                    and self.pool.cache(b, h):
                self.pool.evict_last(b)
                n += 1
        return n

    def _allocate(self, n: int) -> list[int]:
        ids = self.pool.allocate(n)
        for b in ids:  # evicted: its tokens will be overwritten
            self._announce.pop(b, None)
        return ids

    def num_registered(self, request_id: str) -> int:
        return self._num_registered.get(request_id, 0)

    def get_block_ids(self, request_id: str) -> list[int]:
        return self._blocks.get(request_id, [])

    def holds(self, request_id: str) -> bool:
        return request_id in self._blocks

    def free(self, request_id: str, after: Hashable | None = None) -> None:
        """Forgets the request's blocks; releases them now, or once `after` is done."""
        self._num_registered.pop(request_id, None)
        self.release(self._blocks.pop(request_id, []), after)

    def hold(self, block_ids: Sequence[int]) -> None:
        """One more reference to each block, the scheduler's own (a block a planned copy reads,
        which its request may free before the copy runs); `release` drops it."""
        self.pool.touch(list(block_ids))

    def release(self, block_ids: Sequence[int], after: Hashable | None = None) -> None:
        """Drops one reference of each block now, or once `after` is done."""
        if after is None:
            self.pool.free(list(block_ids))
        elif block_ids:
            self._deferred[after].append(list(block_ids))

    def done(self, event: Hashable) -> None:
        """Releases every block deferred until `event` (and the tier's stores and loads of the
        step it is)."""
        for blocks in self._deferred.pop(event, []):
            self.pool.free(blocks)
        if self.tier is not None:
            self.tier.done(event)

    def num_deferred(self, event: Hashable) -> int:
        return sum(map(len, self._deferred.get(event, [])))

    def request_ids(self) -> list[str]:
        return list(self._blocks)
