"""The scheduler: composes the managers and moves requests between them. Plain synchronous code:
no asyncio, no gRPC, no protobuf. server.py calls `schedule(worker_id)` when a worker is idle,
`schedule_ahead(worker_id)` while its decode step runs, `update(worker_id, result)` when a step's
result arrives and `transfers_done(worker_id, msg)` when its KV sends end.

    workers.py    who may join, who is there          prefill.py    admission, chunks, placement
    decode.py     the running batch, preemption,      transfers.py  KV sends: order, done, failed
                  the step planned ahead              forks.py      samples sharing one prompt
    lifecycle.py  tokens out, finish, re-queue, and release from every worker
    kv_cache_manager.py  blocks per request, prefix cache, releases after a step or transfer

A disaggregated request moves  WAITING -> PREFILLING (on P) -> TRANSFERRING -> DECODING (on D)
-> FINISHED; without prefill workers it goes WAITING -> PREFILLING (on D) -> DECODING (on D).
Preemption, transfer failures and lost workers send it back to WAITING with prompt + tokens so
far, to be recomputed; tokens already streamed are never sent again.
"""
from __future__ import annotations

import itertools
import logging
import time
from collections.abc import Callable, Sequence

from common.plans import Registration, SampledToken, StepPlan, StepResult, TransfersDone
from services.scheduler.config import SchedulerConfig
from services.scheduler.cores import shares_cores, threads_for
from services.scheduler.decode import Decode
from services.scheduler.forks import Forks
from services.scheduler.lifecycle import Lifecycle, QueueFull
from services.scheduler.placement import create_placement
from services.scheduler.prefill import Prefill
from services.scheduler.request import Output, Request, Status
from services.scheduler.request_queue import create_request_queue
from services.scheduler.transfers import Transfers
from services.scheduler.worker_state import MIN_TIMED_PREFILL, Step, WorkerState, step_event
from services.scheduler.workers import RegistrationError, Workers

log = logging.getLogger(__name__)

__all__ = ["ProtocolError", "QueueFull", "RegistrationError", "Scheduler"]  # server.py catches


class ProtocolError(ValueError):
    """A worker's answer that cannot be the answer to its step: nothing of it is applied, and
    the worker is dropped (its requests are recomputed elsewhere)."""


MAX_TOKEN_ID = 2 ** 31 - 1


def _check_result(step: Step, result: StepResult, requests: dict[str, Request]) -> None:
    """Raises ProtocolError unless token ids are ids, no request of the step got more tokens
    than the step may add (1 + its draft slots) and prompt logprobs start past the first token.
    (Tokens and errors of requests the step did not run are ignored, as answers about requests
    that moved on since: a fork's first token comes with its leader's step.)"""
    per_request: dict[str, int] = {}
    for s in result.sampled:
        if not 0 <= s.token_id <= MAX_TOKEN_ID:
            raise ProtocolError(f"step {step.step_id}: token id {s.token_id}")
        per_request[s.request_id] = per_request.get(s.request_id, 0) + 1
    for rid, n in per_request.items():
        most = 1 + step.lookahead.get(rid, 0)
        if rid in step.request_ids and n > most:
            raise ProtocolError(f"step {step.step_id}: {n} tokens for {rid!r}, at most {most} "
                                "possible")
    for p in result.prompt_logprobs:
        if p.start < 1:
            raise ProtocolError(f"step {step.step_id}: prompt logprobs of {p.request_id!r} "
                                f"from position {p.start}")
        req = requests.get(p.request_id)
        if p.request_id in step.request_ids and req is not None and req.scores_prompt:
            scored, total = len(req.prompt_logprobs), len(req.prompt_token_ids) - 1
            if p.start != scored + 1 or scored + len(p.logprobs) > total:
                raise ProtocolError(f"step {step.step_id}: prompt logprobs of {p.request_id!r} "
                                    f"from position {p.start}, {len(p.logprobs)} of them, "
                                    f"{scored} of {total} scored so far")


