"""The KV frame header both network transports put in front of raw KV bytes, and the answer to a
transfer: the codec of the worker <-> worker boundary (protos/kv_transfer.proto <-> FrameHeader),
its size cap, its authentication and the receiver's checks, all made before a single payload byte
is read. Nothing but this module sees the wire format.

Every frame's header carries a digest of its payload, which the receiver checks before a byte of
it reaches the cache: with a shared secret an HMAC-SHA256 of the payload (and the header's own
HMAC covers that digest, so a frame cannot be altered without the secret), without one xxh3-128
(a checksum against corruption on the way, not against an attacker)."""
from __future__ import annotations

import hashlib
import hmac
from dataclasses import dataclass, replace
from math import prod

import xxhash
from google.protobuf.message import DecodeError

from common.kv_layout import KVLayout, KVShard
from protos import kv_transfer_pb2

MAX_HEADER_BYTES = 1 << 20  # a serialized header larger than this is refused unread


class MalformedFrame(ValueError):
    """Bytes that do not parse as the message they should be."""


@dataclass(frozen=True)
class FrameHeader:
    transfer_id: str
    dst_block_ids: tuple[int, ...]
    layer_start: int              # layers [layer_start, layer_end) follow
    layer_end: int
    dtype: str
    shape: tuple[int, ...]        # of the payload tensor
    payload_bytes: int
    last: bool                    # the transfer is complete after this frame
    auth_tag: bytes = b""         # HMAC over the header without it, when a secret is set
    payload_digest: bytes = b""   # payload_digest(secret, payload)
    head_start: int = 0           # the payload's KV heads; 0, 0: all the receiver holds
    head_end: int = 0
    src: KVShard | None = None    # the sending rank's shard; None: it covers the whole receiver

    def heads(self, shard: KVShard) -> tuple[int, int]:
        return (self.head_start, self.head_end) if self.head_end else \
            (shard.head_start, shard.head_end)


def _to_pb(h: FrameHeader) -> kv_transfer_pb2.KVFrameHeader:
    return kv_transfer_pb2.KVFrameHeader(
        transfer_id=h.transfer_id, dst_block_ids=h.dst_block_ids, layer_start=h.layer_start,
        layer_end=h.layer_end, dtype=h.dtype, shape=h.shape, payload_bytes=h.payload_bytes,
        last=h.last, auth_tag=h.auth_tag, payload_digest=h.payload_digest,
        head_start=h.head_start, head_end=h.head_end,
        src_layer_start=h.src.layer_start if h.src else 0,
        src_layer_end=h.src.layer_end if h.src else 0,
        src_head_start=h.src.head_start if h.src else 0,
        src_head_end=h.src.head_end if h.src else 0)


def encode_header(h: FrameHeader, secret: bytes) -> bytes:
    """The header on the wire, signed when there is a secret."""
    if secret:
        h = replace(h, auth_tag=auth_tag(secret, h))
    return _to_pb(h).SerializeToString(deterministic=True)


def decode_header(raw: bytes) -> FrameHeader:
    try:
        pb = kv_transfer_pb2.KVFrameHeader.FromString(raw)
    except DecodeError as e:
        raise MalformedFrame(f"unreadable KV frame header: {e}") from e
    src = KVShard(pb.src_layer_start, pb.src_layer_end, pb.src_head_start, pb.src_head_end) \
        if pb.src_layer_end else None
    return FrameHeader(pb.transfer_id, tuple(pb.dst_block_ids), pb.layer_start, pb.layer_end,
                       pb.dtype, tuple(pb.shape), pb.payload_bytes, pb.last, pb.auth_tag,
                       pb.payload_digest, pb.head_start, pb.head_end, src)


def encode_ack(transfer_id: str, error: str) -> bytes:
    """The receiver's answer once a transfer's last frame landed ("") or it refused it."""
    return kv_transfer_pb2.KVTransferAck(transfer_id=transfer_id, error=error).SerializeToString()


def decode_ack(raw: bytes) -> tuple[str, str]:
    """(transfer id, error or "")."""
    try:
        pb = kv_transfer_pb2.KVTransferAck.FromString(raw)
    except DecodeError as e:
        raise MalformedFrame(f"unreadable KV transfer answer: {e}") from e
    return pb.transfer_id, pb.error


def auth_tag(secret: bytes, header: FrameHeader) -> bytes:
    """HMAC-SHA256 over the header serialized without its tag."""
    unsigned = _to_pb(replace(header, auth_tag=b"")).SerializeToString(deterministic=True)
    return hmac.new(secret, unsigned, hashlib.sha256).digest()


def authentic(secret: bytes, header: FrameHeader) -> bool:
    return not secret or hmac.compare_digest(header.auth_tag, auth_tag(secret, header))


def payload_digest(secret: bytes, payload) -> bytes:
    """Digest of a frame's payload (any buffer of its raw bytes): HMAC-SHA256 keyed with the
    secret when there is one, else xxh3-128."""
    if secret:
        return hmac.new(secret, payload, hashlib.sha256).digest()
    return xxhash.xxh3_128(payload).digest()


def intact(secret: bytes, header: FrameHeader, payload) -> bool:
    """Whether the payload read for header is the one its sender digested."""
    return hmac.compare_digest(header.payload_digest, payload_digest(secret, payload))


def check_frame(h: FrameHeader, layout: KVLayout, reserved: tuple[int, ...],
                shard: KVShard | None = None) -> tuple[str, tuple[int, ...]]:
    """(refusal or "", payload shape) of a frame for a transfer expected into `reserved`: every
    frame carries all of its blocks, layers and heads this cache holds (`shard`, default all the
    model's), and dtype, shape and size of this cache."""
    shard = shard or KVShard.whole(layout)
    h0, h1 = h.heads(shard)
    shape = (h.layer_end - h.layer_start, 2, len(h.dst_block_ids), layout.block_size,
             h1 - h0, layout.head_dim)
    if sorted(h.dst_block_ids) != sorted(reserved):
        return f"transfer {h.transfer_id}: blocks outside its reservation", shape
    if not shard.layer_start <= h.layer_start < h.layer_end <= shard.layer_end:
        return f"layers [{h.layer_start}, {h.layer_end}) out of range", shape
    if not shard.head_start <= h0 < h1 <= shard.head_end:
        return f"KV heads [{h0}, {h1}) out of range", shape
    if h.dtype != layout.dtype or h.shape != shape:
        return (f"{h.dtype}{list(h.shape)} does not match the cache's "
                f"{layout.dtype}{list(shape)}"), shape
    if h.payload_bytes != layout.element_bytes * prod(shape):
        return f"{h.payload_bytes} payload bytes for shape {list(shape)}", shape
    return "", shape
