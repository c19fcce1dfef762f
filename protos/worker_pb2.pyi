from protos import scheduler_pb2 as _scheduler_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class KVLayout(_message.Message):
    __slots__ = ("num_layers", "num_kv_heads", "head_dim", "block_size", "dtype", "tensor_parallel_size", "pipeline_parallel_size")
    NUM_LAYERS_FIELD_NUMBER: _ClassVar[int]
    NUM_KV_HEADS_FIELD_NUMBER: _ClassVar[int]
    HEAD_DIM_FIELD_NUMBER: _ClassVar[int]
    BLOCK_SIZE_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    TENSOR_PARALLEL_SIZE_FIELD_NUMBER: _ClassVar[int]
    PIPELINE_PARALLEL_SIZE_FIELD_NUMBER: _ClassVar[int]
    num_layers: int
    num_kv_heads: int
    head_dim: int
    block_size: int
    dtype: str
    tensor_parallel_size: int
    pipeline_parallel_size: int
    def __init__(self, num_layers: _Optional[int] = ..., num_kv_heads: _Optional[int] = ..., head_dim: _Optional[int] = ..., block_size: _Optional[int] = ..., dtype: _Optional[str] = ..., tensor_parallel_size: _Optional[int] = ..., pipeline_parallel_size: _Optional[int] = ...) -> None: ...

class Register(_message.Message):
    __slots__ = ("worker_id", "role", "model_fingerprint", "num_blocks", "layout", "kv_endpoint", "transports", "host_id", "max_model_len", "kv_endpoints", "cpu_cores", "cached_blocks", "num_speculative_tokens", "num_tier_blocks", "tier_id")
    class KvEndpointsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    ROLE_FIELD_NUMBER: _ClassVar[int]
    MODEL_FINGERPRINT_FIELD_NUMBER: _ClassVar[int]
    NUM_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    LAYOUT_FIELD_NUMBER: _ClassVar[int]
    KV_ENDPOINT_FIELD_NUMBER: _ClassVar[int]
    TRANSPORTS_FIELD_NUMBER: _ClassVar[int]
    HOST_ID_FIELD_NUMBER: _ClassVar[int]
    MAX_MODEL_LEN_FIELD_NUMBER: _ClassVar[int]
    KV_ENDPOINTS_FIELD_NUMBER: _ClassVar[int]
    CPU_CORES_FIELD_NUMBER: _ClassVar[int]
    CACHED_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    NUM_SPECULATIVE_TOKENS_FIELD_NUMBER: _ClassVar[int]
    NUM_TIER_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    TIER_ID_FIELD_NUMBER: _ClassVar[int]
    worker_id: str
    role: str
    model_fingerprint: str
    num_blocks: int
    layout: KVLayout
    kv_endpoint: str
    transports: _containers.RepeatedScalarFieldContainer[str]
    host_id: str
    max_model_len: int
    kv_endpoints: _containers.ScalarMap[str, str]
    cpu_cores: _containers.RepeatedScalarFieldContainer[int]
    cached_blocks: _containers.RepeatedCompositeFieldContainer[CachedBlock]
    num_speculative_tokens: int
    num_tier_blocks: int
    tier_id: str
    def __init__(self, worker_id: _Optional[str] = ..., role: _Optional[str] = ..., model_fingerprint: _Optional[str] = ..., num_blocks: _Optional[int] = ..., layout: _Optional[_Union[KVLayout, _Mapping]] = ..., kv_endpoint: _Optional[str] = ..., transports: _Optional[_Iterable[str]] = ..., host_id: _Optional[str] = ..., max_model_len: _Optional[int] = ..., kv_endpoints: _Optional[_Mapping[str, str]] = ..., cpu_cores: _Optional[_Iterable[int]] = ..., cached_blocks: _Optional[_Iterable[_Union[CachedBlock, _Mapping]]] = ..., num_speculative_tokens: _Optional[int] = ..., num_tier_blocks: _Optional[int] = ..., tier_id: _Optional[str] = ...) -> None: ...

class CachedBlock(_message.Message):
    __slots__ = ("block_id", "hash")
    BLOCK_ID_FIELD_NUMBER: _ClassVar[int]
    HASH_FIELD_NUMBER: _ClassVar[int]
    block_id: int
    hash: bytes
    def __init__(self, block_id: _Optional[int] = ..., hash: _Optional[bytes] = ...) -> None: ...