class Scheduler:
    def __init__(self, config: SchedulerConfig, clock: Callable[[], float] = time.monotonic):
        self.config = config
        self.clock = clock  # times steps: each worker's prefill speed (WorkerState.prefill_speed)
        self.workers = Workers(config)
        self.requests: dict[str, Request] = {}
        self.waiting = create_request_queue(config.scheduling_policy)
        self.lifecycle = life = Lifecycle(self.requests, self.waiting, self.workers)
        self.transfers = life.transfers = Transfers(requeue=life.requeue, land=self._land)
        self.forks = life.forks = Forks(self.waiting, requeue=life.requeue)
        self._ids = itertools.count()
        self.prefill = Prefill(config, self.workers, self.waiting, self.transfers,
                               create_placement(config.placement), lambda: next(self._ids),
                               requeue=life.requeue, clock=clock, threads=self._threads)
        self.decode = Decode(preempt=life.preempt,
                             max_model_len=lambda: self.workers.max_model_len,
                             next_id=lambda: next(self._ids))

    @property
    def num_finished(self) -> int:
        return self.lifecycle.num_finished

    @property
    def num_preemptions(self) -> int:
        return self.lifecycle.num_preemptions

    @property
    def num_long_prefills_on_decode(self) -> int:
        """Long prompts a decode worker took while every prefill worker was busy."""
        return self.prefill.num_long_on_decode

    @property
    def num_long_prefills_left(self) -> int:
        """Long prompts a decode worker would have taken but left to a prefill worker: its
        batch would have lost more than they gained (Prefill._hold_pays)."""
        return self.prefill.num_long_left

    @property
    def num_long_prefills_taken_back(self) -> int:
        """Of those, the ones a prefill worker took back (it would finish them sooner)."""
        return self.prefill.num_long_taken_back

    # ---- workers and requests ------------------------------------------------------------------

    def add_worker(self, reg: Registration) -> WorkerState:
        return self.workers.join(reg)

    def remove_worker(self, worker_id: str) -> None:
        """The worker is gone: everything that touched it is recomputed elsewhere."""
        w = self.workers.leave(worker_id)
        if w is None:
            return
        w.kv.close()
        self.transfers.sender_lost(w)
        self.transfers.receiver_lost(w)
        lost = [r for r in self.requests.values()
                if worker_id in (r.prefill_worker, r.decode_worker)]
        for req in lost:
            self.lifecycle.requeue(req)
        if lost:
            log.warning("worker %s left; its %d requests were re-queued", worker_id, len(lost))
        else:
            log.info("worker %s left", worker_id)

    def drain_worker(self, worker_id: str) -> None:
        """The worker leaves: nothing new goes to it, what it runs finishes (`drained`)."""
        w = self.workers.get(worker_id)
        if w is not None and not w.leaving:
            w.leaving = True
            log.info("worker %s leaves once its %d requests finished", worker_id,
                     len(w.kv.request_ids()))

    def drained(self, worker_id: str) -> bool:
        """A leaving worker that holds and runs no request any more (its stream may end)."""
        w = self.workers.get(worker_id)
        return w is not None and w.leaving and w.is_idle and not (
            w.kv.request_ids() or w.known or w.to_drop or w.recvs or w.copies or w.arrivals
            or w.prefilling or w.decoding)

    @property
    def max_model_len(self) -> int:
        return self.workers.max_model_len

    def add_request(self, req: Request, forks: Sequence[Request] = (),
                    resumed: bool = False) -> None:
        """Raises ValueError for a request that can never run, QueueFull when the queue is at its
        limit (not for one `resumed` from a lost scheduler: its client streams already). forks:
        more samples of req's prompt (n > 1), prefilled once with it and sharing its prompt's
        blocks."""
        self.lifecycle.add(req, forks, 0 if resumed else self.config.max_waiting_requests)
        self.prefill.arrived(req)

    def abort(self, request_id: str) -> Output | None:
        req = self.requests.get(request_id)
        return None if req is None else self.lifecycle.finish(req, "abort")

    @property
    def num_running(self) -> int:
        return self.lifecycle.num_running

    # ---- planning ------------------------------------------------------------------------------

    def has_work(self, worker_id: str) -> bool:
        w = self.workers.get(worker_id)
        if w is None or not w.is_idle:
            return False
        return bool(w.to_drop or w.recvs or w.prefilling or w.decoding or w.arrivals or w.copies
                    or w.kv.has_tier_copies or (len(self.waiting) and self.prefill.admits(w))
                    or self.transfers.sendable(w) or self.prefill.to_take_back(w) is not None)

    def schedule(self, worker_id: str) -> StepPlan | None:
        w = self.workers[worker_id]
        assert w.is_idle, f"worker {worker_id} already runs a step"
        plan = StepPlan(step_id=next(self._ids))
        budget = self.config.max_num_batched_tokens
        for t in self.transfers.sendable(w):
            self.transfers.order(plan, t)
        if w.role == "decode":
            budget -= self.decode.schedule(w, plan)
            if self.workers.has_prefill:  # its prefills are lent cycles: bounded per step
                budget = min(budget, self.config.decode_prefill_tokens)
        held = self.prefill.schedule(w, plan, budget)
        # last: planning above may preempt; the worker drops before it adds
        plan.finished_request_ids.extend(w.to_drop)
        plan.recvs.extend(w.recvs)
        plan.copies.extend(w.copies)
        for c in w.copies:
            w.kv.release([c.src], after=step_event(plan.step_id))
        step = Step(plan.step_id, recvs=[r.transfer_id for r in w.recvs])
        w.copies.clear()
        w.to_drop.clear()
        w.recvs.clear()
        self._tier_copies(w, plan, ahead=False)  # a plan may carry nothing else
        if plan.is_empty():
            return None
        plan.cached_blocks.extend(w.kv.take_announcements())
        plan.num_threads = self._threads(w)
        step.request_ids = {s.request_id for s in plan.scheduled}
        step.lookahead = {s.request_id: s.num_lookahead for s in plan.scheduled
                          if s.num_lookahead}
        step.prefill_tokens = sum(s.num_tokens for s in plan.scheduled
                                  if self.requests[s.request_id].status is Status.PREFILLING)
        step.planned_at = self.clock()
        step.held = held
        step.threads = plan.num_threads
        step.decodes_only = bool(
            plan.scheduled and not (plan.new_requests or plan.sends or plan.recvs or plan.copies)
            and all(s.num_tokens == 1 for s in plan.scheduled)
            and all(self.requests[s.request_id].status is Status.DECODING
                    for s in plan.scheduled))
        w.steps.append(step)
        if step.decodes_only and self._multi_step(w):
            self.decode.more_steps(w, plan, step, self.config.num_scheduler_steps, ahead=False)
        self._tier_copies(w, plan)
        return plan

    def _multi_step(self, w: WorkerState) -> bool:
        """Whether w's decode-only plans run several steps (not on a worker that speculates:
        its steps add several tokens already)."""
        return self.config.num_scheduler_steps > 1 and not w.num_speculative_tokens

    def schedule_ahead(self, worker_id: str) -> StepPlan | None:
        """The next decode step of a worker whose running step only decodes, planned before
        that step's result arrives (Decode.plan_ahead); anything else the worker has to do
        waits for a plan made once it is idle. None when that cannot be."""
        w = self.workers.get(worker_id)
        if not self.config.async_scheduling or w is None or len(w.steps) != 1 or \
                not w.steps[0].decodes_only or self._has_other_work(w):
            return None
        plan = self.decode.plan_ahead(w)
        if plan is not None:
            if self._multi_step(w):
                self.decode.more_steps(w, plan, w.steps[-1], self.config.num_scheduler_steps,
                                       ahead=True)
            plan.cached_blocks.extend(w.kv.take_announcements())
            plan.num_threads = self._threads(w)
            self._tier_copies(w, plan)
        return plan

    def _tier_copies(self, w: WorkerState, plan: StepPlan, ahead: bool = True) -> None:
        """The tier stores and loads planning w's steps (and transfers into w) made so far:
        they go with this plan, which runs them before anything else; and, `ahead`, the
        stores ahead of the blocks a step's allocations would evict next, which it runs beside
        its forward."""
        stores, loads, early = w.kv.take_tier_copies(
            step_event(plan.step_id),
            ahead=-(-self.config.max_num_batched_tokens // w.kv.block_size) if ahead else 0)
        plan.tier_stores.extend(stores)
        plan.tier_loads.extend(loads)
        plan.tier_stores_ahead.extend(early)

    def _threads(self, w: WorkerState) -> int:
        """Threads for w's step, from the cores it shares with busy peers (cores.py)."""
        return threads_for(w, self.workers.values(), self._computes)

    def _crowded(self, w: WorkerState, step: Step) -> bool:
        """Whether w's step, planned on all its cores, shared them with a peer's step of
        requests after all (one running, or answered since it was planned): its time then says
        little of its pace on that many threads."""
        if not w.cpu_cores or step.threads < len(w.cpu_cores):
            return False
        return any(shares_cores(w, x) and (x.computes or x.computed_at > step.planned_at)
                   for x in self.workers.values())

    def _computes(self, w: WorkerState) -> bool:
        """Whether w computes tokens now or has tokens to compute: a step of requests running,
        a batch to decode, a prefill under way. Steps that only register or send transfers do
        not count, nor prompts waiting for room on a decode worker."""
        return bool(w.computes or w.decoding or w.arrivals or self.prefill.has_partial(w))

    def _has_other_work(self, w: WorkerState) -> bool:
        """Whether w has something to do besides decoding its running batch."""
        room = w.kv.num_free_blocks > 0 and w.num_seqs < self.config.max_num_seqs
        return bool(w.to_drop or w.recvs or w.arrivals or w.copies or self.transfers.sendable(w)
                    or self.prefill.has_partial(w)
                    or (room and len(self.waiting) and self.prefill.admits(w)))

    # ---- results -------------------------------------------------------------------------------

    def update(self, worker_id: str, result: StepResult) -> list[Output]:
        w = self.workers.get(worker_id)
        if w is None:
            return []
        if not w.steps or w.steps[0].step_id != result.step_id:
            raise ProtocolError(f"worker {worker_id} answered step {result.step_id}, not the "
                                "oldest it runs")
        _check_result(w.steps[0], result, self.requests)  # before anything changes
        # a plan of several decode steps answers after each: it runs until its last answer
        step = w.steps[0] if result.more else w.steps.popleft()
        if step.prefill_tokens >= MIN_TIMED_PREFILL:  # fewer (a last chunk) say little
            seconds = self.clock() - step.planned_at
            threads = None if self._crowded(w, step) else step.threads
            w.prefill_speed.observe(step.prefill_tokens, seconds, threads)
            if step.held:
                w.held_speed.observe(step.prefill_tokens, seconds, threads)
                self.prefill.held_step_timed(w, step.threads, step.prefill_tokens, seconds)
        w.step_answered(step, self.clock())
        ran = step.request_ids
        w.counters = result.counters
        self.transfers.receivers_ready(step.recvs)
        outputs: list[Output] = []
        for err in result.errors:
            req = self._current(w, err.request_id, ran)
            if req is not None:
                outputs.append(self.lifecycle.finish(req, "error", error=err.error))
        for p in result.prompt_logprobs:  # before the tokens: the first one takes them along
            req = self._current(w, p.request_id, ran)
            if req is not None and req.scores_prompt:
                req.add_prompt_logprobs(p.start, p.logprobs)
        # a request's tokens of this step in order (several where it verified drafts)
        tokens: dict[str, list[SampledToken]] = {}
        for s in result.sampled:
            tokens.setdefault(s.request_id, []).append(s)
        # forks first: they fork from their leader's blocks, which its own token may release
        forks = {rid for rid in tokens
                 if (r := self.requests.get(rid)) is not None and r.status is Status.FORKING}
        for rid in sorted(tokens, key=lambda rid: rid not in forks):
            if rid in forks:
                out = self._on_fork_token(w, self.requests[rid], tokens[rid][0], ran)
            else:
                req = self._current(w, rid, ran)
                out = self._on_tokens(w, req, tokens[rid]) if req is not None else None
            if out is not None:
                outputs.append(out)
        if not result.more:
            w.kv.done(step_event(step.step_id))
        return outputs

    def _current(self, w: WorkerState, rid: str, ran: set[str]) -> Request | None:
        """The request, if w's step result about it still matters (not finished, not moved)."""
        req = self.requests.get(rid)
        if req is None or rid not in ran or req.status not in (Status.PREFILLING, Status.DECODING):
            return None
        worker = req.prefill_worker if req.status is Status.PREFILLING else req.decode_worker
        return req if worker == w.worker_id else None

    def _on_tokens(self, w: WorkerState, req: Request, tokens: list[SampledToken]) -> Output:
        first = not req.output_token_ids
        if first:
            req.first_token_at = self.clock()
        if req.status is Status.PREFILLING and req.transfer_id:
            req.status = Status.TRANSFERRING
        elif req.status is Status.PREFILLING:  # prefilled by its decode worker itself
            w.prefilling.remove(req)
            w.decoding.append(req)
            req.status = Status.DECODING
        return self.lifecycle.emit(req, tokens, len(req.prompt_token_ids) if first else 0)

    def _on_fork_token(self, w: WorkerState, fork: Request, s: SampledToken,
                       ran: set[str]) -> Output | None:
        """A fork's first token, sampled from its leader's last prefill logits on w."""
        leader = fork.leader
        current = leader is not None and self._current(w, leader.request_id, ran) is leader
        if leader is None or not self.forks.takes_first_token(fork, current):
            return None  # sampled for a leader that moved on since
        fork.num_cached_tokens = leader.num_cached_tokens
        fork.first_token_at = self.clock()
        if fork.scores_prompt:  # the leader scored the prompt they share
            fork.prompt_logprobs = list(leader.prompt_logprobs)
        out = self.lifecycle.emit(fork, [s], len(fork.prompt_token_ids))
        if not out.finish_reason and not leader.transfer_id:
            self.forks.join(w, leader, fork)  # prefilled on its decode worker: its KV is here
        return out

    def transfers_done(self, worker_id: str, msg: TransfersDone) -> None:
        w = self.workers.get(worker_id)
        if w is None:
            return
        w.counters = msg.counters
        for done in msg.done:
            self.transfers.done(w, done)

    def _land(self, req: Request, src: WorkerState, dst: WorkerState) -> None:
        """req's KV is on its decode worker: it joins dst's batch next plan, and so do its
        forks, on its blocks."""
        src.kv.free(req.request_id)
        src.prefilling.remove(req)
        src.known.discard(req.request_id)
        src.to_drop.append(req.request_id)
        req.prefill_worker = dst.worker_id
        dst.arrivals.append(req)
        for fork in list(req.forks):
            self.forks.join(dst, req, fork)
