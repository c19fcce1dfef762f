"""Any-host transport over torch.distributed point-to-point: NCCL for caches on a GPU, gloo for
caches in host memory (the same code; CI runs it on gloo).

The receiver hosts a TCPStore at its endpoint. A sender joins once per receiver (`join/<n>`), and
the two build a two-rank process group on the store's prefix `pair/<n>/`. Per frame the sender
puts a KVFrameHeader in the store, the receiver checks it exactly as the tcp transport does and
answers `go` (or a refusal), then the payload moves with send/recv; after the frame marked `last`
the receiver answers `ack`. Only raw tensor bytes ever cross the process group. A payload whose
digest does not match its header's (frames.py) is not copied into the cache, and the transfer's
`ack` refuses it.
"""
from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

from common.kv_cache import PagedKVCache, copy_blocks
from common.kv_layout import KVLayout
from common.kv_transfer.base import (
    KVListener,
    KVReceiver,
    KVSender,
    KVTransferError,
    TransferConfig,
)
from common.kv_transfer.frames import (
    MAX_HEADER_BYTES,
    FrameHeader,
    MalformedFrame,
    authentic,
    check_frame,
    decode_header,
    encode_header,
    intact,
    payload_digest,
)

log = logging.getLogger(__name__)

SCHEME = "nccl://"
POLL_S = 0.002  # an idle receiver checks its store for the next header this often


def _group(store: dist.Store, prefix: str, rank: int, host: str, device: torch.device,
           timeout_s: float):
    """A two-rank group: NCCL for CUDA tensors, gloo bound to `host` otherwise."""
    store = dist.PrefixStore(prefix, store)
    timeout = timedelta(seconds=timeout_s)
    if device.type == "cuda":
        # the stub lists only the options constructor; torch also binds one taking `timeout`
        return dist.ProcessGroupNCCL(store, rank, 2, timeout=timeout)  # type: ignore[call-arg]
    # the stub calls this class `Options`; at runtime that name is Backend.Options, which has
    # no `_devices`: gloo's own options are the private `_Options`
    opts = dist.ProcessGroupGloo._Options()  # type: ignore[attr-defined]
    opts._timeout = timeout
    opts._devices = [dist.ProcessGroupGloo.create_device(hostname=host)]
    return dist.ProcessGroupGloo(store, rank, 2, opts)


def _poll(store: dist.Store, key: str, until) -> bool:
    """Whether key appeared before until() said stop (check + sleep, so that a stop is noticed:
    the store's own timed wait logs a warning on every timeout)."""
    while not store.check([key]):
        if until():
            return False
        time.sleep(POLL_S)
    return True


def _wait_key(store: dist.Store, key: str, deadline: float) -> bytes:
    """Blocks until the receiver answers (no polling: the answer is due within a frame)."""
    left = deadline - time.monotonic()
    try:
        if left <= 0:
            raise KVTransferError("deadline exceeded")
        store.wait([key], timedelta(seconds=left))
    except (RuntimeError, dist.DistStoreError) as e:
        raise KVTransferError(f"no {key} before the deadline") from e
    value = store.get(key)
    store.delete_key(key)
    return value


@dataclass
class _Pair:
    store: dist.Store
    group: object
    prefix: str  # "pair/<n>/"
    seq: int = 0  # frames sent on this pair


