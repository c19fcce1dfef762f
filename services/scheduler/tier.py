"""A second KV tier (--kv-offloading-size): slots in a larger, slower memory behind the caches,
indexed by block hash; one worker's own, or one shared by every worker of a host. Knows
nothing of requests or of blocks of the caches.

A cached block a worker's cache is about to reuse is stored in a slot first (the plan that
reuses it copies it out before anything writes the block); a prefix hit in the tier is loaded
back into fresh blocks instead of being recomputed. The tier evicts least recently used: a
store or a hit makes a hash the most recent.

Workers run their plans concurrently, each its own in order, so a slot changes hands only when
nobody can be touching it:

- a stored slot is *pending* until the step whose plan writes it has answered (`done(event)`):
  only its writer finds it meanwhile (its later plans run after the store); if the writer is
  dropped first, the slot is forgotten (`worker_gone`), so nobody ever reads a half-written
  block, and handed out again only after QUARANTINE_S (a worker dropped while still running,
  a frozen one, may yet finish the step that writes it);
- a slot a plan loads from is *pinned* until that step has answered: no store reuses it.

A worker's stores and loads are tied to the step that runs them when its plan is made
(`seal(event, ...)`).
"""
from __future__ import annotations

import time
from collections import Counter, OrderedDict, deque
from collections.abc import Callable, Hashable, Sequence

QUARANTINE_S = 600.0  # far past any step a dropped worker may still be running


class TierPool:
    def __init__(self, num_slots: int, clock: Callable[[], float] = time.monotonic):
        assert num_slots > 0, "a tier needs at least one slot"
        self.num_slots = num_slots
        self.clock = clock
        self._quarantine: deque[tuple[float, int]] = deque()  # (since, slot) of dropped stores
        self._slot_of: OrderedDict[bytes, int] = OrderedDict()  # LRU first
        self._hash_of: dict[int, bytes] = {}
        self._free = list(range(num_slots - 1, -1, -1))  # popped from the end: 0, 1, 2, ...
        self._writer: dict[int, str] = {}  # pending slot -> the worker storing it
        self._pins: Counter[int] = Counter()  # slot -> loads planned and not yet answered
        self._events: dict[Hashable, tuple[str, list[int], list[int]]] = {}
        self.num_evicted = 0

    def __len__(self) -> int:
        return len(self._slot_of)

    def __contains__(self, block_hash: bytes) -> bool:
        return block_hash in self._slot_of

    def lru_order(self) -> list[bytes]:
        """Hashes held (pending ones too), least recently used first (tests, invariants)."""
        return list(self._slot_of)

    def store(self, block_hash: bytes, worker: str) -> int | None:
        """The slot `worker` is to copy a block of this hash into, pending until the step doing
        it answers; or None: the tier holds the hash already (it becomes the most recent), or
        every slot is pending or pinned."""
        if block_hash in self._slot_of:
            self._slot_of.move_to_end(block_hash)
            return None
        while self._quarantine and self._quarantine[0][0] + QUARANTINE_S <= self.clock():
            self._free.append(self._quarantine.popleft()[1])
        if self._free:
            slot = self._free.pop()
        else:
            victim = next((h for h, s in self._slot_of.items()
                           if s not in self._writer and not self._pins[s]), None)
            if victim is None:
                return None
            slot = self._slot_of.pop(victim)
            self.num_evicted += 1
        self._slot_of[block_hash] = slot
        self._hash_of[slot] = block_hash
        self._writer[slot] = worker
        return slot

    def find(self, block_hashes: Sequence[bytes], worker: str) -> list[int]:
        """Slots holding the longest run of the hashes from the first on that `worker` may
        read: written, or pending by itself."""
        slots = []
        for h in block_hashes:
            slot = self._slot_of.get(h)
            if slot is None or self._writer.get(slot, worker) != worker:
                break
            slots.append(slot)
        return slots

    def load(self, block_hashes: Sequence[bytes], worker: str) -> list[int]:
        """find(), for a plan of `worker` that copies the slots into its cache: they become the
        most recent and stay pinned until its step answers."""
        slots = self.find(block_hashes, worker)
        for h, s in zip(block_hashes, slots):
            self._slot_of.move_to_end(h)
            self._pins[s] += 1
        return slots

    def seal(self, event: Hashable, worker: str, stored: Sequence[int],
             loaded: Sequence[int]) -> None:
        """The step `event` of `worker` runs these stores and loads (too): done(event) ends
        them."""
        if stored or loaded:
            _, s, l_ = self._events.setdefault(event, (worker, [], []))
            s.extend(stored)
            l_.extend(loaded)

    def done(self, event: Hashable) -> None:
        """The step has answered: its stores are written, its loads read."""
        entry = self._events.pop(event, None)
        if entry is None:
            return
        _, stored, loaded = entry
        for s in stored:
            self._writer.pop(s, None)
        self._unpin(loaded)

    def abandon(self, stored: Sequence[int], loaded: Sequence[int]) -> None:
        """Stores and loads of a worker that was dropped: the stored slots are forgotten and
        quarantined, the loaded ones unpinned."""
        for s in stored:
            if self._writer.pop(s, None) is not None:
                del self._slot_of[self._hash_of.pop(s)]
                self._quarantine.append((self.clock(), s))
        self._unpin(loaded)

    def worker_gone(self, worker: str) -> None:
        """Every sealed step of `worker` that has not answered will not: abandoned."""
        for event, (w, stored, loaded) in list(self._events.items()):
            if w == worker:
                del self._events[event]
                self.abandon(stored, loaded)

    def _unpin(self, slots: Sequence[int]) -> None:
        for s in slots:
            self._pins[s] -= 1
            if not self._pins[s]:
                del self._pins[s]
