"""KV transfer between workers: the sender and listener interfaces, the receiver's bookkeeping.

A transfer moves the KV of `src_block_ids` on the sending worker into `dst_block_ids` on the
receiving worker, all layers. The scheduler reserves the destination blocks and tells the
receiver to expect the transfer id (KVRecv) before it orders the send (KVSend); the sender
reports the transfer done, and only then does the request join the receiver's batch.

Per transport a module provides a sender (runs in the worker's step thread, blocking, with a
deadline) and a listener (runs in the worker's event loop; shm needs none: the sender writes
straight into the receiver's shared-memory cache, cuda_ipc into its exported GPU cache).
The transports are built by name in common/kv_transfer/registry.py; this module knows none of them.
"""
from __future__ import annotations

import threading
from abc import ABC, abstractmethod
from dataclasses import dataclass

import torch

from common.kv_cache import PagedKVCache, copy_blocks
from common.kv_layout import KVLayout, KVShard
from common.tls import TLSFiles

# the sender writes straight into the receiver's cache: no listener sees the data arrive
DIRECT_WRITE_TRANSPORTS = ("shm", "cuda_ipc")


class KVTransferError(Exception):
    """A transfer failed; reported to the scheduler as data, never raised across the step."""


@dataclass(frozen=True)
class TransferConfig:
    timeout_s: float = 30.0       # deadline of one whole transfer
    secret: bytes = b""           # shared secret authenticating KV frames, header and payload
    tcp_host: str = "127.0.0.1"   # where the tcp listener binds
    tcp_port: int = 0             # 0: a free port
    advertise_host: str = ""      # the address peers dial; default tcp_host
    advertise_port: int = 0       # the port peers dial; default the bound one
    tls: TLSFiles | None = None   # tcp: mutual TLS between workers (common/tls.py)


class KVSender(ABC):
    """Calls for one transfer cover its layers in order; the call with `last` completes it."""

    def send(self, transfer_id: str, cache: PagedKVCache, src_block_ids: list[int],
             dst_endpoint: str, dst_block_ids: list[int]) -> int:
        """Pushes every layer of the blocks; returns the bytes moved once they are in the
        destination's cache."""
        return self.send_layers(transfer_id, cache, src_block_ids, dst_endpoint, dst_block_ids,
                                0, cache.layout.num_layers, last=True)

    @abstractmethod
    def send_layers(self, transfer_id: str, cache: PagedKVCache, src_block_ids: list[int],
                    dst_endpoint: str, dst_block_ids: list[int], layer_start: int,
                    layer_end: int, last: bool) -> int:
        """Pushes layers [layer_start, layer_end) of the blocks; returns the bytes moved."""

    def close(self) -> None:
        """Releases connections or mappings; an optional hook, a no-op for senders holding none."""
        return None


