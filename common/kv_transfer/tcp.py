"""Any-host transport: asyncio TCP on the receiver, a blocking socket with a deadline on the sender.

A transfer is one or more frames on a connection, then one ack:

    [u32 header length][KVFrameHeader][payload: layers [l0, l1) of the blocks, raw bytes] ...
    <- [u32 ack length][KVTransferAck]      after the frame marked `last`

The receiver checks every header before it reads the payload: the transfer id must be expected,
the blocks reserved for it, dtype, shape and byte count must match its cache layout, and with a
shared secret the header's HMAC must verify. A bad header ends the connection (its payload is
never read, let alone deserialized: the bytes go straight into tensor memory). A payload whose
digest does not match its header's (frames.py) is refused before it is copied into the cache;
either refusal is counted (KVReceiver.frames_rejected) and fails the transfer, whose request is
then recomputed.
"""
from __future__ import annotations

import asyncio
import logging
import socket
import struct
import time

import torch

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
    decode_ack,
    decode_header,
    encode_ack,
    encode_header,
    intact,
    payload_digest,
)

log = logging.getLogger(__name__)

SCHEME = "tcp://"
LEN = struct.Struct("!I")
MAX_FRAME_BYTES = 64 << 20
EXPECT_POLL_S = 0.005


def parse_endpoint(endpoint: str) -> tuple[str, int]:
    if not endpoint.startswith(SCHEME):
        raise KVTransferError(f"not a tcp endpoint: {endpoint}")
    host, _, port = endpoint[len(SCHEME):].rpartition(":")
    if not host or not port.isdigit():
        raise KVTransferError(f"malformed tcp endpoint {endpoint}")
    return host.strip("[]"), int(port)


