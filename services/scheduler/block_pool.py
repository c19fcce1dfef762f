"""Block ids of one worker's KV cache: ref counts, an LRU free queue, and the prefix cache's
hash -> block map. Knows nothing of requests.

A free block may still hold a cached prefix: it stays findable by hash until it is handed out
again. The free queue is in eviction order: the front is reused (and its hash forgotten) first.
"""
from __future__ import annotations

import itertools
from collections import OrderedDict
from collections.abc import Callable


class BlockPool:
    def __init__(self, num_blocks: int, enable_caching: bool = True):
        assert num_blocks > 0, "a block pool needs at least one block"
        self.num_blocks = num_blocks
        self.enable_caching = enable_caching
        self.ref_cnt = [0] * num_blocks
        self.block_hash: list[bytes | None] = [None] * num_blocks
        self.cached: dict[bytes, int] = {}
        self._free: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))
        # told of each cached block that allocate() evicts, before it is handed out
        self.on_evict: Callable[[int, bytes], None] | None = None

    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    def free_block_ids(self) -> list[int]:
        """In eviction order (tests and invariant checks)."""
        return list(self._free)

    def next_evicted(self, n: int) -> list[int]:
        """The free blocks the next allocations of n blocks would take, in that order."""
        return list(itertools.islice(self._free, n))

    def allocate(self, n: int) -> list[int]:
        """n blocks from the front of the free queue, each with a reference count of 1; a block
        that held a cached prefix is evicted from the cache."""
        assert 0 <= n <= len(self._free), f"asked for {n} blocks, {len(self._free)} free"
        ids = []
        for _ in range(n):
            b, _ = self._free.popitem(last=False)
            h = self.block_hash[b]
            if h is not None:
                del self.cached[h]
                self.block_hash[b] = None
                if self.on_evict is not None:
                    self.on_evict(b, h)
            self.ref_cnt[b] = 1
            ids.append(b)
        return ids

    def touch(self, ids: list[int]) -> None:
        """One more reference to each (cached) block; a free one leaves the free queue."""
        for b in ids:
            if self.ref_cnt[b] == 0:
                del self._free[b]
            self.ref_cnt[b] += 1

    def free(self, ids: list[int]) -> None:
        """Drops one reference of each block. Blocks at zero join the back of the free queue,
        last block first, so that a sequence's tail is evicted before its (more shareable) head."""
        for b in reversed(ids):
            assert self.ref_cnt[b] > 0, f"block {b} freed with no reference"
            self.ref_cnt[b] -= 1
            if self.ref_cnt[b] == 0:
                self._free[b] = None

    def evict_last(self, block_id: int) -> None:
        """A free block to the back of the free queue: reused after every other free block."""
        self._free.move_to_end(block_id)

    def get_cached(self, block_hash: bytes) -> int | None:
        return self.cached.get(block_hash)

    def cache(self, block_id: int, block_hash: bytes) -> bool:
        """Makes a full, computed block findable by its hash; whether it did. If another block
        already holds the same tokens, that one stays the cached copy and this one stays
        anonymous."""
        if not self.enable_caching or block_hash in self.cached:
            return False
        assert self.block_hash[block_id] is None, f"block {block_id} is cached twice"
        self.cached[block_hash] = block_id
        self.block_hash[block_id] = block_hash
        return True
