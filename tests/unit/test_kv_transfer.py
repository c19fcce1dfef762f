"""KV transports moving real blocks between two caches: exact bytes, validation, deadlines."""
import asyncio
import os
import shutil
import socket
import ssl
import struct
import subprocess
import threading
import time
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from common.kv_cache import PagedKVCache
from common.kv_layout import KVLayout
from common.kv_transfer.base import KVReceiver, KVTransferError, TransferConfig
from common.kv_transfer.frames import (
    FrameHeader,
    MalformedFrame,
    authentic,
    decode_ack,
    decode_header,
    encode_ack,
    encode_header,
    intact,
    payload_digest,
)
from common.kv_transfer.registry import create_listener, create_sender
from common.kv_transfer.shm import ShmListener, ShmSender
from common.kv_transfer.tcp import KEEPALIVE_IDLE_S, TcpSender
from common.tls import TLSFiles, make_certs
from protos import kv_transfer_pb2

LAYOUT = KVLayout(num_layers=3, num_kv_heads=2, head_dim=8, block_size=4, dtype="float32")


@pytest.fixture
def loop():
    loop = asyncio.new_event_loop()
    t = threading.Thread(target=loop.run_forever, daemon=True)
    t.start()
    yield loop
    loop.call_soon_threadsafe(loop.stop)
    t.join(5)


def run(loop, coro):
    return asyncio.run_coroutine_threadsafe(coro, loop).result(30)


def caches(name):
    src = PagedKVCache(LAYOUT, 10)
    src.tensor.copy_(torch.randn(src.tensor.shape))
    dst = PagedKVCache(LAYOUT, 8, shm_name=f"pdserve-kv-test-{name}-{id(src)}")
    return src, dst


SAME = object()  # the sender's TLS files: the listener's


@pytest.fixture(scope="module")
def certs(tmp_path_factory) -> Path:
    """A deployment's CA and role certificates (common/tls.py)."""
    return Path(make_certs(tmp_path_factory.mktemp("certs"))[0]).parent


@pytest.fixture(scope="module")
def foreign_certs(tmp_path_factory) -> Path:
    """Another deployment's: the same roles, another CA."""
    return Path(make_certs(tmp_path_factory.mktemp("foreign"))[0]).parent


@pytest.fixture
def network(loop):
    """make(transport, ...) -> src cache, dst cache, receiver, listener, sender over it."""
    made = []

    def make(transport, secret=b"", sender_secret=None, timeout=5.0, tls=None,
             sender_tls=SAME):
        src, dst = caches(transport)
        receiver = KVReceiver()
        listener = create_listener(transport, dst, receiver,
                                   TransferConfig(timeout_s=timeout, secret=secret, tls=tls))
        run(loop, listener.start())
        sender = create_sender(transport, LAYOUT, TransferConfig(
            timeout_s=timeout, secret=secret if sender_secret is None else sender_secret,
            tls=tls if sender_tls is SAME else sender_tls))
        made.append((listener, sender, dst))
        return src, dst, receiver, listener, sender
    yield make
    for listener, sender, dst in made:
        sender.close()
        run(loop, listener.close())
        dst.close()


@pytest.fixture
def tcp(network):
    return lambda **kw: network("tcp", **kw)


@pytest.fixture
def nccl(network):
    return lambda **kw: network("nccl", **kw)


def test_tcp_moves_exact_blocks_and_nothing_else(tcp):
    src, dst, receiver, listener, sender = tcp()
    before = dst.tensor.clone()
    receiver.expect("t1", "r1", [5, 2, 7], transport="tcp")
    moved = sender.send("t1", src, [1, 3, 9], listener.endpoint(), [5, 2, 7])
    assert moved == 3 * LAYOUT.block_bytes
    for s, d in zip([1, 3, 9], [5, 2, 7]):
        assert torch.equal(dst.tensor[:, :, d], src.tensor[:, :, s])
    untouched = [b for b in range(8) if b not in (5, 2, 7)]
    assert torch.equal(dst.tensor[:, :, untouched], before[:, :, untouched])
    assert receiver.complete("t1", [0, 5, 2, 7]) == 3
    # the connection is reused for the next transfer
    receiver.expect("t2", "r2", [0], transport="tcp")
    sender.send("t2", src, [4], listener.endpoint(), [0])
    assert torch.equal(dst.tensor[:, :, 0], src.tensor[:, :, 4])