class TcpSender(KVSender):
    def __init__(self, layout: KVLayout, cfg: TransferConfig):
        self.layout = layout
        self.cfg = cfg
        self._conns: dict[str, socket.socket] = {}
        self._buf: torch.Tensor | None = None
        self._deadlines: dict[str, float] = {}

    def send_layers(self, transfer_id, cache, src_block_ids, dst_endpoint, dst_block_ids,
                    layer_start, layer_end, last):
        if len(src_block_ids) != len(dst_block_ids):
            raise KVTransferError(f"transfer {transfer_id}: {len(src_block_ids)} source blocks, "
                                  f"{len(dst_block_ids)} destination blocks")
        # one deadline for the whole transfer, however many calls its layers take
        deadline = self._deadlines.setdefault(transfer_id, time.monotonic() + self.cfg.timeout_s)
        try:
            sock = self._connect(dst_endpoint, deadline)
            moved = self._send_frames(sock, transfer_id, cache, src_block_ids, dst_block_ids,
                                      deadline, layer_start, layer_end, last)
            if not last:
                return moved
            del self._deadlines[transfer_id]
            acked, error = decode_ack(_recv_msg(sock, deadline))
        except (OSError, ValueError, KVTransferError) as e:
            self._deadlines.pop(transfer_id, None)
            self._drop(dst_endpoint)
            raise KVTransferError(f"transfer {transfer_id} to {dst_endpoint}: {e}") from e
        if acked != transfer_id or error:
            self._drop(dst_endpoint)
            raise KVTransferError(f"transfer {transfer_id} refused: {error or 'wrong ack'}")
        return moved

    def _send_frames(self, sock, transfer_id, cache, src_block_ids, dst_block_ids, deadline,
                     layer_start, layer_end, last) -> int:
        per_layer = self.layout.block_bytes // self.layout.num_layers * len(src_block_ids)
        step = max(1, MAX_FRAME_BYTES // max(1, per_layer))
        moved = 0
        for l0 in range(layer_start, layer_end, step):
            l1 = min(layer_end, l0 + step)
            layers = cache.tensor[l0:l1]
            payload = self._staging(layers.shape[:2] + (len(src_block_ids),) + layers.shape[3:])
            copy_blocks(payload, range(len(src_block_ids)), layers, src_block_ids)
            data = payload.view(torch.uint8).numpy().data  # raw bytes, no copy
            raw = encode_header(FrameHeader(
                transfer_id=transfer_id, dst_block_ids=tuple(dst_block_ids), layer_start=l0,
                layer_end=l1, dtype=self.layout.dtype, shape=tuple(payload.shape),
                payload_bytes=data.nbytes, last=last and l1 == layer_end,
                payload_digest=payload_digest(self.cfg.secret, data)), self.cfg.secret)
            _settimeout(sock, deadline)
            sock.sendall(LEN.pack(len(raw)) + raw)
            _settimeout(sock, deadline)
            sock.sendall(data)
            moved += data.nbytes
        return moved

    def _staging(self, shape) -> torch.Tensor:
        """A reused buffer for a frame's payload (fresh memory per frame costs page faults)."""
        numel = torch.Size(shape).numel()
        if self._buf is None or self._buf.numel() < numel:
            self._buf = torch.empty(numel, dtype=self.layout.torch_dtype)
        return self._buf[:numel].view(shape)

    def _connect(self, endpoint: str, deadline: float) -> socket.socket:
        sock = self._conns.get(endpoint)
        if sock is None:
            host, port = parse_endpoint(endpoint)
            sock = socket.create_connection((host, port), timeout=_remaining(deadline))
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            self._conns[endpoint] = sock
        return sock

    def _drop(self, endpoint: str) -> None:
        sock = self._conns.pop(endpoint, None)
        if sock is not None:
            sock.close()

    def close(self):
        for endpoint in list(self._conns):
            self._drop(endpoint)


def _remaining(deadline: float) -> float:
    left = deadline - time.monotonic()
    if left <= 0:
        raise KVTransferError("deadline exceeded")
    return left


def _settimeout(sock: socket.socket, deadline: float) -> None:
    sock.settimeout(_remaining(deadline))


def _recv_exact(sock: socket.socket, n: int, deadline: float) -> bytes:
    buf = bytearray()
    while len(buf) < n:
        _settimeout(sock, deadline)
        chunk = sock.recv(n - len(buf))
        if not chunk:
            raise KVTransferError("connection closed by the receiver")
        buf += chunk
    return bytes(buf)


def _recv_msg(sock: socket.socket, deadline: float) -> bytes:
    (n,) = LEN.unpack(_recv_exact(sock, LEN.size, deadline))
    if n > MAX_HEADER_BYTES:
        raise KVTransferError(f"ack of {n} bytes")
    return _recv_exact(sock, n, deadline)


class FrameRejected(Exception):
    pass


class _Conn:
    """One sender's connection, read with recv_into straight into reusable memory."""

    def __init__(self, sock: socket.socket, timeout_s: float):
        self.sock = sock
        self.loop = asyncio.get_running_loop()
        self.timeout_s = timeout_s
        self.buf = bytearray()

    async def read_into(self, view: memoryview) -> None:
        got = 0
        while got < len(view):
            n = await asyncio.wait_for(self.loop.sock_recv_into(self.sock, view[got:]),
                                       self.timeout_s)
            if n == 0:
                raise ConnectionError("the sender closed the connection mid-frame")
            got += n

    async def read(self, n: int) -> memoryview:
        """n bytes in the connection's buffer (valid until the next read)."""
        if len(self.buf) < n:
            self.buf = bytearray(n)
        view = memoryview(self.buf)[:n]
        await self.read_into(view)
        return view

    async def write(self, data: bytes) -> None:
        await asyncio.wait_for(self.loop.sock_sendall(self.sock, data), self.timeout_s)


class TcpListener(KVListener):
    def __init__(self, cache: PagedKVCache, receiver: KVReceiver, cfg: TransferConfig):
        self.cache = cache
        self.receiver = receiver
        self.cfg = cfg
        self.layout = cache.layout
        self._sock: socket.socket | None = None
        self._tasks: set[asyncio.Task] = set()
        self._covered: dict[str, set[int]] = {}  # transfer -> layers written so far

    async def start(self) -> None:
        info = socket.getaddrinfo(self.cfg.tcp_host, self.cfg.tcp_port, type=socket.SOCK_STREAM)
        family, _, _, _, addr = info[0]
        sock = socket.socket(family, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(addr)
        sock.listen(64)
        sock.setblocking(False)
        self._sock = sock
        self._spawn(self._accept())

    def _spawn(self, coro) -> None:
        task = asyncio.get_running_loop().create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    def endpoint(self) -> str:
        assert self._sock is not None, "start() the listener first"
        host = self.cfg.advertise_host or self.cfg.tcp_host
        port = self.cfg.advertise_port or self._sock.getsockname()[1]
        return f"{SCHEME}{host}:{port}"

    async def close(self) -> None:
        for task in list(self._tasks):
            task.cancel()
        if self._tasks:
            await asyncio.gather(*self._tasks, return_exceptions=True)
        if self._sock is not None:
            self._sock.close()
            self._sock = None

    async def _accept(self) -> None:
        listening = self._sock
        assert listening is not None, "start() binds the socket before spawning the accept task"
        loop = asyncio.get_running_loop()
        while True:
            sock, peer = await loop.sock_accept(listening)
            sock.setblocking(False)
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            self._spawn(self._serve(sock, peer))

    async def _serve(self, sock: socket.socket, peer) -> None:
        conn = _Conn(sock, self.cfg.timeout_s)
        try:
            while True:
                try:
                    raw_len = await asyncio.get_running_loop().sock_recv(sock, LEN.size)
                except ConnectionError:
                    return
                if not raw_len:
                    return  # the sender closed between transfers
                if len(raw_len) < LEN.size:
                    rest = await conn.read(LEN.size - len(raw_len))
                    raw_len += bytes(rest)
                await self._frame(conn, LEN.unpack(raw_len)[0])
        except FrameRejected as e:
            log.warning("KV frame from %s rejected: %s", peer, e)
        except (TimeoutError, ConnectionError) as e:
            log.warning("KV connection from %s broken: %r", peer, e)
        finally:
            sock.close()

    async def _frame(self, conn: _Conn, header_len: int) -> None:
        """Reads one frame into its blocks; a refused one is counted, answered where its
        transfer is known, and raised (FrameRejected)."""
        if header_len > MAX_HEADER_BYTES:
            self.receiver.reject()
            raise FrameRejected(f"header of {header_len} bytes")
        try:
            header = decode_header(bytes(await conn.read(header_len)))
        except MalformedFrame as e:
            self.receiver.reject()
            raise FrameRejected(str(e)) from e
        try:
            blocks, shape = await self._check(header)
        except FrameRejected as e:
            raise await self._refuse(conn, header.transfer_id, str(e)) from e
        payload = await conn.read(header.payload_bytes)
        if not await asyncio.to_thread(self._land, header, payload, shape):
            raise await self._refuse(conn, header.transfer_id, "payload digest mismatch")
        layers = self._covered.setdefault(header.transfer_id, set())
        layers.update(range(header.layer_start, header.layer_end))
        if header.last:
            del self._covered[header.transfer_id]
            if len(layers) != self.layout.num_layers:
                raise await self._refuse(conn, header.transfer_id, "not every layer was sent")
            self.receiver.mark_received(header.transfer_id)
            await self._ack(conn, header.transfer_id, "")

    async def _refuse(self, conn: _Conn, transfer_id: str, why: str) -> FrameRejected:
        """Counts a refused frame and tells its sender; returns what the caller raises."""
        self.receiver.reject()
        await self._ack(conn, transfer_id, why)
        return FrameRejected(f"transfer {transfer_id}: {why}")

    def _land(self, h: FrameHeader, payload: memoryview, shape: tuple) -> bool:
        """Copies a frame's payload into its blocks if it is intact; whether it was."""
        if not intact(self.cfg.secret, h, payload):
            return False
        tensor = torch.frombuffer(payload, dtype=self.layout.torch_dtype).view(shape)
        copy_blocks(self.cache.tensor[h.layer_start:h.layer_end], list(h.dst_block_ids), tensor,
                    range(len(h.dst_block_ids)))
        return True

    async def _check(self, h: FrameHeader) -> tuple[tuple[int, ...], tuple]:
        if not authentic(self.cfg.secret, h):
            raise FrameRejected("bad authentication tag")
        blocks = await self._wait_expected(h.transfer_id)
        refusal, shape = check_frame(h, self.layout, blocks)
        if refusal:
            raise FrameRejected(refusal)
        return blocks, shape

    async def _wait_expected(self, transfer_id: str) -> tuple[int, ...]:
        """The scheduler orders a send only after the receiver's step registered it; a frame for
        an id never expected waits out the deadline and is refused."""
        deadline = time.monotonic() + self.cfg.timeout_s / 2  # answer before the sender gives up
        while (blocks := self.receiver.expected_blocks(transfer_id)) is None:
            if time.monotonic() > deadline:
                raise FrameRejected(f"transfer {transfer_id} is not expected")
            await asyncio.sleep(EXPECT_POLL_S)
        return blocks

    async def _ack(self, conn: _Conn, transfer_id: str, error: str) -> None:
        raw = encode_ack(transfer_id, error)
        await conn.write(LEN.pack(len(raw)) + raw)
