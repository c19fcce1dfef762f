"""Placement: which decode worker receives a request prefilled elsewhere."""
from __future__ import annotations

from abc import ABC, abstractmethod
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from services.scheduler.request import Request
    from services.scheduler.scheduler import WorkerState


class Placement(ABC):
    @abstractmethod
    def choose_decode(self, req: Request, candidates: list[WorkerState], num_tokens: int,
                      block_hashes: list[bytes]) -> WorkerState | None:
        """A decode worker with room for num_tokens of req, or None to keep it waiting."""


class LeastLoaded(Placement):
    """Fewest requests holding blocks, then most free blocks, then registration order."""

    def choose_decode(self, req, candidates, num_tokens, block_hashes):
        fits = [w for w in candidates if _fits(w, req, num_tokens, block_hashes)]
        if not fits:
            return None
        return min(fits, key=lambda w: (len(w.kv.request_ids()), -w.kv.num_free_blocks))


class PrefixAware(Placement):
    """Longest prefix held first, in the cache or the second tier after it (fewer blocks
    travel), then least loaded."""

    def choose_decode(self, req, candidates, num_tokens, block_hashes):
        best, best_key = None, None
        for w in candidates:
            prefix = w.kv.find_prefix(block_hashes, num_tokens - 1)
            if not w.kv.can_fit(req.request_id, num_tokens, prefix):
                continue
            held = len(prefix) + len(w.kv.find_tier(block_hashes, num_tokens - 1, len(prefix)))
            # as much held: in the cache beats in the tier (no load to run)
            key = (-held, -len(prefix), len(w.kv.request_ids()), -w.kv.num_free_blocks)
            if best_key is None or key < best_key:
                best, best_key = w, key
        return best


def _fits(w, req, num_tokens, block_hashes) -> bool:
    return w.kv.can_fit(req.request_id, num_tokens, w.kv.find_prefix(block_hashes, num_tokens - 1))


_PLACEMENTS = {"prefix-aware": PrefixAware, "least-loaded": LeastLoaded}


def create_placement(name: str) -> Placement:
    if name not in _PLACEMENTS:
        raise ValueError(f"unknown placement {name!r}; known: {', '.join(_PLACEMENTS)}")
    return _PLACEMENTS[name]()