def test_tcp_under_mutual_tls_moves_exact_blocks(tcp, certs):
    worker = TLSFiles.in_dir(certs, "worker")
    src, dst, receiver, listener, sender = tcp(tls=worker)
    before = dst.tensor.clone()
    for i, (s_ids, d_ids) in enumerate([([1, 3, 9], [5, 2, 7]), ([4], [0])]):  # one connection
        receiver.expect(f"t{i}", f"r{i}", d_ids, transport="tcp")
        assert sender.send(f"t{i}", src, s_ids, listener.endpoint(), d_ids) == \
            len(s_ids) * LAYOUT.block_bytes
        for a, b in zip(s_ids, d_ids):
            assert torch.equal(dst.tensor[:, :, b], src.tensor[:, :, a])
    untouched = [b for b in range(8) if b not in (5, 2, 7, 0)]
    assert torch.equal(dst.tensor[:, :, untouched], before[:, :, untouched])
    assert len(sender._conns) == 1 and isinstance(next(iter(sender._conns.values())),
                                                  ssl.SSLSocket)


@pytest.mark.skipif(shutil.which("ss") is None, reason="needs ss (iproute2)")
@pytest.mark.parametrize("secure", [False, True], ids=["clear", "tls"])
def test_tcp_connections_carry_keepalive_both_ways(tcp, certs, secure):
    """A connection idle between transfers has no deadline: TCP keepalive probes it from both
    ends (the kernel's timers, as ss shows them), so a peer whose host vanished is found."""
    src, _, receiver, listener, sender = tcp(tls=TLSFiles.in_dir(certs, "worker") if secure
                                             else None)
    receiver.expect("t1", "r1", [5], transport="tcp")
    sender.send("t1", src, [1], listener.endpoint(), [5])
    port = listener.endpoint().rpartition(":")[2]

    def timers() -> list[str]:  # ss shows one timer: a retransmission's while bytes are unacked
        return subprocess.run(["ss", "-tnoH", "state", "established", f"( sport = :{port} or "
                               f"dport = :{port} )"], capture_output=True, text=True,
                              check=True).stdout.splitlines()
    deadline = time.monotonic() + 5
    lines = timers()
    while not all("timer:(keepalive," in line for line in lines) and time.monotonic() < deadline:
        time.sleep(0.1)
        lines = timers()
    assert len(lines) == 2 and all("timer:(keepalive," in line for line in lines), lines
    idle = next(iter(sender._conns.values())).getsockopt(socket.IPPROTO_TCP,
                                                         socket.TCP_KEEPIDLE)
    assert idle == KEEPALIVE_IDLE_S


@pytest.mark.parametrize("who", ["clear", "gateway", "foreign worker"])
def test_tcp_under_tls_refuses_a_sender_without_a_worker_certificate(tcp, certs, foreign_certs,
                                                                      who):
    """In the clear, with another role's certificate of the same CA, or with a worker
    certificate of another CA: nothing reaches the cache, and a worker is served after."""
    worker = TLSFiles.in_dir(certs, "worker")
    sender_tls = {"clear": None, "gateway": TLSFiles.in_dir(certs, "gateway"),
                  "foreign worker": TLSFiles.in_dir(foreign_certs, "worker")}[who]
    src, dst, receiver, listener, sender = tcp(tls=worker, sender_tls=sender_tls, timeout=2.0)
    before = dst.tensor.clone()
    receiver.expect("t1", "r1", [1], transport="tcp")
    with pytest.raises(KVTransferError):
        sender.send("t1", src, [2], listener.endpoint(), [1])
    assert torch.equal(dst.tensor, before)
    good = TcpSender(LAYOUT, TransferConfig(timeout_s=2.0, tls=worker))
    try:
        assert good.send("t1", src, [2], listener.endpoint(), [1]) == LAYOUT.block_bytes
    finally:
        good.close()
    assert torch.equal(dst.tensor[:, :, 1], src.tensor[:, :, 2])


