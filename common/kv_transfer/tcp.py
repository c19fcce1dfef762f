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

With TLS (TransferConfig.tls) every connection is mutual TLS 1.3 between holders of the
deployment's "worker" certificate (common/tls.py): the receiver reads each connection's frames
with a blocking ssl socket on a thread of its own (asyncio's socket calls take no TLS), the
sender through an ssl socket; a peer presenting any other certificate is dropped before a frame
is read.

A connection waits between transfers without a deadline (the sender keeps it for the next one);
TCP keepalive probes it after KEEPALIVE_IDLE_S of quiet, so a peer whose host vanished without a
FIN is found in under a minute and its reader (a task, or a thread under TLS) ends.
"""
from __future__ import annotations

import asyncio
import logging
import socket
import ssl
import struct
import time
from concurrent.futures import ThreadPoolExecutor

import torch

from common.kv_cache import PagedKVCache, copy_blocks
from common.kv_layout import KVLayout, KVShard, shard_of
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
from common.tls import WORKER_NAME, common_name_of, kv_client_context, kv_server_context

log = logging.getLogger(__name__)

SCHEME = "tcp://"
LEN = struct.Struct("!I")
MAX_FRAME_BYTES = 64 << 20
EXPECT_POLL_S = 0.005
KEEPALIVE_IDLE_S = 20    # quiet this long, a connection is probed...
KEEPALIVE_INTERVAL_S = 5  # ... every this long...
KEEPALIVE_PROBES = 4      # ... and dropped after this many unanswered probes


def tune(sock: socket.socket) -> None:
    """No Nagle delay; TCP keepalive on an idle connection (Linux's per-socket knobs)."""
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
    for name, value in (("TCP_KEEPIDLE", KEEPALIVE_IDLE_S), ("TCP_KEEPINTVL", KEEPALIVE_INTERVAL_S),
                        ("TCP_KEEPCNT", KEEPALIVE_PROBES)):
        if hasattr(socket, name):
            sock.setsockopt(socket.IPPROTO_TCP, getattr(socket, name), value)


def parse_endpoint(endpoint: str) -> tuple[str, int]:
    if not endpoint.startswith(SCHEME):
        raise KVTransferError(f"not a tcp endpoint: {endpoint}")
    host, _, port = endpoint[len(SCHEME):].partition("?")[0].rpartition(":")
    if not host or not port.isdigit():
        raise KVTransferError(f"malformed tcp endpoint {endpoint}")
    return host.strip("[]"), int(port)


def parse_parts(endpoint: str, whole: KVShard) -> list[tuple[str, KVShard]]:
    """A receiver's caches: (address, the layers and heads it holds) per rank of a group, comma
    separated; an address without them holds `whole`."""
    parts = []
    for part in endpoint.split(","):
        address, _, query = part.partition("?")
        parse_endpoint(address)
        try:
            parts.append((address, shard_of(query) if query else whole))
        except ValueError as e:
            raise KVTransferError(f"malformed tcp endpoint {part} ({e})") from None
    return parts


class TcpSender(KVSender):
    """Sends the layers and heads of its shard (a worker group's rank; default the whole
    cache) to every receiving cache that holds any of them, frames to each; a head replicated on
    several ranks of its group goes from the first only (shard.sends)."""

    def __init__(self, layout: KVLayout, cfg: TransferConfig, shard: KVShard | None = None,
                 model: KVShard | None = None):
        """`model`: the model's whole KV, which a receiver whose endpoint names no shard
        holds (default: this sender's cache's)."""
        self.layout = layout
        self.shard = shard or KVShard.whole(layout)
        self.model = model or KVShard.whole(layout)
        self.cfg = cfg
        self._conns: dict[str, socket.socket] = {}
        self._buf: torch.Tensor | None = None
        self._deadlines: dict[str, float] = {}
        self._tls = kv_client_context(cfg.tls) if cfg.tls is not None else None

    def send_layers(self, transfer_id, cache, src_block_ids, dst_endpoint, dst_block_ids,
                    layer_start, layer_end, last):
        if len(src_block_ids) != len(dst_block_ids):
            raise KVTransferError(f"transfer {transfer_id}: {len(src_block_ids)} source blocks, "
                                  f"{len(dst_block_ids)} destination blocks")
        # one deadline for the whole transfer, however many calls its layers take
        deadline = self._deadlines.setdefault(transfer_id, time.monotonic() + self.cfg.timeout_s)
        if last:
            del self._deadlines[transfer_id]
        mine = self.shard
        parts = parse_parts(dst_endpoint, self.model)
        if not mine.sends:
            return 0
        sending = mine.layers(layer_start, layer_end)
        moved = 0
        for address, theirs in parts:
            part, now = mine.overlap(theirs), sending.overlap(theirs)
            if part is None or now is None:
                continue
            try:
                sock = self._connect(address, deadline)
                done = now.layer_end == part.layer_end  # this rank's last layer they hold
                moved += self._send_frames(sock, transfer_id, cache, src_block_ids,
                                           dst_block_ids, deadline, now, done)
                if not done:
                    continue
                acked, error = decode_ack(_recv_msg(sock, deadline))
            except (OSError, ValueError, KVTransferError) as e:
                self._deadlines.pop(transfer_id, None)
                self._drop(address)
                raise KVTransferError(f"transfer {transfer_id} to {address}: {e}") from e
            if acked != transfer_id or error:
                self._deadlines.pop(transfer_id, None)
                self._drop(address)
                raise KVTransferError(f"transfer {transfer_id} refused: {error or 'wrong ack'}")
        return moved

    def _send_frames(self, sock, transfer_id, cache, src_block_ids, dst_block_ids, deadline,
                     now: KVShard, last: bool) -> int:
        """Frames of the model's layers and heads `now` (in this sender's shard)."""
        mine = self.shard
        heads = mine.part(cache.tensor, now)
        per_layer = heads[0, :, :len(src_block_ids)].numel() * heads.element_size()
        step = max(1, MAX_FRAME_BYTES // max(1, per_layer))
        moved = 0
        for l0 in range(now.layer_start, now.layer_end, step):
            l1 = min(now.layer_end, l0 + step)
            layers = mine.part(cache.tensor, KVShard(l0, l1, now.head_start, now.head_end))
            payload = self._staging(layers.shape[:2] + (len(src_block_ids),) + layers.shape[3:])
            copy_blocks(payload, range(len(src_block_ids)), layers, src_block_ids)
            data = payload.view(torch.uint8).numpy().data  # raw bytes, no copy
            raw = encode_header(FrameHeader(
                transfer_id=transfer_id, dst_block_ids=tuple(dst_block_ids), layer_start=l0,
                layer_end=l1, dtype=self.layout.dtype, shape=tuple(payload.shape),
                payload_bytes=data.nbytes, last=last and l1 == now.layer_end,
                payload_digest=payload_digest(self.cfg.secret, data),
                head_start=now.head_start, head_end=now.head_end,
                src=mine),  # (one that sends: its `sends` is the default)
                self.cfg.secret)
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
            tune(sock)
            if self._tls is not None:
                sock = self._handshake(sock, endpoint, deadline)
            self._conns[endpoint] = sock
        return sock

    def _handshake(self, sock: socket.socket, endpoint: str, deadline: float) -> socket.socket:
        """TLS over a fresh connection; the receiver must hold a worker certificate."""
        assert self._tls is not None
        try:
            _settimeout(sock, deadline)
            tls = self._tls.wrap_socket(sock)
        except (OSError, KVTransferError):
            sock.close()
            raise
        role = common_name_of(tls.getpeercert())
        if role != WORKER_NAME:
            tls.close()
            raise KVTransferError(f"{endpoint} presents a {role!r} certificate, not a "
                                  f"{WORKER_NAME!r} one")
        return tls

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


def _cells(s: KVShard) -> set[tuple[int, int]]:
    return {(layer, head) for layer in range(s.layer_start, s.layer_end)
            for head in range(s.head_start, s.head_end)}


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

    async def read_len(self) -> int | None:
        """The next frame's header length; None when the sender closed between transfers (an
        idle connection waits without a deadline: senders keep theirs open)."""
        try:
            raw = await self.loop.sock_recv(self.sock, LEN.size)
        except ConnectionError:
            return None
        if not raw:
            return None
        if len(raw) < LEN.size:
            raw += bytes(await self.read(LEN.size - len(raw)))
        return LEN.unpack(raw)[0]


class _TlsConn(_Conn):
    """A TLS connection: a blocking ssl socket read and written by a thread of its own (OpenSSL
    decrypts there without the GIL, straight into the frame's memory; asyncio's TLS streams
    would copy every byte twice more). The thread is the connection's for its life, so an idle
    one waiting for its next frame holds no shared worker thread."""

    def __init__(self, sock: socket.socket, context: ssl.SSLContext, timeout_s: float):
        """`sock`: accepted, not yet wrapped (handshake() does it on the connection's thread)."""
        self.sock = sock
        self.context = context
        self.loop = asyncio.get_running_loop()
        self.timeout_s = timeout_s
        self.buf = bytearray()
        self.thread = ThreadPoolExecutor(1, thread_name_prefix="kv-tls")

    def _handshake(self) -> str | None:
        self.sock.setblocking(True)
        self.sock.settimeout(self.timeout_s)
        self.sock = self.context.wrap_socket(self.sock, server_side=True)
        assert isinstance(self.sock, ssl.SSLSocket)
        return common_name_of(self.sock.getpeercert())

    async def handshake(self) -> str | None:
        """The TLS handshake within the transfer timeout; the peer certificate's role."""
        return await self._call(self._handshake)

    def _call(self, fn, *args):
        return self.loop.run_in_executor(self.thread, fn, *args)

    def _recv_into(self, view: memoryview) -> None:
        self.sock.settimeout(self.timeout_s)
        got = 0
        while got < len(view):
            n = self.sock.recv_into(view[got:])
            if n == 0:
                raise ConnectionError("the sender closed the connection mid-frame")
            got += n

    async def read_into(self, view: memoryview) -> None:
        await self._call(self._recv_into, view)

    def _sendall(self, data: bytes) -> None:
        self.sock.settimeout(self.timeout_s)
        self.sock.sendall(data)

    async def write(self, data: bytes) -> None:
        await self._call(self._sendall, data)

    def _read_len(self) -> int | None:
        self.sock.settimeout(None)  # idle between transfers: keepalive-free, like the plain one
        raw = self.sock.recv(LEN.size)
        if not raw:
            return None
        if len(raw) < LEN.size:
            rest = memoryview(bytearray(LEN.size - len(raw)))
            self._recv_into(rest)
            raw += bytes(rest)
        return LEN.unpack(raw)[0]

    async def read_len(self) -> int | None:
        try:
            return await self._call(self._read_len)
        except ConnectionError:
            return None

    def close(self) -> None:
        try:
            self.sock.shutdown(socket.SHUT_RDWR)  # wakes the thread if it waits in recv
        except OSError:
            pass
        self.sock.close()
        self.thread.shutdown(wait=False)


class TcpListener(KVListener):
    """Frames into its cache, which holds `shard` of the model's KV (a worker group's rank;
    default all of it). A transfer has landed once frames covered every layer and head of the
    shard: from one sender, or from each rank of a sending group, each of which covers its part
    before its last frame."""

    def __init__(self, cache: PagedKVCache, receiver: KVReceiver, cfg: TransferConfig,
                 shard: KVShard | None = None):
        self.cache = cache
        self.receiver = receiver
        self.cfg = cfg
        self.layout = cache.layout
        self.shard = shard or KVShard.whole(cache.layout)
        self._names_shard = shard is not None  # a group's rank: its endpoint says what it holds
        self._sock: socket.socket | None = None
        self._tls = kv_server_context(cfg.tls) if cfg.tls is not None else None
        self._tls_conns: set[_TlsConn] = set()
        self._tasks: set[asyncio.Task] = set()
        # transfer -> the (layer, head) cells of its shard written so far, in all and per sender
        self._covered: dict[str, set[tuple[int, int]]] = {}
        self._sent: dict[tuple[str, KVShard | None], set[tuple[int, int]]] = {}

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
        s = self.shard
        if not self._names_shard:
            return f"{SCHEME}{host}:{port}"
        return (f"{SCHEME}{host}:{port}?layers={s.layer_start}-{s.layer_end}"
                f"&heads={s.head_start}-{s.head_end}")

    async def close(self) -> None:
        for conn in list(self._tls_conns):
            conn.close()
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
            tune(sock)
            self._spawn(self._serve(sock, peer) if self._tls is None
                        else self._serve_tls(sock, peer))

    async def _serve(self, sock: socket.socket, peer) -> None:
        try:
            await self._frames(_Conn(sock, self.cfg.timeout_s), peer)
        finally:
            sock.close()

    async def _serve_tls(self, sock: socket.socket, peer) -> None:
        """The TLS handshake (a certificate from the CA); then frames, only from a worker's
        certificate."""
        assert self._tls is not None
        conn = _TlsConn(sock, self._tls, self.cfg.timeout_s)
        self._tls_conns.add(conn)
        try:
            try:
                role = await conn.handshake()
            except (OSError, ValueError) as e:  # ssl.SSLError, a timeout, a reset
                log.warning("KV connection from %s refused: TLS handshake failed: %r", peer, e)
                return
            if role != WORKER_NAME:
                log.warning("KV connection from %s refused: a %r certificate, not a %r one",
                            peer, role, WORKER_NAME)
                return
            await self._frames(conn, peer)
        finally:
            self._tls_conns.discard(conn)
            conn.close()

    async def _frames(self, conn: _Conn, peer) -> None:
        """Frames until the sender closes the connection or one is refused."""
        try:
            while (header_len := await conn.read_len()) is not None:
                await self._frame(conn, header_len)
        except FrameRejected as e:
            log.warning("KV frame from %s rejected: %s", peer, e)
        except (TimeoutError, ConnectionError, ssl.SSLError) as e:
            log.warning("KV connection from %s broken: %r", peer, e)

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
        tid = header.transfer_id
        self._forget_done()
        cells = _cells(KVShard(header.layer_start, header.layer_end, *header.heads(self.shard)))
        sent = self._sent.setdefault((tid, header.src), set())
        sent |= cells
        if header.last:
            del self._sent[(tid, header.src)]
            part = header.src.overlap(self.shard) if header.src else self.shard
            if part is None or not _cells(part) <= sent:
                self._covered.pop(tid, None)
                raise await self._refuse(conn, tid, "not every layer was sent")
            covered = self._covered.setdefault(tid, set())
            covered |= sent
            if covered >= _cells(self.shard):  # every rank of the sender's group is done
                del self._covered[tid]
                self.receiver.mark_received(tid)
            await self._ack(conn, tid, "")

    def _forget_done(self) -> None:
        """Drops what it counted of transfers no longer expected (landed, failed, cancelled):
        a sender that broke off before its last frame leaves its count behind."""
        for tid in [t for t in self._covered if self.receiver.expected_blocks(t) is None]:
            del self._covered[tid]
        for key in [k for k in self._sent if self.receiver.expected_blocks(k[0]) is None]:
            del self._sent[key]

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
        region = KVShard(h.layer_start, h.layer_end, *h.heads(self.shard))
        copy_blocks(self.shard.part(self.cache.tensor, region), list(h.dst_block_ids), tensor,
                    range(len(h.dst_block_ids)))
        return True

    async def _check(self, h: FrameHeader) -> tuple[tuple[int, ...], tuple]:
        if not authentic(self.cfg.secret, h):
            raise FrameRejected("bad authentication tag")
        blocks = await self._wait_expected(h.transfer_id)
        refusal, shape = check_frame(h, self.layout, blocks, self.shard)
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
