"""KV between worker groups of different shapes over shm and tcp: each rank of the sending group
writes (shm) or sends (tcp frames) its layers and heads straight to every cache of the receiving
group that holds any of them; a head replicated on several sending ranks goes once. Checked
against the whole model's KV."""
import itertools
import os
import socket
import struct

import pytest
import torch

from common.kv_cache import PagedKVCache
from common.kv_layout import KVLayout, KVShard, kv_head_split, layer_split
from common.kv_transfer.base import KVReceiver, KVTransferError, TransferConfig
from common.kv_transfer.frames import FrameHeader, encode_header, payload_digest
from common.kv_transfer.shm import ShmListener, ShmSender
from common.kv_transfer.tcp import TcpListener, TcpSender
from protos import kv_transfer_pb2
from tests.unit.test_kv_transfer import loop, run  # noqa: F401 (a fixture)

MODEL = KVLayout(num_layers=4, num_kv_heads=4, head_dim=8, block_size=4, dtype="float32")
BLOCKS = 12
SRC_IDS, DST_IDS = [3, 1, 5, 6], [0, 9, 2, 3]
SHAPES = [(1, 1), (2, 1), (4, 1), (8, 1), (1, 2), (2, 2), (1, 4)]  # (T, P); T = 8 replicates


def _group(t: int, p: int) -> KVLayout:
    return KVLayout(MODEL.num_layers, MODEL.num_kv_heads, MODEL.head_dim, MODEL.block_size,
                    MODEL.dtype, tensor_parallel_size=t, pipeline_parallel_size=p)


def _ranks(layout: KVLayout, name: str, whole: torch.Tensor | None):
    """Every rank's (cache in shared memory, shard), filled from `whole` (None: zeros)."""
    out = []
    for stage, rank in itertools.product(range(layout.pipeline_parallel_size),
                                         range(layout.tensor_parallel_size)):
        shard = layout.shard(rank, stage)
        cache = PagedKVCache(layout.shard_layout(shard), BLOCKS,
                             shm_name=f"pdserve-kv-test-{name}-{os.getpid()}-{stage}-{rank}")
        if whole is not None:
            cache.tensor.copy_(whole[shard.layer_start:shard.layer_end, :, :, :,
                                     shard.head_start:shard.head_end])
        out.append((cache, shard))
    return out


def _stream(sender, cache: PagedKVCache, endpoint: str) -> int:
    """One rank's send, in two calls as layer by layer; the bytes it moved."""
    half, end = cache.layout.num_layers // 2, cache.layout.num_layers
    moved = sum(sender.send_layers("t", cache, SRC_IDS, endpoint, DST_IDS, l0, l1,
                                   last=l1 == end)
                for l0, l1 in ((0, half), (half, end)) if l0 < l1)
    sender.close()
    return moved


def _assemble(ranks) -> torch.Tensor:
    whole = torch.full(MODEL.cache_shape(BLOCKS), float("nan"))
    for cache, s in ranks:
        part = whole[s.layer_start:s.layer_end, :, :, :, s.head_start:s.head_end]
        # a replicated head must hold the same values on every rank
        assert part.isnan().all() or torch.equal(part, cache.tensor)
        part.copy_(cache.tensor)
    return whole


@pytest.mark.parametrize("src_shape,dst_shape", list(itertools.product(SHAPES, SHAPES)),
                         ids=lambda s: f"tp{s[0]}pp{s[1]}")