def test_tcp_sender_under_tls_refuses_a_receiver_without_a_worker_certificate(tcp, certs):
    src, dst, receiver, listener, sender = tcp(tls=TLSFiles.in_dir(certs, "gateway"),
                                               sender_tls=TLSFiles.in_dir(certs, "worker"))
    receiver.expect("t1", "r1", [1], transport="tcp")
    with pytest.raises(KVTransferError, match="presents a 'gateway' certificate"):
        sender.send("t1", src, [2], listener.endpoint(), [1])


def test_tcp_completion_needs_the_data(tcp):
    src, dst, receiver, listener, sender = tcp()
    receiver.expect("t1", "r1", [1], transport="tcp")
    with pytest.raises(KVTransferError, match="never arrived"):
        receiver.complete("t1", [1])


def test_tcp_refuses_unexpected_transfers_and_foreign_blocks(tcp):
    src, dst, receiver, listener, sender = tcp(timeout=0.5)
    before = dst.tensor.clone()
    with pytest.raises(KVTransferError):
        sender.send("nobody-expects-me", src, [1], listener.endpoint(), [1])
    receiver.expect("t1", "r1", [2, 3], transport="tcp")
    with pytest.raises(KVTransferError, match="outside its reservation"):
        sender.send("t1", src, [1, 2], listener.endpoint(), [3, 4])
    assert torch.equal(dst.tensor, before)


def test_tcp_refuses_a_wrong_secret(tcp):
    src, dst, receiver, listener, sender = tcp(secret=b"right", sender_secret=b"wrong")
    before = dst.tensor.clone()
    receiver.expect("t1", "r1", [1], transport="tcp")
    with pytest.raises(KVTransferError, match="authentication"):
        sender.send("t1", src, [1], listener.endpoint(), [1])
    assert torch.equal(dst.tensor, before)


def test_tcp_refuses_a_header_whose_shape_lies(tcp):
    src, dst, receiver, listener, sender = tcp()
    receiver.expect("t1", "r1", [1], transport="tcp")
    header = kv_transfer_pb2.KVFrameHeader(
        transfer_id="t1", dst_block_ids=[1], layer_start=0, layer_end=3, dtype="float32",
        shape=[3, 2, 1, 4, 2, 16], payload_bytes=3 * 2 * 4 * 2 * 16 * 4, last=True)
    raw = header.SerializeToString()
    host, port = listener.endpoint()[len("tcp://"):].rsplit(":", 1)
    with socket.create_connection((host, int(port)), timeout=5) as s:
        s.sendall(struct.pack("!I", len(raw)) + raw)
        n = struct.unpack("!I", s.recv(4))[0]
        ack = kv_transfer_pb2.KVTransferAck.FromString(s.recv(n))
    assert "does not match" in ack.error


def test_tcp_sender_gives_up_at_its_deadline():
    """A peer that accepts and then says nothing: the sender fails within its deadline."""
    src, dst = caches("stall")
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(1)
    sender = TcpSender(LAYOUT, TransferConfig(timeout_s=0.5))
    try:
        with pytest.raises(KVTransferError, match="timed out|deadline"):
            sender.send("t1", src, [1], f"tcp://127.0.0.1:{server.getsockname()[1]}", [1])
    finally:
        sender.close()
        server.close()
        dst.close()


def test_tcp_sender_reports_a_refused_connection():
    src, dst = caches("refused")
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()  # nothing listens there now
    sender = TcpSender(LAYOUT, TransferConfig(timeout_s=2))
    with pytest.raises(KVTransferError):
        sender.send("t1", src, [1], f"tcp://127.0.0.1:{port}", [1])
    dst.close()


