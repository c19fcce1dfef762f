"""Samples of one prompt (n > 1). The leader prefills the prompt once; each fork samples its
first token from the leader's last prefill logits, then joins the leader's decode worker on the
leader's prompt blocks: the full ones shared (one more reference each), the partial last one
copied by the worker before its next forward (copy-on-write: the fork's first token differs).

    leader PREFILLING ──first tokens──> forks: one token each, still FORKING
    leader's KV on decode worker d ──> each fork: shares + copy on d, TRANSFERRING -> arrival

A leader that goes away before its forks have their KV detaches them: each is queued on its own
and recomputed from prompt + its token."""
from __future__ import annotations

from collections.abc import Callable

from common.plans import BlockCopy
from services.scheduler.kv_cache_manager import NoFreeBlocks
from services.scheduler.request import Request, Status
from services.scheduler.request_queue import RequestQueue
from services.scheduler.worker_state import WorkerState


class Forks:
    def __init__(self, waiting: RequestQueue, requeue: Callable[[Request], None]):
        self.waiting = waiting
        self._requeue = requeue

    def join(self, d: WorkerState, leader: Request, fork: Request) -> None:
        """The fork joins d's batch on its leader's prompt blocks, or, with no block free for
        its copy, goes back to the queue on its own."""
        leader.forks.remove(fork)
        fork.leader = None
        n = len(leader.prompt_token_ids)
        try:
            copy = d.kv.fork(fork.request_id, leader.request_id, n)
        except NoFreeBlocks:
            self._requeue(fork)
            return
        if copy is not None:
            d.kv.hold([copy[0]])  # the leader may free it before the copy runs
            d.copies.append(BlockCopy(src=copy[0], dst=copy[1], request_id=fork.request_id,
                                      leader_id=leader.request_id))
        fork.status = Status.TRANSFERRING
        fork.prefill_worker = fork.decode_worker = d.worker_id
        fork.num_computed_tokens = n
        fork.block_hashes = leader.block_hashes[:n // d.kv.block_size]
        d.arrivals.append(fork)

    def detach(self, leader: Request) -> None:
        """The leader will not give its forks KV any more: each goes its own way."""
        for fork in leader.forks:
            fork.leader = None
            fork.status = Status.WAITING
            self.waiting.push_front(fork)
        leader.forks = []

    @staticmethod
    def takes_first_token(fork: Request, leader_current: bool) -> bool:
        """Whether a token sampled for fork (from its leader's logits) counts: its first, from
        a leader still prefilling on the worker that sampled it."""
        leader = fork.leader
        return (leader is not None and not fork.output_token_ids and leader_current
                and leader.status is Status.PREFILLING)