def test_every_rank_sends_its_shard_to_the_ranks_that_hold_it(src_shape, dst_shape):
    src_layout, dst_layout = _group(*src_shape), _group(*dst_shape)
    whole = torch.randn(MODEL.cache_shape(BLOCKS))
    src = _ranks(src_layout, "src", whole)
    dst = _ranks(dst_layout, "dst", None)
    try:
        endpoint = ",".join(ShmListener(c, s).endpoint() for c, s in dst)
        moved = 0
        for cache, shard in src:
            moved += _stream(ShmSender(cache.layout, shard), cache, endpoint)
        got = _assemble(dst)
        want = torch.zeros(MODEL.cache_shape(BLOCKS))
        want[:, :, DST_IDS] = whole[:, :, SRC_IDS]
        assert torch.equal(got, want)  # every destination block exactly, nothing else written
        # each head from one sender, to every receiving rank holding it
        copies = max(1, dst_shape[0] // MODEL.num_kv_heads)
        assert moved == len(SRC_IDS) * MODEL.block_bytes * copies
    finally:
        for cache, _ in src + dst:
            cache.close()


def test_a_replicated_head_has_one_sender():
    layout = _group(8, 1)
    shards = [layout.shard(r) for r in range(8)]
    assert [(s.head_start, s.sends) for s in shards] == [
        (0, True), (0, False), (1, True), (1, False), (2, True), (2, False), (3, True),
        (3, False)]
    assert [_group(2, 1).shard(r).head_start for r in range(2)] == [0, 2]
    assert _group(2, 1).shard(1) == KVShard(0, 4, 2, 4)
    assert _group(1, 4).shard(0, 3) == KVShard(3, 4, 0, 4)


def test_splits():
    assert [layer_split(10, 4, s) for s in range(4)] == [(0, 3), (3, 6), (6, 8), (8, 10)]
    assert [kv_head_split(2, 4, r) for r in range(4)] == [(0, 1), (0, 1), (1, 2), (1, 2)]
    assert [kv_head_split(8, 2, r) for r in range(2)] == [(0, 4), (4, 8)]
    with pytest.raises(ValueError, match="exceeds"):
        layer_split(2, 3, 0)
    assert _group(2, 2).same_model(MODEL) and not MODEL.same_model(
        KVLayout(4, 2, 8, 4, "float32"))


@pytest.mark.parametrize("endpoint", [
    "shm://x?num_blocks=4",                       # no ranges
    "shm://x?num_blocks=4&layers=2-1&heads=0-4",  # an empty layer range
    "shm://x?num_blocks=4&layers=0-4&heads=a-b",
    "shm://a/b?num_blocks=4&layers=0-4&heads=0-4",
    "tcp://x?num_blocks=4&layers=0-4&heads=0-4",
])
def test_malformed_group_endpoints_are_refused(endpoint):
    cache = PagedKVCache(MODEL, BLOCKS)
    with pytest.raises(KVTransferError):
        ShmSender(MODEL).send("t", cache, [0], endpoint, [0])


def test_a_part_whose_segment_size_disagrees_is_refused():
    dst = PagedKVCache(MODEL, BLOCKS, shm_name=f"pdserve-kv-test-size-{os.getpid()}")
    try:
        bad = ShmListener(dst, KVShard(0, 4, 0, 2)).endpoint()  # claims half the heads
        with pytest.raises(KVTransferError, match="cannot map"):
            ShmSender(MODEL).send("t", PagedKVCache(MODEL, BLOCKS), [0], bad, [0])
    finally:
        dst.close()


@pytest.mark.parametrize("src_shape,dst_shape", [
    ((1, 1), (2, 1)), ((2, 1), (1, 1)), ((2, 1), (2, 1)), ((8, 1), (2, 2)), ((1, 2), (4, 1)),
    ((2, 2), (1, 4)), ((4, 1), (8, 1)), ((1, 4), (1, 2))], ids=str)
def test_tcp_frames_go_from_every_rank_to_the_ranks_that_hold_their_heads(loop, src_shape,  # noqa: F811
                                                                           dst_shape):
    src_layout, dst_layout = _group(*src_shape), _group(*dst_shape)
    whole = torch.randn(MODEL.cache_shape(BLOCKS))
    src = _ranks(src_layout, "tsrc", whole)
    dst = _ranks(dst_layout, "tdst", None)
    cfg = TransferConfig(timeout_s=10)
    receivers = [KVReceiver() for _ in dst]
    listeners = [TcpListener(c, r, cfg, s) for (c, s), r in zip(dst, receivers)]
    try:
        for listener, receiver in zip(listeners, receivers):
            run(loop, listener.start())
            receiver.expect("t", "req", DST_IDS, "tcp")
        endpoint = ",".join(listener.endpoint() for listener in listeners)
        moved = 0
        for i, (cache, shard) in enumerate(src):
            moved += _stream(TcpSender(cache.layout, cfg, shard, KVShard.whole(MODEL)), cache,
                             endpoint)
            if i < len(src) - 1:  # a receiving cache some other rank still sends to waits
                waiting = [r for (_, s), r in zip(dst, receivers)
                           if any(x.overlap(s) and x.sends for _, x in src[i + 1:])]
                assert all(r.expected_blocks("t") is not None for r in waiting)
        assert all(r.complete("t", DST_IDS) == len(DST_IDS) for r in receivers)
        want = torch.zeros(MODEL.cache_shape(BLOCKS))
        want[:, :, DST_IDS] = whole[:, :, SRC_IDS]
        assert torch.equal(_assemble(dst), want)
        copies = max(1, dst_shape[0] // MODEL.num_kv_heads)
        assert moved == len(SRC_IDS) * MODEL.block_bytes * copies
    finally:
        for listener in listeners:
            run(loop, listener.close())
        for cache, _ in src + dst:
            cache.close()


def test_a_rank_that_stops_short_of_its_part_is_refused(loop):  # noqa: F811
    """A sending rank's last frame to a cache must come after frames covering every layer and
    head of that cache its shard holds; the transfer then never counts as received."""
    dst = _ranks(_group(1, 1), "short", None)
    receiver = KVReceiver()
    listener = TcpListener(dst[0][0], receiver, TransferConfig(timeout_s=10), dst[0][1])
    try:
        run(loop, listener.start())
        receiver.expect("t", "req", [1], "tcp")
        # rank 0 of a T=2 group holds layers 0-4 and heads 0-2 but sends only layers 0-2
        shape = [2, 2, 1, MODEL.block_size, 2, MODEL.head_dim]
        payload = torch.randn(shape).view(torch.uint8).numpy().tobytes()
        raw = encode_header(FrameHeader(
            "t", (1,), 0, 2, "float32", tuple(shape), len(payload), True,
            payload_digest=payload_digest(b"", payload), head_start=0, head_end=2,
            src=KVShard(0, 4, 0, 2)), b"")
        host, port = listener.endpoint().partition("?")[0][len("tcp://"):].rsplit(":", 1)
        with socket.create_connection((host, int(port)), timeout=5) as sock:
            sock.sendall(struct.pack("!I", len(raw)) + raw + payload)
            n = struct.unpack("!I", sock.recv(4))[0]
            ack = kv_transfer_pb2.KVTransferAck.FromString(sock.recv(n))
        assert ack.error == "not every layer was sent"
        assert receiver.frames_rejected == 1
        with pytest.raises(KVTransferError, match="never arrived"):
            receiver.complete("t", [1])
    finally:
        run(loop, listener.close())
        for cache, _ in dst:
            cache.close()