def test_shm_moves_exact_blocks():
    src, dst = caches("shm")
    try:
        sender = ShmSender(LAYOUT)
        sender.send("t1", src, [0, 9], ShmListener(dst).endpoint(), [6, 1])
        assert torch.equal(dst.tensor[:, :, [6, 1]], src.tensor[:, :, [0, 9]])
        with pytest.raises(KVTransferError, match="out of range"):
            sender.send("t2", src, [0], ShmListener(dst).endpoint(), [8])
    finally:
        dst.close()


def _kernel_populates() -> bool:
    """MADV_POPULATE_WRITE: Linux 5.14 and later (before, the pages stay lazy)."""
    major, minor = (int(x) for x in os.uname().release.split(".")[:2])
    return (major, minor) >= (5, 14)


@pytest.mark.skipif(not _kernel_populates(), reason="needs Linux 5.14+ (MADV_POPULATE_WRITE)")
def test_a_shared_cache_is_backed_whole_before_it_serves():
    """Every page of a worker's /dev/shm cache is allocated when the cache is made (a page
    allocated at its first write made a fresh cache's writes 13x slower), and zero."""
    cache = PagedKVCache(LAYOUT, 64, shm_name=f"pdserve-kv-test-backed-{os.getpid()}")
    try:
        nbytes = cache.tensor.numel() * cache.tensor.element_size()
        assert os.stat(cache.shm_path).st_blocks * 512 >= nbytes
        assert not cache.tensor.any()
    finally:
        cache.close()


@pytest.mark.skipif(not _kernel_populates(), reason="needs Linux 5.14+ (MADV_POPULATE_WRITE)")
def test_a_cache_backed_in_slices_by_threads_is_backed_whole(tmp_path):
    """Slices of whole 2 MiB units, one per thread, the last one holding the odd remainder:
    10 MiB + 12 KiB in three slices (4, 4 and 2 MiB + 12 KiB), every page backed."""
    from common.kv_cache import map_shared, populate
    from common.shm_segments import create_segment
    nbytes = (10 << 20) + (12 << 10)
    path = Path("/dev/shm") / f"pdserve-kv-test-slices-{os.getpid()}"
    fd = create_segment(path, nbytes)
    try:
        tensor = map_shared(path, (nbytes,), torch.uint8, create=True)
        assert os.stat(path).st_blocks == 0
        populate(tensor, path, threads=3, min_slice=2 << 20)
        assert os.stat(path).st_blocks * 512 >= nbytes
        assert not tensor.any()
    finally:
        os.close(fd)
        path.unlink()


@pytest.mark.skipif(not _kernel_populates() or os.geteuid() != 0 or not shutil.which("unshare"),
                    reason="needs Linux 5.14+, root and unshare (a mount namespace of its own)")
def test_a_cache_larger_than_dev_shm_fails_at_start_and_leaves_nothing():
    """In a mount namespace whose /dev/shm holds 8 MiB, a 16 MiB cache: a clear OSError when
    the cache is made (not a SIGBUS at some later write), and no segment left behind."""
    import shlex
    import sys
    code = ("import os\n"
            "from common.kv_cache import PagedKVCache\n"
            "from common.kv_layout import KVLayout\n"
            "layout = KVLayout(num_layers=8, num_kv_heads=4, head_dim=64, block_size=16,"
            " dtype='float32')\n"
            "try:\n"
            "    PagedKVCache(layout, 64, shm_name='pdserve-kv-test-too-big')\n"
            "except OSError as e:\n"
            "    print('refused:', e)\n"
            "print('left:', os.listdir('/dev/shm'))\n")
    inner = (f"mount -t tmpfs -o size=8m tmpfs /dev/shm && "
             f"{shlex.quote(sys.executable)} -c {shlex.quote(code)}")
    out = subprocess.run(["unshare", "-m", "bash", "-c", inner], capture_output=True, text=True,
                         timeout=120, cwd=Path(__file__).resolve().parents[2])
    if out.returncode != 0 and "left:" not in out.stdout:  # root without CAP_SYS_ADMIN
        pytest.skip(f"no mount namespace here: {out.stderr.strip()[-200:]}")
    assert "refused:" in out.stdout and "cannot back the KV cache's 16777216 bytes" in out.stdout, (
        out.stdout + out.stderr)
    assert "is /dev/shm large enough?" in out.stdout
    assert "left: []" in out.stdout


