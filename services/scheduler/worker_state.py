"""The scheduler's view of one worker, of one step it runs, and of one KV transfer between two
workers."""
from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass, field

from common.kv_layout import KVLayout
from common.plans import BlockCopy, Fork, KVRecv, NewRequest, StepPlan, WorkerCounters
from services.scheduler.kv_cache_manager import KVCacheManager
from services.scheduler.request import Request

SAME_HOST_TRANSPORTS = ("shm", "cuda_ipc")
SPEED_SMOOTHING = 0.2  # weight of the newest step in a worker's measured prefill speed
MIN_TIMED_PREFILL = 16  # prompt tokens a step computes for its time to measure its worker's
                        # prefill speed (fewer: its decodes would be most of that time)


# the prompt tokens a decode worker's held speed is measured over (PrefillSpeed.horizon_tokens):
# about a long prompt's
HELD_SPEED_TOKENS = 4096


def smoothed(old: float, sample: float) -> float:
    """The newest sample folded into a measure smoothed over steps (0: none yet)."""
    return sample if not old else SPEED_SMOOTHING * sample + (1 - SPEED_SMOOTHING) * old


@dataclass
class PrefillSpeed:
    """Seconds per prompt token of a worker's steps that prefill, from the plan leaving the
    scheduler to its result coming back, smoothed over steps; 0 until one is measured. On a
    decode worker it includes the batch decoded beside the chunk: what a prompt costs there.
    Also kept per thread count of the steps (0: threads not managed, cores.py), from the steps
    that ran on that many (`threads` None: one that did not).

    With horizon_tokens, the seconds over the tokens of about the last that many prompt tokens
    instead (each step's weight decays by e^(-tokens / horizon_tokens) per step after it, as
    many tokens as later steps computed): each step weighs as much as its tokens, so that a
    step of a few tokens beside a batch (whose cost each step pays alike) weighs as little as
    it computes."""
    seconds_per_token: float = 0.0
    by_threads: dict[int, float] = field(default_factory=dict)
    horizon_tokens: int = 0
    # thread count (None: all steps) -> (decayed seconds, decayed tokens), with horizon_tokens
    _sums: dict[int | None, tuple[float, float]] = field(default_factory=dict, repr=False)

    def observe(self, tokens: int, seconds: float, threads: int | None = 0) -> None:
        if seconds <= 0:
            return
        self.seconds_per_token = self._fold(None, self.seconds_per_token, tokens, seconds)
        if threads is not None:
            self.by_threads[threads] = self._fold(threads, self.by_threads.get(threads, 0.0),
                                                  tokens, seconds)

    def _fold(self, key: int | None, per_token: float, tokens: int, seconds: float) -> float:
        """A step of `tokens` in `seconds` folded into the speed `per_token` (0: none yet)."""
        if not self.horizon_tokens:
            return smoothed(per_token, seconds / tokens)
        # a speed set without its sums counts as one step of as many tokens
        total_s, total_n = self._sums.get(key) or (per_token * tokens, tokens if per_token else 0)
        keep = math.exp(-tokens / self.horizon_tokens)
        total_s, total_n = keep * total_s + seconds, keep * total_n + tokens
        self._sums[key] = (total_s, total_n)
        return total_s / total_n

    def seconds(self, tokens: int) -> float:
        return tokens * self.seconds_per_token

    def on(self, threads: int) -> float:
        """Seconds per token of its steps on `threads` threads; over all its steps before
        one on as many is measured."""
        return self.by_threads.get(threads) or self.seconds_per_token


