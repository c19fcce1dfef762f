from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class SamplingParams(_message.Message):
    __slots__ = ("temperature", "top_p", "top_k", "min_p", "seed", "presence_penalty", "frequency_penalty", "repetition_penalty", "max_tokens", "min_tokens", "stop_token_ids", "ignore_eos", "logprobs", "prompt_logprobs", "logit_bias", "grammar")
    class LogitBiasEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: int
        value: float
        def __init__(self, key: _Optional[int] = ..., value: _Optional[float] = ...) -> None: ...
    TEMPERATURE_FIELD_NUMBER: _ClassVar[int]
    TOP_P_FIELD_NUMBER: _ClassVar[int]
    TOP_K_FIELD_NUMBER: _ClassVar[int]
    MIN_P_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    PRESENCE_PENALTY_FIELD_NUMBER: _ClassVar[int]
    FREQUENCY_PENALTY_FIELD_NUMBER: _ClassVar[int]
    REPETITION_PENALTY_FIELD_NUMBER: _ClassVar[int]
    MAX_TOKENS_FIELD_NUMBER: _ClassVar[int]
    MIN_TOKENS_FIELD_NUMBER: _ClassVar[int]
    STOP_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    IGNORE_EOS_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    PROMPT_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    LOGIT_BIAS_FIELD_NUMBER: _ClassVar[int]
    GRAMMAR_FIELD_NUMBER: _ClassVar[int]
    temperature: float
    top_p: float
    top_k: int
    min_p: float
    seed: int
    presence_penalty: float
    frequency_penalty: float
    repetition_penalty: float
    max_tokens: int
    min_tokens: int
    stop_token_ids: _containers.RepeatedScalarFieldContainer[int]
    ignore_eos: bool
    logprobs: int
    prompt_logprobs: int
    logit_bias: _containers.ScalarMap[int, float]
    grammar: str
    def __init__(self, temperature: _Optional[float] = ..., top_p: _Optional[float] = ..., top_k: _Optional[int] = ..., min_p: _Optional[float] = ..., seed: _Optional[int] = ..., presence_penalty: _Optional[float] = ..., frequency_penalty: _Optional[float] = ..., repetition_penalty: _Optional[float] = ..., max_tokens: _Optional[int] = ..., min_tokens: _Optional[int] = ..., stop_token_ids: _Optional[_Iterable[int]] = ..., ignore_eos: _Optional[bool] = ..., logprobs: _Optional[int] = ..., prompt_logprobs: _Optional[int] = ..., logit_bias: _Optional[_Mapping[int, float]] = ..., grammar: _Optional[str] = ...) -> None: ...

class GenerateRequest(_message.Message):
    __slots__ = ("request_id", "prompt_token_ids", "sampling", "eos_token_ids", "priority", "cache_salt", "sample_ids", "resumed", "trace_context")
    class TraceContextEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    EOS_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    PRIORITY_FIELD_NUMBER: _ClassVar[int]
    CACHE_SALT_FIELD_NUMBER: _ClassVar[int]
    SAMPLE_IDS_FIELD_NUMBER: _ClassVar[int]
    RESUMED_FIELD_NUMBER: _ClassVar[int]
    TRACE_CONTEXT_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    prompt_token_ids: _containers.RepeatedScalarFieldContainer[int]
    sampling: SamplingParams
    eos_token_ids: _containers.RepeatedScalarFieldContainer[int]
    priority: int
    cache_salt: str
    sample_ids: _containers.RepeatedScalarFieldContainer[str]
    resumed: _containers.RepeatedCompositeFieldContainer[ResumedSample]
    trace_context: _containers.ScalarMap[str, str]
    def __init__(self, request_id: _Optional[str] = ..., prompt_token_ids: _Optional[_Iterable[int]] = ..., sampling: _Optional[_Union[SamplingParams, _Mapping]] = ..., eos_token_ids: _Optional[_Iterable[int]] = ..., priority: _Optional[int] = ..., cache_salt: _Optional[str] = ..., sample_ids: _Optional[_Iterable[str]] = ..., resumed: _Optional[_Iterable[_Union[ResumedSample, _Mapping]]] = ..., trace_context: _Optional[_Mapping[str, str]] = ...) -> None: ...

class ResumedSample(_message.Message):
    __slots__ = ("sample", "output_token_ids", "finished")
    SAMPLE_FIELD_NUMBER: _ClassVar[int]
    OUTPUT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    FINISHED_FIELD_NUMBER: _ClassVar[int]
    sample: int
    output_token_ids: _containers.RepeatedScalarFieldContainer[int]
    finished: bool
    def __init__(self, sample: _Optional[int] = ..., output_token_ids: _Optional[_Iterable[int]] = ..., finished: _Optional[bool] = ...) -> None: ...