def test_segments_of_dead_workers_are_swept(tmp_path):
    """A segment's owner holds a lock on it for life; a crashed owner's segment is removed."""
    import subprocess
    import sys

    from common.shm_segments import create_segment, sweep_stale_segments
    live_fd = create_segment(tmp_path / "pdserve-kv-live", 4096)
    code = ("import os, sys; sys.path.insert(0, %r); from pathlib import Path;"
            "from common.shm_segments import create_segment;"
            "create_segment(Path(%r), 4096); os._exit(9)")  # dies without cleaning up
    subprocess.run([sys.executable, "-c", code % (str(Path(__file__).parents[2]),
                                                  str(tmp_path / "pdserve-kv-dead"))], check=False)
    assert (tmp_path / "pdserve-kv-dead").exists()
    assert sweep_stale_segments(tmp_path) == ["pdserve-kv-dead"]
    assert (tmp_path / "pdserve-kv-live").exists()
    os.close(live_fd)


def test_nccl_transport_on_gloo_moves_exact_blocks_layer_by_layer(nccl):
    src, dst, receiver, listener, sender = nccl()
    before = dst.tensor.clone()
    receiver.expect("t1", "r1", [5, 2, 7], transport="nccl")
    for layer in range(LAYOUT.num_layers):
        sender.send_layers("t1", src, [1, 3, 9], listener.endpoint(), [5, 2, 7], layer, layer + 1,
                           last=layer == LAYOUT.num_layers - 1)
    assert torch.equal(dst.tensor[:, :, [5, 2, 7]], src.tensor[:, :, [1, 3, 9]])
    untouched = [b for b in range(8) if b not in (5, 2, 7)]
    assert torch.equal(dst.tensor[:, :, untouched], before[:, :, untouched])
    assert receiver.complete("t1", [5, 2, 7]) == 3
    receiver.expect("t2", "r2", [0], transport="nccl")  # the pair is reused
    sender.send("t2", src, [4], listener.endpoint(), [0])
    assert torch.equal(dst.tensor[:, :, 0], src.tensor[:, :, 4])


def test_nccl_transport_refuses_what_was_not_reserved(nccl):
    src, dst, receiver, listener, sender = nccl(timeout=1.0)
    before = dst.tensor.clone()
    with pytest.raises(KVTransferError, match="not expected"):
        sender.send("nobody", src, [1], listener.endpoint(), [1])
    receiver.expect("t1", "r1", [2, 3], transport="nccl")
    with pytest.raises(KVTransferError, match="reservation"):
        sender.send("t1", src, [1, 2], listener.endpoint(), [3, 4])
    assert torch.equal(dst.tensor, before)


def test_frame_headers_round_trip_and_a_tampered_one_is_not_authentic():
    h = FrameHeader("t", (1, 5), 0, 2, "bfloat16", (2, 2, 2, 16, 4, 64), 65536, last=True)
    back = decode_header(encode_header(h, b"key"))
    assert replace(back, auth_tag=b"") == h and authentic(b"key", back)
    assert not authentic(b"other", back)
    assert not authentic(b"key", replace(back, dst_block_ids=(1, 6)))
    assert decode_header(encode_header(h, b"")) == h  # no secret: no tag
    with pytest.raises(MalformedFrame):
        decode_header(b"\xff" * 10)
    assert decode_ack(encode_ack("t", "refused")) == ("t", "refused")


