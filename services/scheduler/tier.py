"""A worker's second KV tier (--kv-offloading-size): slots in a larger, slower memory behind its
cache, indexed by block hash. Knows nothing of requests or blocks of the cache.

A cached block about to be reused by the cache is stored in a slot first (the plan that reuses
it copies it out before anything writes it); a prefix hit in the tier is loaded back into fresh
blocks of the cache instead of being recomputed. The tier evicts least recently used: a store
or a hit makes a hash the most recent.

Slots that a plan under construction loads from are pinned until the plan is taken: the worker
runs a plan's stores before its loads, so a store of that plan must not reuse such a slot.
"""
from __future__ import annotations

from collections import OrderedDict


class TierPool:
    def __init__(self, num_slots: int):
        assert num_slots > 0, "a tier needs at least one slot"
        self.num_slots = num_slots
        self._slot_of: OrderedDict[bytes, int] = OrderedDict()  # LRU first
        self._free = list(range(num_slots - 1, -1, -1))  # popped from the end: 0, 1, 2, ...
        self._pinned: set[int] = set()
        self.num_evicted = 0

    def __len__(self) -> int:
        return len(self._slot_of)

    def __contains__(self, block_hash: bytes) -> bool:
        return block_hash in self._slot_of

    def lru_order(self) -> list[bytes]:
        """Hashes held, least recently used first (tests and invariant checks)."""
        return list(self._slot_of)

    def store(self, block_hash: bytes) -> int | None:
        """The slot a block of this hash is to be copied into, or None: the tier holds it
        already (it becomes the most recent), or every slot is pinned."""
        if block_hash in self._slot_of:
            self._slot_of.move_to_end(block_hash)
            return None
        if self._free:
            slot = self._free.pop()
        else:
            victim = next((h for h, s in self._slot_of.items() if s not in self._pinned), None)
            if victim is None:
                return None
            slot = self._slot_of.pop(victim)
            self.num_evicted += 1
        self._slot_of[block_hash] = slot
        return slot

    def find(self, block_hashes: list[bytes]) -> list[int]:
        """Slots holding the longest run of the hashes from the first on."""
        slots = []
        for h in block_hashes:
            slot = self._slot_of.get(h)
            if slot is None:
                break
            slots.append(slot)
        return slots

    def load(self, block_hashes: list[bytes]) -> list[int]:
        """find(), for a plan that copies the slots into the cache: they become the most recent
        and stay pinned until unpin_all()."""
        slots = self.find(block_hashes)
        for h, s in zip(block_hashes, slots):
            self._slot_of.move_to_end(h)
            self._pinned.add(s)
        return slots

    def unpin_all(self) -> None:
        """The plan that loads from the pinned slots was taken: later plans run after it."""
        self._pinned.clear()
