"""Block ids of one worker's KV cache: a free queue and reference counts. Knows nothing of requests."""
from __future__ import annotations

from collections import deque


class BlockPool:
    """Free blocks are handed out from the front of the queue; freed blocks join at the back."""

    def __init__(self, num_blocks: int):
        assert num_blocks > 0, "a block pool needs at least one block"
        self.num_blocks = num_blocks
        self.ref_cnt = [0] * num_blocks
        self._free: deque[int] = deque(range(num_blocks))

    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    def allocate(self, n: int) -> list[int]:
        """n fresh blocks with a reference count of 1 each."""
        assert 0 <= n <= len(self._free), f"asked for {n} blocks, {len(self._free)} free"
        ids = [self._free.popleft() for _ in range(n)]
        for b in ids:
            self.ref_cnt[b] = 1
        return ids

    def free(self, ids: list[int]) -> None:
        """Drops one reference of each block; blocks at zero go back to the queue, last first so
        that the tail of a sequence is reused before its head."""
        for b in reversed(ids):
            assert self.ref_cnt[b] > 0, f"block {b} freed with no reference"
            self.ref_cnt[b] -= 1
            if self.ref_cnt[b] == 0:
                self._free.append(b)