class NcclSender(KVSender):
    def __init__(self, layout: KVLayout, cfg: TransferConfig):
        self.layout = layout
        self.cfg = cfg
        self._peers: dict[str, _Pair] = {}
        self._deadlines: dict[str, float] = {}
        self._buf: torch.Tensor | None = None

    def _peer(self, endpoint: str, device: torch.device):
        peer = self._peers.get(endpoint)
        if peer is None:
            host, port = _parse(endpoint)
            store = dist.TCPStore(host, port, None, False, timedelta(seconds=self.cfg.timeout_s))
            n = store.add("joins", 1) - 1
            pair = f"pair/{n}/"
            store.set(f"join/{n}", "")  # only the key matters: the listener polls for it
            pg = _group(store, pair, 0, self.cfg.tcp_host, device, self.cfg.timeout_s)
            peer = self._peers[endpoint] = _Pair(store, pg, pair)
        return peer

    def send_layers(self, transfer_id, cache, src_block_ids, dst_endpoint, dst_block_ids,
                    layer_start, layer_end, last):
        deadline = self._deadlines.setdefault(transfer_id, time.monotonic() + self.cfg.timeout_s)
        try:
            peer = self._peer(dst_endpoint, cache.tensor.device)
            store, pg, pair = peer.store, peer.group, peer.prefix
            peer.seq += 1
            seq = peer.seq
            layers = cache.tensor[layer_start:layer_end]
            payload = self._staging(layers, len(src_block_ids))
            copy_blocks(payload, range(len(src_block_ids)), layers, src_block_ids)
            header = FrameHeader(
                transfer_id=transfer_id, dst_block_ids=tuple(dst_block_ids),
                layer_start=layer_start, layer_end=layer_end, dtype=self.layout.dtype,
                shape=tuple(payload.shape), payload_bytes=payload.numel() * payload.element_size(),
                last=last, payload_digest=payload_digest(self.cfg.secret, _host_bytes(payload)))
            store.set(f"{pair}hdr/{seq}", encode_header(header, self.cfg.secret))
            refusal = _wait_key(store, f"{pair}go/{seq}", deadline).decode()
            if refusal:
                raise KVTransferError(f"refused: {refusal}")
            left_s = max(0.1, deadline - time.monotonic())
            pg.send([payload], 1, seq).wait(timedelta(seconds=left_s))
            if last:
                del self._deadlines[transfer_id]
                error = _wait_key(store, f"{pair}ack/{seq}", deadline).decode()
                if error:
                    raise KVTransferError(f"refused: {error}")
            return header.payload_bytes
        except (RuntimeError, ValueError, OSError, KVTransferError) as e:
            self._deadlines.pop(transfer_id, None)
            broken = self._peers.pop(dst_endpoint, None)  # out of step: a fresh pair next time
            if broken is not None and cache.tensor.is_cuda:
                _abort(broken.group)  # else its pending NCCL work trips the watchdog later
            raise KVTransferError(f"transfer {transfer_id} to {dst_endpoint}: {e}") from e

    def _staging(self, layers: torch.Tensor, num_blocks: int) -> torch.Tensor:
        shape = layers.shape[:2] + (num_blocks,) + layers.shape[3:]
        numel = torch.Size(shape).numel()
        if self._buf is None or self._buf.numel() < numel or self._buf.device != layers.device:
            self._buf = torch.empty(numel, dtype=layers.dtype, device=layers.device)
        return self._buf[:numel].view(shape)

    def close(self):
        self._peers.clear()


def _host_bytes(t: torch.Tensor):
    """The raw bytes of a contiguous tensor, as a buffer in host memory (a device tensor is
    copied out)."""
    return t.view(torch.uint8).cpu().numpy().data


def _abort(group) -> None:
    try:
        group.abort()
    except RuntimeError as e:
        log.warning("aborting a broken KV process group failed: %s", e)


def _parse(endpoint: str) -> tuple[str, int]:
    if not endpoint.startswith(SCHEME):
        raise KVTransferError(f"not an nccl endpoint: {endpoint}")
    host, _, port = endpoint[len(SCHEME):].rpartition(":")
    if not host or not port.isdigit():
        raise KVTransferError(f"malformed nccl endpoint {endpoint}")
    return host, int(port)