class DirectWriteSender(KVSender):
    """A sender that maps the receiver's cache (once per endpoint) and copies blocks straight
    into it: shm, cuda_ipc.

    Either side may be a worker group whose ranks each hold a shard (kv_layout.KVShard): the
    endpoint then names every rank's cache, and this sender writes the layers and heads of its
    own shard into each destination cache holding any of them. A head replicated on several
    ranks of this sender's group goes from the first of them only."""

    def __init__(self, layout: KVLayout, shard: KVShard | None = None):
        self.layout = layout  # this worker's (this rank's) cache
        self.shard = shard or KVShard.whole(layout)
        self._peers: dict[str, list[tuple[torch.Tensor, KVShard]]] = {}  # endpoint -> caches

    @abstractmethod
    def _open(self, endpoint: str) -> list[tuple[torch.Tensor, KVShard]]:
        """The receiver's whole caches `[layers, 2, blocks, ...]` and the shard of the model's
        KV each holds (one for a worker, one per rank for a group); KVTransferError if it
        cannot."""

    def _copy(self, dst: torch.Tensor, dst_ids: list[int], src: torch.Tensor,
              src_ids: list[int]) -> None:
        copy_blocks(dst, dst_ids, src, src_ids)

    def send_layers(self, transfer_id, cache, src_block_ids, dst_endpoint, dst_block_ids,
                    layer_start, layer_end, last):
        if len(src_block_ids) != len(dst_block_ids):
            raise KVTransferError(f"transfer {transfer_id}: {len(src_block_ids)} source blocks, "
                                  f"{len(dst_block_ids)} destination blocks")
        peers = self._peers.get(dst_endpoint)
        if peers is None:
            peers = self._peers[dst_endpoint] = self._open(dst_endpoint)
        if any(not 0 <= b < peer.shape[2] for peer, _ in peers for b in dst_block_ids):
            raise KVTransferError(f"transfer {transfer_id}: destination block out of range")
        if not self.shard.sends:
            return 0
        sending = self.shard.layers(layer_start, layer_end)
        moved = 0
        for peer, theirs in peers:
            both = sending.overlap(theirs)
            if both is None:
                continue
            src = self.shard.part(cache.tensor, both)
            self._copy(theirs.part(peer, both), dst_block_ids, src, src_block_ids)
            moved += src[:, :, :len(src_block_ids)].numel() * src.element_size()
        return moved

    def close(self) -> None:
        self._peers.clear()


class KVReceiver:
    """Which transfers may land in which blocks; thread-safe (the step thread adds and checks
    expectations, listeners on the event loop write data)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._expected: dict[str, tuple[str, tuple[int, ...], str]] = {}  # id -> rid, blocks, tr
        self._received: set[str] = set()
        self.frames_rejected = 0  # frames refused on arrival: bad header, tag or payload digest

    def reject(self) -> None:
        """A listener refused a frame."""
        with self._lock:
            self.frames_rejected += 1

    def expect(self, transfer_id: str, request_id: str, block_ids: list[int],
               transport: str = "shm") -> None:
        with self._lock:
            assert transfer_id not in self._expected, f"transfer {transfer_id} expected twice"
            self._expected[transfer_id] = (request_id, tuple(block_ids), transport)

    def expected_blocks(self, transfer_id: str) -> tuple[int, ...] | None:
        with self._lock:
            entry = self._expected.get(transfer_id)
            return None if entry is None or transfer_id in self._received else entry[1]

    def mark_received(self, transfer_id: str) -> None:
        with self._lock:
            if transfer_id in self._expected:
                self._received.add(transfer_id)

    def complete(self, transfer_id: str, block_ids: list[int]) -> int:
        """The scheduler says the transfer landed in block_ids; returns the number of blocks."""
        with self._lock:
            _, expected, transport = self._expected.pop(transfer_id, (None, None, None))
            received = transfer_id in self._received
            self._received.discard(transfer_id)
        if expected is None:
            raise KVTransferError(f"transfer {transfer_id} was never expected")
        if not set(expected) <= set(block_ids):
            raise KVTransferError(f"transfer {transfer_id} landed in {block_ids}, "
                                  f"expected {list(expected)}")
        if transport not in DIRECT_WRITE_TRANSPORTS and not received:
            raise KVTransferError(f"transfer {transfer_id} never arrived over {transport}")
        return len(expected)

    def cancel_request(self, request_id: str) -> None:
        with self._lock:
            for t in [t for t, e in self._expected.items() if e[0] == request_id]:
                del self._expected[t]
                self._received.discard(t)

    def reset(self) -> None:
        with self._lock:
            self._expected.clear()
            self._received.clear()


class KVListener(ABC):
    """The receiving end of one transport."""

    @abstractmethod
    def endpoint(self) -> str:
        """The address peers send to, advertised at registration."""

    async def start(self) -> None:
        """Begins accepting data; an optional hook, a no-op for direct-write transports, whose
        senders write into the cache with no listener involved."""
        return None

    async def close(self) -> None:
        """Stops accepting data; an optional hook, a no-op where `start` opened nothing."""
        return None