class RegisterAck(_message.Message):
    __slots__ = ("worker_id", "error")
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    worker_id: str
    error: str
    def __init__(self, worker_id: _Optional[str] = ..., error: _Optional[str] = ...) -> None: ...

class NewRequest(_message.Message):
    __slots__ = ("request_id", "all_token_ids", "num_prompt_tokens", "num_computed_tokens", "block_ids", "sampling", "kv_transfer_id", "eos_token_ids", "trace_context", "forks")
    class TraceContextEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    ALL_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    NUM_PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    NUM_COMPUTED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    BLOCK_IDS_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    KV_TRANSFER_ID_FIELD_NUMBER: _ClassVar[int]
    EOS_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    TRACE_CONTEXT_FIELD_NUMBER: _ClassVar[int]
    FORKS_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    all_token_ids: _containers.RepeatedScalarFieldContainer[int]
    num_prompt_tokens: int
    num_computed_tokens: int
    block_ids: _containers.RepeatedScalarFieldContainer[int]
    sampling: _scheduler_pb2.SamplingParams
    kv_transfer_id: str
    eos_token_ids: _containers.RepeatedScalarFieldContainer[int]
    trace_context: _containers.ScalarMap[str, str]
    forks: _containers.RepeatedCompositeFieldContainer[Fork]
    def __init__(self, request_id: _Optional[str] = ..., all_token_ids: _Optional[_Iterable[int]] = ..., num_prompt_tokens: _Optional[int] = ..., num_computed_tokens: _Optional[int] = ..., block_ids: _Optional[_Iterable[int]] = ..., sampling: _Optional[_Union[_scheduler_pb2.SamplingParams, _Mapping]] = ..., kv_transfer_id: _Optional[str] = ..., eos_token_ids: _Optional[_Iterable[int]] = ..., trace_context: _Optional[_Mapping[str, str]] = ..., forks: _Optional[_Iterable[_Union[Fork, _Mapping]]] = ...) -> None: ...

class Fork(_message.Message):
    __slots__ = ("request_id", "sampling")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    sampling: _scheduler_pb2.SamplingParams
    def __init__(self, request_id: _Optional[str] = ..., sampling: _Optional[_Union[_scheduler_pb2.SamplingParams, _Mapping]] = ...) -> None: ...

class CachedRequest(_message.Message):
    __slots__ = ("request_id", "new_block_ids", "new_token_ids")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    NEW_BLOCK_IDS_FIELD_NUMBER: _ClassVar[int]
    NEW_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    new_block_ids: _containers.RepeatedScalarFieldContainer[int]
    new_token_ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, request_id: _Optional[str] = ..., new_block_ids: _Optional[_Iterable[int]] = ..., new_token_ids: _Optional[_Iterable[int]] = ...) -> None: ...

class ScheduledTokens(_message.Message):
    __slots__ = ("request_id", "num_tokens", "num_lookahead")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    NUM_TOKENS_FIELD_NUMBER: _ClassVar[int]
    NUM_LOOKAHEAD_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    num_tokens: int
    num_lookahead: int
    def __init__(self, request_id: _Optional[str] = ..., num_tokens: _Optional[int] = ..., num_lookahead: _Optional[int] = ...) -> None: ...

class KVSend(_message.Message):
    __slots__ = ("transfer_id", "request_id", "src_block_ids", "dst_block_ids", "dst_endpoint", "transport")
    TRANSFER_ID_FIELD_NUMBER: _ClassVar[int]
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    SRC_BLOCK_IDS_FIELD_NUMBER: _ClassVar[int]
    DST_BLOCK_IDS_FIELD_NUMBER: _ClassVar[int]
    DST_ENDPOINT_FIELD_NUMBER: _ClassVar[int]
    TRANSPORT_FIELD_NUMBER: _ClassVar[int]
    transfer_id: str
    request_id: str
    src_block_ids: _containers.RepeatedScalarFieldContainer[int]
    dst_block_ids: _containers.RepeatedScalarFieldContainer[int]
    dst_endpoint: str
    transport: str
    def __init__(self, transfer_id: _Optional[str] = ..., request_id: _Optional[str] = ..., src_block_ids: _Optional[_Iterable[int]] = ..., dst_block_ids: _Optional[_Iterable[int]] = ..., dst_endpoint: _Optional[str] = ..., transport: _Optional[str] = ...) -> None: ...