class NcclListener(KVListener):
    def __init__(self, cache: PagedKVCache, receiver: KVReceiver, cfg: TransferConfig):
        self.cache = cache
        self.receiver = receiver
        self.cfg = cfg
        self.layout = cache.layout
        self._store: dist.TCPStore | None = None
        self._stop = threading.Event()
        self._threads: list[threading.Thread] = []

    async def start(self) -> None:
        self._store = dist.TCPStore(self.cfg.tcp_host, 0, None, True,
                                    timedelta(seconds=self.cfg.timeout_s), wait_for_workers=False)
        self._spawn(self._accept)

    def endpoint(self) -> str:
        assert self._store is not None, "start() the listener first"
        host = self.cfg.advertise_host or self.cfg.tcp_host
        return f"{SCHEME}{host}:{self._store.port}"

    async def close(self) -> None:
        self._stop.set()
        for t in self._threads:
            t.join(5)
        self._store = None

    def _spawn(self, target, *args) -> None:
        t = threading.Thread(target=target, args=args, daemon=True, name="kv-nccl")
        t.start()
        self._threads.append(t)

    def _accept(self) -> None:
        store = self._store
        assert store is not None, "start() opens the store before spawning the accept thread"
        n = 0
        while _poll(store, f"join/{n}", self._stop.is_set):
            store.delete_key(f"join/{n}")
            self._spawn(self._serve, f"pair/{n}/")
            n += 1

    def _serve(self, pair: str) -> None:
        store = self._store
        assert store is not None, "pairs are served only while the listener is started"
        try:
            pg = _group(store, pair, 1, self.cfg.tcp_host, self.cache.tensor.device,
                        self.cfg.timeout_s)
        except RuntimeError as e:
            log.warning("KV pair %s failed to form: %s", pair, e)
            return
        layers_seen: dict[str, set[int]] = {}
        corrupt: set[str] = set()  # transfers a frame of which arrived altered
        seq = 0
        while not self._stop.is_set():
            seq += 1
            key = f"{pair}hdr/{seq}"
            if not _poll(store, key, self._stop.is_set):
                return
            raw = store.get(key)
            store.delete_key(key)
            try:
                self._frame(store, pg, pair, seq, raw, layers_seen, corrupt)
            except (RuntimeError, KVTransferError) as e:
                log.warning("KV pair %s broken: %s", pair, e)
                return  # the sender starts a fresh pair

    def _frame(self, store, pg, pair: str, seq: int, raw: bytes, layers_seen,
               corrupt: set[str]) -> None:
        if len(raw) > MAX_HEADER_BYTES:
            self._refuse(store, f"{pair}go/{seq}", "header too large")
            return
        try:
            h = decode_header(raw)
        except MalformedFrame as e:
            self._refuse(store, f"{pair}go/{seq}", str(e))
            return
        refusal, shape = self._check(h)
        if refusal:
            self._refuse(store, f"{pair}go/{seq}", refusal)
            return
        store.set(f"{pair}go/{seq}", b"")
        buf = torch.empty(shape, dtype=self.layout.torch_dtype, device=self.cache.tensor.device)
        pg.recv([buf], 0, seq).wait(timedelta(seconds=self.cfg.timeout_s))
        if intact(self.cfg.secret, h, _host_bytes(buf)):
            copy_blocks(self.cache.tensor[h.layer_start:h.layer_end], list(h.dst_block_ids), buf,
                        range(len(h.dst_block_ids)))
        else:
            self.receiver.reject()
            corrupt.add(h.transfer_id)
            log.warning("KV frame of transfer %s refused: payload digest mismatch", h.transfer_id)
        seen = layers_seen.setdefault(h.transfer_id, set())
        seen.update(range(h.layer_start, h.layer_end))
        if h.last:
            del layers_seen[h.transfer_id]
            error = "not every layer was sent" if len(seen) != self.layout.num_layers else ""
            if h.transfer_id in corrupt:
                corrupt.discard(h.transfer_id)
                error = "payload digest mismatch"
            if not error:
                self.receiver.mark_received(h.transfer_id)
            store.set(f"{pair}ack/{seq}", error.encode())

    def _refuse(self, store, key: str, why: str) -> None:
        self.receiver.reject()
        store.set(key, why.encode())

    def _check(self, h: FrameHeader) -> tuple[str, tuple]:
        if not authentic(self.cfg.secret, h):
            return "bad authentication tag", ()
        deadline = time.monotonic() + self.cfg.timeout_s / 2  # answer before the sender gives up
        while (blocks := self.receiver.expected_blocks(h.transfer_id)) is None:
            if time.monotonic() > deadline or self._stop.is_set():
                return f"transfer {h.transfer_id} is not expected", ()
            time.sleep(POLL_S)
        return check_frame(h, self.layout, blocks)
