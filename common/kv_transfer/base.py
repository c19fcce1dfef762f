"""KV transfer between workers: a sender side, a receiver side, and a factory.

A transfer moves the KV of `src_block_ids` on the sending worker into `dst_block_ids` on the
receiving worker, all layers. The scheduler reserved the destination blocks and told the receiver
to expect the transfer id before the sender was told to send it.
"""
from __future__ import annotations

from abc import ABC, abstractmethod

from common.worker.kv_cache import KVLayout, PagedKVCache


class KVTransferError(Exception):
    """A transfer failed; reported to the scheduler as data, never raised across the step."""


class KVSender(ABC):
    @abstractmethod
    def send(self, transfer_id: str, cache: PagedKVCache, src_block_ids: list[int],
             dst_endpoint: str, dst_block_ids: list[int]) -> None:
        """Pushes the blocks; returns when they are in the destination's cache."""

    def close(self) -> None:
        pass


class KVReceiver(ABC):
    """Tracks which transfers may land in which blocks."""

    def __init__(self) -> None:
        self._expected: dict[str, tuple[str, tuple[int, ...]]] = {}  # transfer -> (request, blocks)

    @abstractmethod
    def endpoint(self) -> str:
        """The address peers send to, advertised at registration."""

    def expect(self, transfer_id: str, request_id: str, block_ids: list[int]) -> None:
        assert transfer_id not in self._expected, f"transfer {transfer_id} expected twice"
        self._expected[transfer_id] = (request_id, tuple(block_ids))

    def complete(self, transfer_id: str, block_ids: list[int]) -> int:
        """The scheduler says the transfer landed in block_ids; returns the number of blocks."""
        _, expected = self._expected.pop(transfer_id, (None, None))
        if expected is None:
            raise KVTransferError(f"transfer {transfer_id} was never expected")
        if not set(expected) <= set(block_ids):
            raise KVTransferError(f"transfer {transfer_id} landed in {block_ids}, "
                                  f"expected {list(expected)}")
        return len(expected)

    def cancel_request(self, request_id: str) -> None:
        for t in [t for t, (rid, _) in self._expected.items() if rid == request_id]:
            del self._expected[t]

    def reset(self) -> None:
        self._expected.clear()

    def close(self) -> None:
        pass


def create_sender(transport: str, layout: KVLayout) -> KVSender:
    if transport == "shm":
        from common.kv_transfer.shm import ShmSender
        return ShmSender(layout)
    raise ValueError(f"unknown KV transport {transport!r}; known: shm")


def create_receiver(transport: str, cache: PagedKVCache) -> KVReceiver:
    if transport == "shm":
        from common.kv_transfer.shm import ShmReceiver
        return ShmReceiver(cache)
    raise ValueError(f"unknown KV transport {transport!r}; known: shm")