def test_tcp_drops_a_connection_whose_header_is_garbage_and_serves_the_next(tcp):
    src, dst, receiver, listener, sender = tcp()
    raw = b"\xff" * 10
    host, port = listener.endpoint()[len("tcp://"):].rsplit(":", 1)
    with socket.create_connection((host, int(port)), timeout=5) as s:
        s.sendall(struct.pack("!I", len(raw)) + raw)
        assert s.recv(4) == b""  # closed, nothing read into the cache
    receiver.expect("t2", "r2", [1], transport="tcp")
    sender.send("t2", src, [1], listener.endpoint(), [1])
    assert torch.equal(dst.tensor[:, :, 1], src.tensor[:, :, 1])


def _raw_frame(listener, header: FrameHeader, payload: bytes, secret: bytes) -> str:
    """Sends one frame by hand (header, then payload) and returns the receiver's answer."""
    raw = encode_header(header, secret)
    host, port = listener.endpoint()[len("tcp://"):].rsplit(":", 1)
    with socket.create_connection((host, int(port)), timeout=5) as s:
        s.sendall(struct.pack("!I", len(raw)) + raw + payload)
        n = struct.unpack("!I", s.recv(4))[0]
        return kv_transfer_pb2.KVTransferAck.FromString(s.recv(n)).error