class KVRecv(_message.Message):
    __slots__ = ("transfer_id", "request_id", "block_ids", "transport")
    TRANSFER_ID_FIELD_NUMBER: _ClassVar[int]
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    BLOCK_IDS_FIELD_NUMBER: _ClassVar[int]
    TRANSPORT_FIELD_NUMBER: _ClassVar[int]
    transfer_id: str
    request_id: str
    block_ids: _containers.RepeatedScalarFieldContainer[int]
    transport: str
    def __init__(self, transfer_id: _Optional[str] = ..., request_id: _Optional[str] = ..., block_ids: _Optional[_Iterable[int]] = ..., transport: _Optional[str] = ...) -> None: ...

class StepPlan(_message.Message):
    __slots__ = ("step_id", "new_requests", "cached_requests", "scheduled", "sends", "recvs", "finished_request_ids", "copies", "num_threads", "cached_blocks", "num_steps", "tier_stores", "tier_loads", "tier_stores_ahead")
    STEP_ID_FIELD_NUMBER: _ClassVar[int]
    NEW_REQUESTS_FIELD_NUMBER: _ClassVar[int]
    CACHED_REQUESTS_FIELD_NUMBER: _ClassVar[int]
    SCHEDULED_FIELD_NUMBER: _ClassVar[int]
    SENDS_FIELD_NUMBER: _ClassVar[int]
    RECVS_FIELD_NUMBER: _ClassVar[int]
    FINISHED_REQUEST_IDS_FIELD_NUMBER: _ClassVar[int]
    COPIES_FIELD_NUMBER: _ClassVar[int]
    NUM_THREADS_FIELD_NUMBER: _ClassVar[int]
    CACHED_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    NUM_STEPS_FIELD_NUMBER: _ClassVar[int]
    TIER_STORES_FIELD_NUMBER: _ClassVar[int]
    TIER_LOADS_FIELD_NUMBER: _ClassVar[int]
    TIER_STORES_AHEAD_FIELD_NUMBER: _ClassVar[int]
    step_id: int
    new_requests: _containers.RepeatedCompositeFieldContainer[NewRequest]
    cached_requests: _containers.RepeatedCompositeFieldContainer[CachedRequest]
    scheduled: _containers.RepeatedCompositeFieldContainer[ScheduledTokens]
    sends: _containers.RepeatedCompositeFieldContainer[KVSend]
    recvs: _containers.RepeatedCompositeFieldContainer[KVRecv]
    finished_request_ids: _containers.RepeatedScalarFieldContainer[str]
    copies: _containers.RepeatedCompositeFieldContainer[BlockCopy]
    num_threads: int
    cached_blocks: _containers.RepeatedCompositeFieldContainer[CachedBlock]
    num_steps: int
    tier_stores: _containers.RepeatedCompositeFieldContainer[TierCopy]
    tier_loads: _containers.RepeatedCompositeFieldContainer[TierCopy]
    tier_stores_ahead: _containers.RepeatedCompositeFieldContainer[TierCopy]
    def __init__(self, step_id: _Optional[int] = ..., new_requests: _Optional[_Iterable[_Union[NewRequest, _Mapping]]] = ..., cached_requests: _Optional[_Iterable[_Union[CachedRequest, _Mapping]]] = ..., scheduled: _Optional[_Iterable[_Union[ScheduledTokens, _Mapping]]] = ..., sends: _Optional[_Iterable[_Union[KVSend, _Mapping]]] = ..., recvs: _Optional[_Iterable[_Union[KVRecv, _Mapping]]] = ..., finished_request_ids: _Optional[_Iterable[str]] = ..., copies: _Optional[_Iterable[_Union[BlockCopy, _Mapping]]] = ..., num_threads: _Optional[int] = ..., cached_blocks: _Optional[_Iterable[_Union[CachedBlock, _Mapping]]] = ..., num_steps: _Optional[int] = ..., tier_stores: _Optional[_Iterable[_Union[TierCopy, _Mapping]]] = ..., tier_loads: _Optional[_Iterable[_Union[TierCopy, _Mapping]]] = ..., tier_stores_ahead: _Optional[_Iterable[_Union[TierCopy, _Mapping]]] = ...) -> None: ...