class TopLogprob(_message.Message):
    __slots__ = ("token_id", "logprob")
    TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    LOGPROB_FIELD_NUMBER: _ClassVar[int]
    token_id: int
    logprob: float
    def __init__(self, token_id: _Optional[int] = ..., logprob: _Optional[float] = ...) -> None: ...

class TokenLogprobs(_message.Message):
    __slots__ = ("logprob", "top", "rank")
    LOGPROB_FIELD_NUMBER: _ClassVar[int]
    TOP_FIELD_NUMBER: _ClassVar[int]
    RANK_FIELD_NUMBER: _ClassVar[int]
    logprob: float
    top: _containers.RepeatedCompositeFieldContainer[TopLogprob]
    rank: int
    def __init__(self, logprob: _Optional[float] = ..., top: _Optional[_Iterable[_Union[TopLogprob, _Mapping]]] = ..., rank: _Optional[int] = ...) -> None: ...

class GenerateResponse(_message.Message):
    __slots__ = ("token_ids", "logprobs", "finish_reason", "num_prompt_tokens", "num_cached_tokens", "stop_token_id", "error", "sample", "prompt_logprobs", "request_id")
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    NUM_PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    NUM_CACHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    STOP_TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    SAMPLE_FIELD_NUMBER: _ClassVar[int]
    PROMPT_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    logprobs: _containers.RepeatedCompositeFieldContainer[TokenLogprobs]
    finish_reason: str
    num_prompt_tokens: int
    num_cached_tokens: int
    stop_token_id: int
    error: str
    sample: int
    prompt_logprobs: _containers.RepeatedCompositeFieldContainer[TokenLogprobs]
    request_id: str
    def __init__(self, token_ids: _Optional[_Iterable[int]] = ..., logprobs: _Optional[_Iterable[_Union[TokenLogprobs, _Mapping]]] = ..., finish_reason: _Optional[str] = ..., num_prompt_tokens: _Optional[int] = ..., num_cached_tokens: _Optional[int] = ..., stop_token_id: _Optional[int] = ..., error: _Optional[str] = ..., sample: _Optional[int] = ..., prompt_logprobs: _Optional[_Iterable[_Union[TokenLogprobs, _Mapping]]] = ..., request_id: _Optional[str] = ...) -> None: ...

class SessionRequest(_message.Message):
    __slots__ = ("generate", "abort")
    GENERATE_FIELD_NUMBER: _ClassVar[int]
    ABORT_FIELD_NUMBER: _ClassVar[int]
    generate: GenerateRequest
    abort: str
    def __init__(self, generate: _Optional[_Union[GenerateRequest, _Mapping]] = ..., abort: _Optional[str] = ...) -> None: ...

class Refusal(_message.Message):
    __slots__ = ("request_id", "code", "message")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    CODE_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    code: int
    message: str
    def __init__(self, request_id: _Optional[str] = ..., code: _Optional[int] = ..., message: _Optional[str] = ...) -> None: ...

class SessionResponse(_message.Message):
    __slots__ = ("outputs", "refused")
    OUTPUTS_FIELD_NUMBER: _ClassVar[int]
    REFUSED_FIELD_NUMBER: _ClassVar[int]
    outputs: _containers.RepeatedCompositeFieldContainer[GenerateResponse]
    refused: _containers.RepeatedCompositeFieldContainer[Refusal]
    def __init__(self, outputs: _Optional[_Iterable[_Union[GenerateResponse, _Mapping]]] = ..., refused: _Optional[_Iterable[_Union[Refusal, _Mapping]]] = ...) -> None: ...

class AbortRequest(_message.Message):
    __slots__ = ("request_id",)
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    def __init__(self, request_id: _Optional[str] = ...) -> None: ...

class AbortResponse(_message.Message):
    __slots__ = ("found",)
    FOUND_FIELD_NUMBER: _ClassVar[int]
    found: bool
    def __init__(self, found: _Optional[bool] = ...) -> None: ...

class StatsRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class WorkerStats(_message.Message):
    __slots__ = ("worker_id", "role", "kv_endpoint", "num_blocks", "num_free_blocks", "num_running", "prompt_tokens_computed", "tokens_decoded", "kv_blocks_sent", "kv_blocks_received", "steps", "num_speculative_tokens", "spec_decode_num_drafts", "spec_decode_num_draft_tokens", "spec_decode_num_accepted_tokens", "spec_decode_num_accepted_tokens_per_pos", "kv_frames_rejected", "num_tier_blocks", "tier_id", "num_tier_used_blocks", "tier_hit_tokens", "tier_blocks_stored", "tier_blocks_loaded", "tensor_parallel_size", "pipeline_parallel_size", "kv_bytes_sent_per_rank")
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    ROLE_FIELD_NUMBER: _ClassVar[int]
    KV_ENDPOINT_FIELD_NUMBER: _ClassVar[int]
    NUM_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    NUM_FREE_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    NUM_RUNNING_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKENS_COMPUTED_FIELD_NUMBER: _ClassVar[int]
    TOKENS_DECODED_FIELD_NUMBER: _ClassVar[int]
    KV_BLOCKS_SENT_FIELD_NUMBER: _ClassVar[int]
    KV_BLOCKS_RECEIVED_FIELD_NUMBER: _ClassVar[int]
    STEPS_FIELD_NUMBER: _ClassVar[int]
    NUM_SPECULATIVE_TOKENS_FIELD_NUMBER: _ClassVar[int]
    SPEC_DECODE_NUM_DRAFTS_FIELD_NUMBER: _ClassVar[int]
    SPEC_DECODE_NUM_DRAFT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    SPEC_DECODE_NUM_ACCEPTED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    SPEC_DECODE_NUM_ACCEPTED_TOKENS_PER_POS_FIELD_NUMBER: _ClassVar[int]
    KV_FRAMES_REJECTED_FIELD_NUMBER: _ClassVar[int]
    NUM_TIER_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    TIER_ID_FIELD_NUMBER: _ClassVar[int]
    NUM_TIER_USED_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    TIER_HIT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    TIER_BLOCKS_STORED_FIELD_NUMBER: _ClassVar[int]
    TIER_BLOCKS_LOADED_FIELD_NUMBER: _ClassVar[int]
    TENSOR_PARALLEL_SIZE_FIELD_NUMBER: _ClassVar[int]
    PIPELINE_PARALLEL_SIZE_FIELD_NUMBER: _ClassVar[int]
    KV_BYTES_SENT_PER_RANK_FIELD_NUMBER: _ClassVar[int]
    worker_id: str
    role: str
    kv_endpoint: str
    num_blocks: int
    num_free_blocks: int
    num_running: int
    prompt_tokens_computed: int
    tokens_decoded: int
    kv_blocks_sent: int
    kv_blocks_received: int
    steps: int
    num_speculative_tokens: int
    spec_decode_num_drafts: int
    spec_decode_num_draft_tokens: int
    spec_decode_num_accepted_tokens: int
    spec_decode_num_accepted_tokens_per_pos: _containers.RepeatedScalarFieldContainer[int]
    kv_frames_rejected: int
    num_tier_blocks: int
    tier_id: str
    num_tier_used_blocks: int
    tier_hit_tokens: int
    tier_blocks_stored: int
    tier_blocks_loaded: int
    tensor_parallel_size: int
    pipeline_parallel_size: int
    kv_bytes_sent_per_rank: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, worker_id: _Optional[str] = ..., role: _Optional[str] = ..., kv_endpoint: _Optional[str] = ..., num_blocks: _Optional[int] = ..., num_free_blocks: _Optional[int] = ..., num_running: _Optional[int] = ..., prompt_tokens_computed: _Optional[int] = ..., tokens_decoded: _Optional[int] = ..., kv_blocks_sent: _Optional[int] = ..., kv_blocks_received: _Optional[int] = ..., steps: _Optional[int] = ..., num_speculative_tokens: _Optional[int] = ..., spec_decode_num_drafts: _Optional[int] = ..., spec_decode_num_draft_tokens: _Optional[int] = ..., spec_decode_num_accepted_tokens: _Optional[int] = ..., spec_decode_num_accepted_tokens_per_pos: _Optional[_Iterable[int]] = ..., kv_frames_rejected: _Optional[int] = ..., num_tier_blocks: _Optional[int] = ..., tier_id: _Optional[str] = ..., num_tier_used_blocks: _Optional[int] = ..., tier_hit_tokens: _Optional[int] = ..., tier_blocks_stored: _Optional[int] = ..., tier_blocks_loaded: _Optional[int] = ..., tensor_parallel_size: _Optional[int] = ..., pipeline_parallel_size: _Optional[int] = ..., kv_bytes_sent_per_rank: _Optional[_Iterable[int]] = ...) -> None: ...

class StatsResponse(_message.Message):
    __slots__ = ("num_running", "num_waiting", "num_finished", "workers", "num_preemptions")
    NUM_RUNNING_FIELD_NUMBER: _ClassVar[int]
    NUM_WAITING_FIELD_NUMBER: _ClassVar[int]
    NUM_FINISHED_FIELD_NUMBER: _ClassVar[int]
    WORKERS_FIELD_NUMBER: _ClassVar[int]
    NUM_PREEMPTIONS_FIELD_NUMBER: _ClassVar[int]
    num_running: int
    num_waiting: int
    num_finished: int
    workers: _containers.RepeatedCompositeFieldContainer[WorkerStats]
    num_preemptions: int
    def __init__(self, num_running: _Optional[int] = ..., num_waiting: _Optional[int] = ..., num_finished: _Optional[int] = ..., workers: _Optional[_Iterable[_Union[WorkerStats, _Mapping]]] = ..., num_preemptions: _Optional[int] = ...) -> None: ...
