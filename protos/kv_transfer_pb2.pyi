from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable
from typing import ClassVar as _ClassVar, Optional as _Optional

DESCRIPTOR: _descriptor.FileDescriptor

class KVFrameHeader(_message.Message):
    __slots__ = ("transfer_id", "dst_block_ids", "layer_start", "layer_end", "dtype", "shape", "payload_bytes", "last", "auth_tag", "payload_digest", "head_start", "head_end", "src_layer_start", "src_layer_end", "src_head_start", "src_head_end")
    TRANSFER_ID_FIELD_NUMBER: _ClassVar[int]
    DST_BLOCK_IDS_FIELD_NUMBER: _ClassVar[int]
    LAYER_START_FIELD_NUMBER: _ClassVar[int]
    LAYER_END_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    SHAPE_FIELD_NUMBER: _ClassVar[int]
    PAYLOAD_BYTES_FIELD_NUMBER: _ClassVar[int]
    LAST_FIELD_NUMBER: _ClassVar[int]
    AUTH_TAG_FIELD_NUMBER: _ClassVar[int]
    PAYLOAD_DIGEST_FIELD_NUMBER: _ClassVar[int]
    HEAD_START_FIELD_NUMBER: _ClassVar[int]
    HEAD_END_FIELD_NUMBER: _ClassVar[int]
    SRC_LAYER_START_FIELD_NUMBER: _ClassVar[int]
    SRC_LAYER_END_FIELD_NUMBER: _ClassVar[int]
    SRC_HEAD_START_FIELD_NUMBER: _ClassVar[int]
    SRC_HEAD_END_FIELD_NUMBER: _ClassVar[int]
    transfer_id: str
    dst_block_ids: _containers.RepeatedScalarFieldContainer[int]
    layer_start: int
    layer_end: int
    dtype: str
    shape: _containers.RepeatedScalarFieldContainer[int]
    payload_bytes: int
    last: bool
    auth_tag: bytes
    payload_digest: bytes
    head_start: int
    head_end: int
    src_layer_start: int
    src_layer_end: int
    src_head_start: int
    src_head_end: int
    def __init__(self, transfer_id: _Optional[str] = ..., dst_block_ids: _Optional[_Iterable[int]] = ..., layer_start: _Optional[int] = ..., layer_end: _Optional[int] = ..., dtype: _Optional[str] = ..., shape: _Optional[_Iterable[int]] = ..., payload_bytes: _Optional[int] = ..., last: _Optional[bool] = ..., auth_tag: _Optional[bytes] = ..., payload_digest: _Optional[bytes] = ..., head_start: _Optional[int] = ..., head_end: _Optional[int] = ..., src_layer_start: _Optional[int] = ..., src_layer_end: _Optional[int] = ..., src_head_start: _Optional[int] = ..., src_head_end: _Optional[int] = ...) -> None: ...

class KVTransferAck(_message.Message):
    __slots__ = ("transfer_id", "error")
    TRANSFER_ID_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    transfer_id: str
    error: str
    def __init__(self, transfer_id: _Optional[str] = ..., error: _Optional[str] = ...) -> None: ...
