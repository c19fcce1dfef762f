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

from common.kv_layout import KVLayout
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


def _to_pb(h: FrameHeader) -> kv_transfer_pb2.KVFrameHeader:
    return kv_transfer_pb2.KVFrameHeader(
        transfer_id=h.transfer_id, dst_block_ids=h.dst_block_ids, layer_start=h.layer_start,
        layer_end=h.layer_end, dtype=h.dtype, shape=h.shape, payload_bytes=h.payload_bytes,
        last=h.last, auth_tag=h.auth_tag, payload_digest=h.payload_digest)


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
    return FrameHeader(pb.transfer_id, tuple(pb.dst_block_ids), pb.layer_start, pb.layer_end,
                       pb.dtype, tuple(pb.shape), pb.payload_bytes, pb.last, pb.auth_tag,
                       pb.payload_digest)


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


def check_frame(h: FrameHeader, layout: KVLayout,
                reserved: tuple[int, ...]) -> tuple[str, tuple[int, ...]]:
    """(refusal or "", payload shape) of a frame for a transfer expected into `reserved`: every
    frame carries all of its blocks, layers in range, and dtype, shape and size of this cache."""
    shape = (h.layer_end - h.layer_start, 2, len(h.dst_block_ids), layout.block_size,
             layout.num_kv_heads, layout.head_dim)
    if sorted(h.dst_block_ids) != sorted(reserved):
        return f"transfer {h.transfer_id}: blocks outside its reservation", shape
    if not 0 <= h.layer_start < h.layer_end <= layout.num_layers:
        return f"layers [{h.layer_start}, {h.layer_end}) out of range", shape
    if h.dtype != layout.dtype or h.shape != shape:
        return (f"{h.dtype}{list(h.shape)} does not match the cache's "
                f"{layout.dtype}{list(shape)}"), shape
    if h.payload_bytes != layout.element_bytes * prod(shape):
        return f"{h.payload_bytes} payload bytes for shape {list(shape)}", shape
    return "", shape
