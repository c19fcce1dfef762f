"""What the scheduler and a worker say to each other, as plain dataclasses: a worker's
registration, the step plans the scheduler sends, the step results and transfer reports the
worker answers. protos/worker_codec.py converts them to and from protobuf; nothing else on either
side of the boundary sees the wire format.

A plan is built up while the scheduler plans a step (its lists grow); everything in it is
frozen.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from common.kv_layout import KVLayout
from common.sampling_params import SamplingParams, TokenLogprobs


@dataclass(frozen=True)
class Registration:
    worker_id: str
    role: str                      # "prefill" or "decode"
    model_fingerprint: str
    num_blocks: int
    layout: KVLayout
    transports: tuple[str, ...]
    kv_endpoints: dict[str, str]   # transport -> address peers send to
    host_id: str = ""
    max_model_len: int = 0
    cpu_cores: tuple[int, ...] = ()  # a CPU worker's cores (its affinity); () on a GPU
    cached_blocks: tuple[tuple[int, bytes], ...] = ()  # (block id, hash) its cache holds
    num_speculative_tokens: int = 0  # drafts it verifies per decode step (0: no speculation)
    num_tier_blocks: int = 0  # blocks of its second KV tier (--kv-offloading-size); 0: none
    tier_id: str = ""  # a tier shared by the workers of its host: its name; "": its own


@dataclass(frozen=True)
class Fork:
    """A sample of the same prompt: samples its first token from its leader's logits."""
    request_id: str
    sampling: SamplingParams


@dataclass(frozen=True)
class NewRequest:
    """A request as a worker first sees it; all_token_ids = prompt + output tokens so far."""
    request_id: str
    all_token_ids: tuple[int, ...]
    num_prompt_tokens: int
    num_computed_tokens: int        # tokens whose KV is in block_ids already
    block_ids: tuple[int, ...]
    sampling: SamplingParams
    eos_token_ids: tuple[int, ...] = ()
    kv_transfer_id: str = ""        # non-empty: block_ids were filled by this transfer
    forks: tuple[Fork, ...] = ()
    trace_context: dict[str, str] = field(default_factory=dict)  # W3C headers of its span


@dataclass(frozen=True)
class CachedRequest:
    """Diffs for a request the worker holds already."""
    request_id: str
    new_block_ids: tuple[int, ...] = ()
    new_token_ids: tuple[int, ...] = ()


@dataclass(frozen=True)
class ScheduledTokens:
    """num_tokens of the request's tokens to compute. A decoding request may also hold
    num_lookahead slots past its last token: the worker fills them with draft tokens it
    verifies in the same forward (speculative decoding), so one step may sample up to
    num_lookahead + 1 tokens of it."""
    request_id: str
    num_tokens: int
    num_lookahead: int = 0


@dataclass(frozen=True)
class KVSend:
    """Push blocks of this worker into a peer's cache, after the step's result went out."""
    transfer_id: str
    request_id: str
    src_block_ids: tuple[int, ...]
    dst_block_ids: tuple[int, ...]
    dst_endpoint: str
    transport: str


@dataclass(frozen=True)
class KVRecv:
    """Blocks of this worker that a peer will fill."""
    transfer_id: str
    request_id: str
    block_ids: tuple[int, ...]
    transport: str


@dataclass(frozen=True)
class BlockCopy:
    """Before the forward: fork request_id's own copy of its leader's partial last prompt block.
    If the leader failed to join this step (its KV never landed), the fork fails too."""
    src: int
    dst: int
    request_id: str
    leader_id: str


@dataclass
class StepPlan:
    step_id: int
    new_requests: list[NewRequest] = field(default_factory=list)
    cached_requests: list[CachedRequest] = field(default_factory=list)
    scheduled: list[ScheduledTokens] = field(default_factory=list)   # order = batch order
    sends: list[KVSend] = field(default_factory=list)
    recvs: list[KVRecv] = field(default_factory=list)
    finished_request_ids: list[str] = field(default_factory=list)    # drop their state
    copies: list[BlockCopy] = field(default_factory=list)
    num_threads: int = 0  # CPU threads for this step (cores lent and taken back); 0: as before
    num_steps: int = 1  # a decode-only plan may run this many decode steps (multi-step), a
                        # result after each
    cached_blocks: list[tuple[int, bytes]] = field(default_factory=list)  # newly cached
    # before anything else: (block, slot) cached blocks the plan reuses go to the second tier,
    # then (slot, block) prefix hits in the tier come back into the cache
    tier_stores: list[tuple[int, int]] = field(default_factory=list)
    tier_loads: list[tuple[int, int]] = field(default_factory=list)
    # (block, slot) free cached blocks next in line for eviction: copied to the tier in the
    # background while the step computes, done before its result goes out
    tier_stores_ahead: list[tuple[int, int]] = field(default_factory=list)

    def is_empty(self) -> bool:
        return not (self.scheduled or self.finished_request_ids or self.recvs
                    or self.new_requests or self.sends or self.tier_stores or self.tier_loads)


@dataclass(frozen=True)
class WorkerCounters:
    prompt_tokens_computed: int = 0
    tokens_decoded: int = 0
    kv_blocks_sent: int = 0
    kv_blocks_received: int = 0
    steps: int = 0
    spec_drafts: int = 0            # decode rows that verified at least one draft token
    spec_draft_tokens: int = 0
    spec_accepted_tokens: int = 0
    spec_accepted_per_pos: tuple[int, ...] = ()  # accepted drafts at position 0, 1, ...
    kv_frames_rejected: int = 0     # KV frames refused on arrival: bad header, tag or digest
    tier_blocks_stored: int = 0     # blocks copied to the second KV tier
    tier_blocks_loaded: int = 0     # ... and back into the cache
    # bytes of KV each rank pushed to peers (one entry for a worker, one per rank for a group:
    # every rank sends its own heads and layers, none gathers the others')
    kv_bytes_sent_per_rank: tuple[int, ...] = ()


@dataclass(frozen=True)
class SampledToken:
    request_id: str
    token_id: int
    logprobs: TokenLogprobs | None = None


@dataclass(frozen=True)
class PromptLogprobs:
    """Logprobs of prompt tokens start, start + 1, ... (start >= 1), each from the logits of
    the position before it: what one prefill chunk of a request asking for them scores."""
    request_id: str
    start: int
    logprobs: tuple[TokenLogprobs, ...]


@dataclass(frozen=True)
class RequestError:
    request_id: str
    error: str


@dataclass(frozen=True)
class StepResult:
    step_id: int
    sampled: tuple[SampledToken, ...] = ()
    errors: tuple[RequestError, ...] = ()
    counters: WorkerCounters = WorkerCounters()
    prompt_logprobs: tuple[PromptLogprobs, ...] = ()
    more: bool = False  # a multi-step plan: more results of this step follow


@dataclass(frozen=True)
class TransferDone:
    transfer_id: str
    error: str = ""  # non-empty: failed


@dataclass(frozen=True)
class TransfersDone:
    done: tuple[TransferDone, ...] = ()
    counters: WorkerCounters = WorkerCounters()