class TierCopy(_message.Message):
    __slots__ = ("block", "slot")
    BLOCK_FIELD_NUMBER: _ClassVar[int]
    SLOT_FIELD_NUMBER: _ClassVar[int]
    block: int
    slot: int
    def __init__(self, block: _Optional[int] = ..., slot: _Optional[int] = ...) -> None: ...

class BlockCopy(_message.Message):
    __slots__ = ("src", "dst", "request_id", "leader_id")
    SRC_FIELD_NUMBER: _ClassVar[int]
    DST_FIELD_NUMBER: _ClassVar[int]
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    LEADER_ID_FIELD_NUMBER: _ClassVar[int]
    src: int
    dst: int
    request_id: str
    leader_id: str
    def __init__(self, src: _Optional[int] = ..., dst: _Optional[int] = ..., request_id: _Optional[str] = ..., leader_id: _Optional[str] = ...) -> None: ...

class SampledToken(_message.Message):
    __slots__ = ("request_id", "token_id", "logprobs")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    token_id: int
    logprobs: _scheduler_pb2.TokenLogprobs
    def __init__(self, request_id: _Optional[str] = ..., token_id: _Optional[int] = ..., logprobs: _Optional[_Union[_scheduler_pb2.TokenLogprobs, _Mapping]] = ...) -> None: ...

class PromptLogprobs(_message.Message):
    __slots__ = ("request_id", "start", "logprobs")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    START_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    start: int
    logprobs: _containers.RepeatedCompositeFieldContainer[_scheduler_pb2.TokenLogprobs]
    def __init__(self, request_id: _Optional[str] = ..., start: _Optional[int] = ..., logprobs: _Optional[_Iterable[_Union[_scheduler_pb2.TokenLogprobs, _Mapping]]] = ...) -> None: ...

class TransferDone(_message.Message):
    __slots__ = ("transfer_id", "error")
    TRANSFER_ID_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    transfer_id: str
    error: str
    def __init__(self, transfer_id: _Optional[str] = ..., error: _Optional[str] = ...) -> None: ...

class RequestError(_message.Message):
    __slots__ = ("request_id", "error")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    error: str
    def __init__(self, request_id: _Optional[str] = ..., error: _Optional[str] = ...) -> None: ...

class WorkerCounters(_message.Message):
    __slots__ = ("prompt_tokens_computed", "tokens_decoded", "kv_blocks_sent", "kv_blocks_received", "steps", "spec_drafts", "spec_draft_tokens", "spec_accepted_tokens", "spec_accepted_per_pos", "kv_frames_rejected", "tier_blocks_stored", "tier_blocks_loaded", "kv_bytes_sent_per_rank")
    PROMPT_TOKENS_COMPUTED_FIELD_NUMBER: _ClassVar[int]
    TOKENS_DECODED_FIELD_NUMBER: _ClassVar[int]
    KV_BLOCKS_SENT_FIELD_NUMBER: _ClassVar[int]
    KV_BLOCKS_RECEIVED_FIELD_NUMBER: _ClassVar[int]
    STEPS_FIELD_NUMBER: _ClassVar[int]
    SPEC_DRAFTS_FIELD_NUMBER: _ClassVar[int]
    SPEC_DRAFT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    SPEC_ACCEPTED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    SPEC_ACCEPTED_PER_POS_FIELD_NUMBER: _ClassVar[int]
    KV_FRAMES_REJECTED_FIELD_NUMBER: _ClassVar[int]
    TIER_BLOCKS_STORED_FIELD_NUMBER: _ClassVar[int]
    TIER_BLOCKS_LOADED_FIELD_NUMBER: _ClassVar[int]
    KV_BYTES_SENT_PER_RANK_FIELD_NUMBER: _ClassVar[int]
    prompt_tokens_computed: int
    tokens_decoded: int
    kv_blocks_sent: int
    kv_blocks_received: int
    steps: int
    spec_drafts: int
    spec_draft_tokens: int
    spec_accepted_tokens: int
    spec_accepted_per_pos: _containers.RepeatedScalarFieldContainer[int]
    kv_frames_rejected: int
    tier_blocks_stored: int
    tier_blocks_loaded: int
    kv_bytes_sent_per_rank: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, prompt_tokens_computed: _Optional[int] = ..., tokens_decoded: _Optional[int] = ..., kv_blocks_sent: _Optional[int] = ..., kv_blocks_received: _Optional[int] = ..., steps: _Optional[int] = ..., spec_drafts: _Optional[int] = ..., spec_draft_tokens: _Optional[int] = ..., spec_accepted_tokens: _Optional[int] = ..., spec_accepted_per_pos: _Optional[_Iterable[int]] = ..., kv_frames_rejected: _Optional[int] = ..., tier_blocks_stored: _Optional[int] = ..., tier_blocks_loaded: _Optional[int] = ..., kv_bytes_sent_per_rank: _Optional[_Iterable[int]] = ...) -> None: ...

