"""The KV frame header both network transports use: its size cap, its authentication and the
receiver's checks, all made before a single payload byte is read."""
from __future__ import annotations

import hashlib
import hmac

import torch

from common.kv_layout import KVLayout
from protos import kv_transfer_pb2

MAX_HEADER_BYTES = 1 << 20  # a serialized KVFrameHeader larger than this is refused unread


def auth_tag(secret: bytes, header: kv_transfer_pb2.KVFrameHeader) -> bytes:
    """HMAC-SHA256 over the header serialized without its tag."""
    unsigned = kv_transfer_pb2.KVFrameHeader()
    unsigned.CopyFrom(header)
    unsigned.ClearField("auth_tag")
    return hmac.new(secret, unsigned.SerializeToString(deterministic=True), hashlib.sha256).digest()


def authentic(secret: bytes, header: kv_transfer_pb2.KVFrameHeader) -> bool:
    return not secret or hmac.compare_digest(header.auth_tag, auth_tag(secret, header))


def check_frame(h: kv_transfer_pb2.KVFrameHeader, layout: KVLayout,
                reserved: tuple[int, ...]) -> tuple[str, tuple[int, ...]]:
    """(refusal or "", payload shape) of a frame for a transfer expected into `reserved`: every
    frame carries all of its blocks, layers in range, and dtype, shape and size of this cache."""
    shape = (h.layer_end - h.layer_start, 2, len(h.dst_block_ids), layout.block_size,
             layout.num_kv_heads, layout.head_dim)
    if sorted(h.dst_block_ids) != sorted(reserved):
        return f"transfer {h.transfer_id}: blocks outside its reservation", shape
    if not 0 <= h.layer_start < h.layer_end <= layout.num_layers:
        return f"layers [{h.layer_start}, {h.layer_end}) out of range", shape
    if h.dtype != layout.dtype or tuple(h.shape) != shape:
        return (f"{h.dtype}{list(h.shape)} does not match the cache's "
                f"{layout.dtype}{list(shape)}"), shape
    elem = layout.element_bytes
    if h.payload_bytes != elem * torch.Size(shape).numel():
        return f"{h.payload_bytes} payload bytes for shape {list(shape)}", shape
    return "", shape
