"""The scheduler's view of one worker, and of one KV transfer between two workers."""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from protos import worker_pb2
from services.scheduler.kv_cache_manager import KVCacheManager
from services.scheduler.request import Request


@dataclass(eq=False)
class WorkerState:
    """The scheduler's view of one worker."""
    worker_id: str
    role: str
    endpoint: str
    fingerprint: str
    layout: worker_pb2.KVLayout
    max_model_len: int
    transports: tuple[str, ...]
    kv: KVCacheManager
    host_id: str = ""
    endpoints: dict[str, str] = field(default_factory=dict)  # transport -> address
    prefilling: list[Request] = field(default_factory=list)
    decoding: list[Request] = field(default_factory=list)
    arrivals: list[Request] = field(default_factory=list)  # KV landed, not yet sent to the worker
    known: set[str] = field(default_factory=set)           # requests whose state the worker holds
    to_drop: list[str] = field(default_factory=list)
    recvs: list[worker_pb2.KVRecv] = field(default_factory=list)
    steps: deque[Step] = field(default_factory=deque)     # planned, result not in yet; oldest first
    copies: list[BlockCopy] = field(default_factory=list)  # for its next plan
    counters: worker_pb2.WorkerCounters = field(default_factory=worker_pb2.WorkerCounters)

    @property
    def is_idle(self) -> bool:
        return not self.steps

    def last_step_with(self, request_id: str) -> Step | None:
        return next((s for s in reversed(self.steps) if request_id in s.request_ids), None)


@dataclass(eq=False)
class Step:
    """A plan sent to a worker whose result has not arrived yet."""
    step_id: int
    request_ids: set[str] = field(default_factory=set)   # scheduled in it
    frees: list[list[int]] = field(default_factory=list)  # blocks it uses that nothing else holds
    recvs: list[str] = field(default_factory=list)        # transfer ids it registers
    decodes_only: bool = False  # one decode token per request and nothing else: the next step
                                # may be planned while it runs


@dataclass(frozen=True)
class BlockCopy:
    """A fork's copy of its leader's partial block, on one worker. The scheduler holds a
    reference to src until the step that copies it has run."""
    fork_id: str
    leader_id: str
    src: int
    dst: int


@dataclass(eq=False)
class Transfer:
    request: Request
    src: WorkerState
    dst: WorkerState
    transport: str = ""
    skip: int = 0            # leading blocks the receiver has cached: they do not travel
    computed: bool = False   # the sender's step computing the last chunk is planned
    receiver_ready: bool = False  # the receiver ran the step that registered the expectation
    ordered: bool = False    # the send is in a plan: blocks on both sides are in use until done
    cancelled: bool = False  # its request moved on; only the blocks below still wait for done
    frees: list[tuple[WorkerState, list[int]]] = field(default_factory=list)


SAME_HOST_TRANSPORTS = ("shm", "cuda_ipc")


def transport_between(src: WorkerState, dst: WorkerState) -> str:
    """The sender's first preference that the receiver offers; shm and cuda_ipc only on one
    host."""
    same_host = src.host_id == dst.host_id
    return next((t for t in src.transports if t in dst.transports
                 and (same_host or t not in SAME_HOST_TRANSPORTS)), "")