@dataclass(eq=False)
class WorkerState:
    worker_id: str
    role: str                       # "prefill" or "decode"
    fingerprint: str
    layout: KVLayout
    max_model_len: int
    transports: tuple[str, ...]     # preferred first
    kv: KVCacheManager
    host_id: str = ""
    tier_id: str = ""  # a second KV tier it shares with its host's workers; "": none or its own
    cpu_cores: tuple[int, ...] = ()  # a CPU worker's cores; peers of its host may share them
    num_speculative_tokens: int = 0  # drafts it verifies per decode step: lookahead slots
    endpoints: dict[str, str] = field(default_factory=dict)  # transport -> address
    prefilling: list[Request] = field(default_factory=list)
    decoding: list[Request] = field(default_factory=list)
    arrivals: list[Request] = field(default_factory=list)  # KV landed, not yet sent to the worker
    known: set[str] = field(default_factory=set)           # requests whose state the worker holds
    to_drop: list[str] = field(default_factory=list)       # for its next plan
    recvs: list[KVRecv] = field(default_factory=list)      # for its next plan
    copies: list[BlockCopy] = field(default_factory=list)  # for its next plan
    steps: deque[Step] = field(default_factory=deque)     # planned, result not in yet; oldest first
    counters: WorkerCounters = WorkerCounters()
    prefill_speed: PrefillSpeed = field(default_factory=PrefillSpeed)
    # ... of a decode worker's steps beside a long prompt it holds (`Step.held`), over about a
    # long prompt's tokens: the pace of a whole hold, from the prompt's first tokens to its
    # last. A token's attention grows with its context, and a step's batch costs it the same
    # time whatever its prompt tokens, so the last steps of a hold carry the fewest: a speed
    # smoothed over steps gave the pace of a hold's end to the whole of the next
    held_speed: PrefillSpeed = field(
        default_factory=lambda: PrefillSpeed(horizon_tokens=HELD_SPEED_TOKENS))
    leaving: bool = False  # it asked to leave: nothing new goes to it (Workers.of_role)
    # a decode worker holding a long prompt: the prompt tokens of its next step by the threads
    # that step runs on (0: a worker whose threads are not managed), sized from the time of the
    # last such step on as many threads (none yet: --decode-long-prefill-tokens)
    held_step_tokens: dict[int, int] = field(default_factory=dict)
    decode_step_seconds: float = 0.0  # a decode-only step's time, smoothed over steps; 0: none
    computed_at: float = 0.0  # the scheduler's clock when its last step of requests answered

    def step_answered(self, step: Step, now: float) -> None:
        """Times a decode-only step: from its plan leaving, or from the answer before when it
        was planned ahead of that one (it ran after it), to its answer."""
        if step.decodes_only:
            seconds = now - max(step.planned_at, self.computed_at)
            if seconds > 0:
                self.decode_step_seconds = smoothed(self.decode_step_seconds, seconds)
        if step.request_ids:
            self.computed_at = now

    @property
    def computes(self) -> bool:
        """Whether a step of requests runs (steps that only register or send transfers do
        not count)."""
        return any(s.request_ids for s in self.steps)

    @property
    def is_idle(self) -> bool:
        return not self.steps

    @property
    def endpoint(self) -> str:
        """Where peers reach it over its preferred transport."""
        return self.endpoints.get(self.transports[0], "") if self.transports else ""

    @property
    def num_seqs(self) -> int:
        """Requests holding blocks here."""
        return len(self.kv.request_ids())

    def last_step_with(self, request_id: str) -> Step | None:
        return next((s for s in reversed(self.steps) if request_id in s.request_ids), None)

    def cache(self, req: Request, num_computed: int) -> None:
        """Full blocks whose KV a step computes become prefix-cache hits for later steps of the
        same worker (its steps run in order)."""
        bs = self.kv.block_size
        if num_computed >= (self.kv.num_registered(req.request_id) + 1) * bs:
            self.kv.cache_blocks(req.request_id, req.hashes(bs), num_computed)

    def introduce(self, plan: StepPlan, req: Request, kv_transfer_id: str = "") -> None:
        """The request in full, the first time this worker sees it (its blocks filled by
        `kv_transfer_id` when given); its forks sample their first token with it."""
        forks = () if req.output_token_ids else tuple(Fork(f.request_id, f.sampling)
                                                      for f in req.forks)
        plan.new_requests.append(NewRequest(
            request_id=req.request_id, all_token_ids=tuple(req.all_token_ids),
            num_prompt_tokens=len(req.prompt_token_ids),
            num_computed_tokens=req.num_tokens - 1 if kv_transfer_id else req.num_computed_tokens,
            block_ids=tuple(self.kv.get_block_ids(req.request_id)), sampling=req.sampling,
            eos_token_ids=tuple(req.eos_token_ids), kv_transfer_id=kv_transfer_id, forks=forks))
        self.known.add(req.request_id)


@dataclass(eq=False)
class Step:
    """A plan sent to a worker whose result has not arrived yet. Blocks it uses that nothing
    else holds are released when it is done (`step_event`)."""
    step_id: int
    request_ids: set[str] = field(default_factory=set)   # scheduled in it
    recvs: list[str] = field(default_factory=list)        # transfer ids it registers
    decodes_only: bool = False  # one decode token per request and nothing else: the next step
                                # may be planned while it runs
    prefill_tokens: int = 0     # prompt tokens it computes
    planned_at: float = 0.0     # the scheduler's clock when its plan left; its worker was
                                # idle then
    held: bool = False          # a decode worker's step beside a long prompt it holds
    threads: int = 0            # the threads its plan runs on (0: the worker's own choice)
    lookahead: dict[str, int] = field(default_factory=dict)  # request id -> its draft slots:
                                # the step may add up to that many tokens more than one


@dataclass(eq=False)
class Transfer:
    """A request's KV on its way from src to dst. Once ordered, blocks on both sides are in use
    until the sender reports it done (`transfer_event`)."""
    transfer_id: str
    request: Request
    src: WorkerState
    dst: WorkerState
    transport: str
    skip: int = 0            # leading blocks the receiver has (cached, or loads from its
                             # second tier): they do not travel
    computed: bool = False   # the sender's step computing the last chunk is planned
    receiver_ready: bool = False  # the receiver ran the step that registered the expectation
    ordered: bool = False    # the send is in a plan
    cancelled: bool = False  # its request moved on; only blocks still wait for the done
    # a prefix fill (Transfers.open_fill): no request moves; the blocks of the request's prompt
    # the sender computed go into the receiver's prefix cache under these hashes, from these
    # blocks of the sender's, which the fill holds until it is done
    fill: tuple[bytes, ...] = ()
    src_block_ids: tuple[int, ...] = ()


def step_event(step_id: int) -> tuple[str, int]:
    return ("step", step_id)


def transfer_event(transfer_id: str) -> tuple[str, str]:
    return ("transfer", transfer_id)


def transport_between(src: WorkerState, dst: WorkerState) -> str:
    """The sender's first preference that the receiver offers; shm and cuda_ipc only on one
    host."""
    same_host = src.host_id == dst.host_id
    return next((t for t in src.transports if t in dst.transports
                 and (same_host or t not in SAME_HOST_TRANSPORTS)), "")
