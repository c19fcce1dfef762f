"""Per-request view of one worker's blocks: which blocks each request holds."""
from __future__ import annotations

from services.scheduler.block_pool import BlockPool


class KVCacheManager:
    def __init__(self, num_blocks: int, block_size: int):
        self.block_size = block_size
        self.pool = BlockPool(num_blocks)
        self._blocks: dict[str, list[int]] = {}

    @property
    def num_blocks(self) -> int:
        return self.pool.num_blocks

    @property
    def num_free_blocks(self) -> int:
        return self.pool.num_free_blocks

    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def can_fit(self, request_id: str, num_tokens: int) -> bool:
        held = len(self._blocks.get(request_id, ()))
        return self.blocks_for(num_tokens) - held <= self.pool.num_free_blocks

    def allocate_slots(self, request_id: str, num_tokens: int) -> list[int] | None:
        """Grows the request's blocks to hold num_tokens tokens in all.

        Returns the newly added block ids (possibly none), or None when the pool cannot supply
        them, in which case nothing changes.
        """
        held = self._blocks.setdefault(request_id, [])
        need = self.blocks_for(num_tokens) - len(held)
        if need <= 0:
            return []
        if need > self.pool.num_free_blocks:
            if not held:
                del self._blocks[request_id]
            return None
        new = self.pool.allocate(need)
        held.extend(new)
        return new

    def get_block_ids(self, request_id: str) -> list[int]:
        return self._blocks.get(request_id, [])

    def holds(self, request_id: str) -> bool:
        return request_id in self._blocks

    def free(self, request_id: str) -> None:
        self.pool.free(self.detach(request_id))

    def detach(self, request_id: str) -> list[int]:
        """Forgets the request's blocks without releasing them: the caller frees them through
        `pool.free` once nothing writes into them any more."""
        return self._blocks.pop(request_id, [])

    def request_ids(self) -> list[str]:
        return list(self._blocks)