@pytest.mark.parametrize("secret", [b"", b"key"])
def test_tcp_refuses_an_altered_payload_before_it_reaches_the_cache(tcp, secret):
    """One bit flipped in flight: refused, counted, nothing written; with a secret, a payload
    altered together with a digest recomputed without the secret is refused too."""
    src, dst, receiver, listener, sender = tcp(secret=secret)
    before = dst.tensor.clone()
    receiver.expect("t1", "r1", [3], transport="tcp")
    payload = bytearray(src.tensor[:, :, 1].contiguous().view(torch.uint8).numpy().tobytes())
    shape = (3, 2, 1, 4, 2, 8)
    good = FrameHeader("t1", (3,), 0, 3, "float32", shape, len(payload), last=True,
                       payload_digest=payload_digest(secret, bytes(payload)))
    payload[len(payload) // 2] ^= 0x01
    assert "digest mismatch" in _raw_frame(listener, good, bytes(payload), secret)
    assert torch.equal(dst.tensor, before) and receiver.frames_rejected == 1
    rejected = 1
    if secret:  # without one the digest is a checksum: it catches damage, not forgery
        forged = replace(good, payload_digest=payload_digest(b"", bytes(payload)))
        assert "digest mismatch" in _raw_frame(listener, forged, bytes(payload), secret)
        assert torch.equal(dst.tensor, before) and receiver.frames_rejected == 2
        rejected = 2
    # the receiver goes on serving: the genuine frame lands
    sender.send("t1", src, [1], listener.endpoint(), [3])
    assert torch.equal(dst.tensor[:, :, 3], src.tensor[:, :, 1])
    assert receiver.complete("t1", [3]) == 1 and receiver.frames_rejected == rejected


def test_nccl_refuses_a_payload_whose_digest_does_not_match(nccl, monkeypatch):
    """A frame altered on the way (its sender's digest no longer matches): the blocks keep what
    they held, the transfer is refused at its end, the frame counted."""
    import common.kv_transfer.nccl as nccl_transport
    src, dst, receiver, listener, sender = nccl()
    before = dst.tensor.clone()
    receiver.expect("t1", "r1", [2, 6], transport="nccl")
    monkeypatch.setattr(nccl_transport, "payload_digest", lambda secret, data: b"\0" * 16)
    sender.send_layers("t1", src, [1, 4], listener.endpoint(), [2, 6], 0, 1, last=False)
    monkeypatch.undo()
    with pytest.raises(KVTransferError, match="digest mismatch"):
        sender.send_layers("t1", src, [1, 4], listener.endpoint(), [2, 6], 1, 3, last=True)
    assert torch.equal(dst.tensor[0], before[0])  # the altered layer never landed
    assert receiver.frames_rejected == 1
    with pytest.raises(KVTransferError, match="never arrived"):
        receiver.complete("t1", [2, 6])


def test_payload_digests_are_keyed_with_a_secret():
    data = os.urandom(4096)
    h = FrameHeader("t", (1,), 0, 1, "float32", (1,), len(data), True,
                    payload_digest=payload_digest(b"", data))
    assert intact(b"", h, data) and len(h.payload_digest) == 16
    flipped = bytes([data[0] ^ 0x80]) + data[1:]
    assert not intact(b"", h, flipped)
    keyed = replace(h, payload_digest=payload_digest(b"k", data))
    assert intact(b"k", keyed, data) and not intact(b"other", keyed, data)
    assert not intact(b"k", h, data)  # an unkeyed digest does not pass where a secret is set
    # the header's tag covers the digest: swapping in another payload's digest is caught
    signed = decode_header(encode_header(keyed, b"k"))
    assert authentic(b"k", signed)
    assert not authentic(b"k", replace(signed, payload_digest=payload_digest(b"k", flipped)))


def test_fuzzed_frames_never_crash_the_receiver_nor_write_outside_the_reservation(tcp):
    """Random length prefixes, headers (ids, blocks, layers, dtypes, shapes, sizes, tags,
    digests) and payloads, some of them consistent enough to reach the payload: the listener
    answers or drops each connection, writes nothing outside blocks 2 and 5 (the one
    reservation), and serves a genuine transfer after them all."""
    from hypothesis import HealthCheck, given, settings
    from hypothesis import strategies as st

    src, dst, receiver, listener, sender = tcp(timeout=0.3)
    receiver.expect("t", "r", [2, 5], transport="tcp")
    outside = [b for b in range(8) if b not in (2, 5)]
    before = dst.tensor.clone()
    host, port = listener.endpoint()[len("tcp://"):].rsplit(":", 1)
    shape = (3, 2, 2, 4, 2, 8)
    nbytes = 4 * 3 * 2 * 2 * 4 * 2 * 8
    ints = st.integers(-2, 12) | st.integers(-(2 ** 31), 2 ** 31 - 1)
    headers = st.builds(
        FrameHeader,
        transfer_id=st.sampled_from(["t", "u"]) | st.text(max_size=8),
        dst_block_ids=st.sampled_from([(2, 5), (5, 2), (2, 6), (2,)]) | st.lists(ints, max_size=4)
        .map(tuple),
        layer_start=st.sampled_from([0, 1]) | ints, layer_end=st.sampled_from([3, 1]) | ints,
        dtype=st.sampled_from(["float32", "bfloat16"]) | st.text(max_size=6),
        shape=st.just(shape) | st.lists(ints, max_size=7).map(tuple),
        payload_bytes=st.just(nbytes) | st.integers(0, 1 << 40),
        last=st.booleans(), auth_tag=st.binary(max_size=4), payload_digest=st.binary(max_size=16))

    @settings(max_examples=120, deadline=None, suppress_health_check=list(HealthCheck))
    @given(header=headers, payload=st.binary(max_size=nbytes), honest_digest=st.booleans(),
           prefix=st.none() | st.integers(0, 2 ** 32 - 1))
    def send_one(header, payload, honest_digest, prefix):
        if honest_digest:
            header = replace(header, payload_digest=payload_digest(b"", payload))
        raw = encode_header(header, b"")
        length = len(raw) if prefix is None else prefix
        with socket.create_connection((host, int(port)), timeout=5) as s:
            try:
                s.sendall(struct.pack("!I", length) + raw + payload)
                s.shutdown(socket.SHUT_WR)
                while s.recv(4096):  # an answer, then the close (or the close alone)
                    pass
            except OSError:
                pass  # dropped mid-send: also an answer
        assert torch.equal(dst.tensor[:, :, outside], before[:, :, outside])

    send_one()
    receiver.expect("g", "r", [1], transport="tcp")
    sender.send("g", src, [3], listener.endpoint(), [1])
    assert torch.equal(dst.tensor[:, :, 1], src.tensor[:, :, 3])
    assert torch.equal(dst.tensor[:, :, [0, 3, 4, 6, 7]], before[:, :, [0, 3, 4, 6, 7]])