class StepResult(_message.Message):
    __slots__ = ("step_id", "sampled", "errors", "counters", "prompt_logprobs", "more")
    STEP_ID_FIELD_NUMBER: _ClassVar[int]
    SAMPLED_FIELD_NUMBER: _ClassVar[int]
    ERRORS_FIELD_NUMBER: _ClassVar[int]
    COUNTERS_FIELD_NUMBER: _ClassVar[int]
    PROMPT_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    MORE_FIELD_NUMBER: _ClassVar[int]
    step_id: int
    sampled: _containers.RepeatedCompositeFieldContainer[SampledToken]
    errors: _containers.RepeatedCompositeFieldContainer[RequestError]
    counters: WorkerCounters
    prompt_logprobs: _containers.RepeatedCompositeFieldContainer[PromptLogprobs]
    more: bool
    def __init__(self, step_id: _Optional[int] = ..., sampled: _Optional[_Iterable[_Union[SampledToken, _Mapping]]] = ..., errors: _Optional[_Iterable[_Union[RequestError, _Mapping]]] = ..., counters: _Optional[_Union[WorkerCounters, _Mapping]] = ..., prompt_logprobs: _Optional[_Iterable[_Union[PromptLogprobs, _Mapping]]] = ..., more: _Optional[bool] = ...) -> None: ...

class TransfersDone(_message.Message):
    __slots__ = ("done", "counters")
    DONE_FIELD_NUMBER: _ClassVar[int]
    COUNTERS_FIELD_NUMBER: _ClassVar[int]
    done: _containers.RepeatedCompositeFieldContainer[TransferDone]
    counters: WorkerCounters
    def __init__(self, done: _Optional[_Iterable[_Union[TransferDone, _Mapping]]] = ..., counters: _Optional[_Union[WorkerCounters, _Mapping]] = ...) -> None: ...

class WorkerMessage(_message.Message):
    __slots__ = ("register", "result", "transfers", "leave")
    REGISTER_FIELD_NUMBER: _ClassVar[int]
    RESULT_FIELD_NUMBER: _ClassVar[int]
    TRANSFERS_FIELD_NUMBER: _ClassVar[int]
    LEAVE_FIELD_NUMBER: _ClassVar[int]
    register: Register
    result: StepResult
    transfers: TransfersDone
    leave: Leave
    def __init__(self, register: _Optional[_Union[Register, _Mapping]] = ..., result: _Optional[_Union[StepResult, _Mapping]] = ..., transfers: _Optional[_Union[TransfersDone, _Mapping]] = ..., leave: _Optional[_Union[Leave, _Mapping]] = ...) -> None: ...

class Leave(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class SchedulerMessage(_message.Message):
    __slots__ = ("ack", "plan")
    ACK_FIELD_NUMBER: _ClassVar[int]
    PLAN_FIELD_NUMBER: _ClassVar[int]
    ack: RegisterAck
    plan: StepPlan
    def __init__(self, ack: _Optional[_Union[RegisterAck, _Mapping]] = ..., plan: _Optional[_Union[StepPlan, _Mapping]] = ...) -> None: ...
