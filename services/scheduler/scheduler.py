"""Scheduling policy: admission, placement, step plans, stop detection, recovery.

Plain synchronous code: no asyncio, no gRPC. server.py calls `schedule(worker_id)` when a worker
is idle and `update(worker_id, result)` when its step result arrives.

A disaggregated request moves  WAITING -> PREFILLING (on P) -> TRANSFERRING -> DECODING (on D)
-> FINISHED; without prefill workers it goes WAITING -> PREFILLING (on D) -> DECODING (on D).
Preemption, transfer failures and lost workers send it back to WAITING with prompt + tokens so
far, to be recomputed; tokens already streamed are never sent again.
"""
from __future__ import annotations

import itertools
import logging
from collections.abc import Sequence

from services.scheduler.block_hash import extend_block_hashes
from services.scheduler.config import SchedulerConfig
from services.scheduler.kv_cache_manager import KVCacheManager, NoFreeBlocks
from services.scheduler.placement import create_placement
from services.scheduler.request import Output, Request, Status
from services.scheduler.request_queue import create_request_queue
from services.scheduler.prefill_planning import ADMISSION_LOOKAHEAD, PrefillPlanning
from services.scheduler.worker_state import (BlockCopy, Step, Transfer, WorkerState,
                                              transport_between)
from protos import worker_pb2

log = logging.getLogger(__name__)



class RegistrationError(Exception):
    """A worker that cannot join this deployment."""


class QueueFull(Exception):
    """The waiting queue is at --max-waiting-requests: retry later."""


class Scheduler(PrefillPlanning):
    def __init__(self, config: SchedulerConfig):
        self.config = config
        self.workers: dict[str, WorkerState] = {}
        self.requests: dict[str, Request] = {}
        self.waiting = create_request_queue(config.scheduling_policy)
        self.placement = create_placement(config.placement)
        self.transfers: dict[str, Transfer] = {}
        self.num_finished = 0
        self.num_preemptions = 0
        self._ids = itertools.count()

    # ---- workers -------------------------------------------------------------------------------

    def add_worker(self, reg: worker_pb2.Register) -> WorkerState:
        if reg.role not in ("prefill", "decode"):
            raise RegistrationError(f"unknown role {reg.role!r}; known: prefill, decode")
        if reg.worker_id in self.workers:
            raise RegistrationError(f"worker id {reg.worker_id} is already registered")
        if reg.num_blocks < 1 or reg.layout.block_size < 1:
            raise RegistrationError("a worker needs at least one KV block of size >= 1")
        for other in self.workers.values():
            if other.fingerprint != reg.model_fingerprint:
                raise RegistrationError(
                    f"model fingerprint {reg.model_fingerprint} differs from worker "
                    f"{other.worker_id}'s {other.fingerprint}: every worker must serve the same model")
            if other.layout != reg.layout:
                raise RegistrationError(
                    f"KV layout {_layout_str(reg.layout)} differs from worker {other.worker_id}'s "
                    f"{_layout_str(other.layout)}")
        if reg.role == "prefill" and self.config.mode == "colocated":
            raise RegistrationError("the scheduler runs --mode colocated: decode workers only")
        w = WorkerState(worker_id=reg.worker_id, role=reg.role, endpoint=reg.kv_endpoint,
                        fingerprint=reg.model_fingerprint, layout=reg.layout,
                        max_model_len=reg.max_model_len, transports=tuple(reg.transports),
                        host_id=reg.host_id,
                        endpoints=dict(reg.kv_endpoints) or {t: reg.kv_endpoint
                                                             for t in reg.transports},
                        kv=KVCacheManager(reg.num_blocks, reg.layout.block_size,
                                          self.config.enable_prefix_caching))
        for other in self.workers.values():
            if other.role != w.role:
                p, d = (w, other) if w.role == "prefill" else (other, w)
                if not transport_between(p, d):
                    raise RegistrationError(
                        f"no KV transport from prefill worker {p.worker_id} ({_offer(p)}) to "
                        f"decode worker {d.worker_id} ({_offer(d)}); shm works only within one "
                        "host id: offer tcp (or nccl) on both")
        self.workers[w.worker_id] = w
        log.info("worker %s joined: role=%s blocks=%d", w.worker_id, w.role, reg.num_blocks)
        return w

    def remove_worker(self, worker_id: str) -> None:
        """The worker is gone: everything that touched it is recomputed elsewhere."""
        w = self.workers.pop(worker_id, None)
        if w is None:
            return
        for t_id, t in list(self.transfers.items()):
            if t.src is not w:
                continue  # a live sender still reports its send done, which frees its blocks
            # a dead sender writes nothing more: the blocks its send held are free now
            for owner, blocks in t.frees:
                owner.kv.pool.free(blocks)
            t.frees.clear()
            t.ordered = False
            if t.cancelled:
                del self.transfers[t_id]
        for req in list(self.requests.values()):
            if worker_id in (req.prefill_worker, req.decode_worker):
                self._requeue(req)
        log.warning("worker %s left; its requests were re-queued", worker_id)

    @property
    def max_model_len(self) -> int:
        limits = [w.max_model_len for w in self.workers.values() if w.max_model_len > 0]
        if self.config.max_model_len:
            limits.append(self.config.max_model_len)
        return min(limits, default=1 << 30)

    # ---- requests ------------------------------------------------------------------------------

    def add_request(self, req: Request, forks: Sequence[Request] = ()) -> None:
        """Raises ValueError for a request that can never run. forks: more samples of req's
        prompt (n > 1), prefilled once with it and sharing its prompt's blocks."""
        ids = [req.request_id, *(f.request_id for f in forks)]
        for rid in ids:
            if rid in self.requests:
                raise ValueError(f"request id {rid} is already in use")
        if len(set(ids)) < len(ids):
            raise ValueError("the samples of a request need distinct request ids")
        assert all(f.prompt_token_ids == req.prompt_token_ids for f in forks)
        if not req.prompt_token_ids:
            raise ValueError("the prompt is empty")
        if req.max_tokens < 1:
            raise ValueError("max_tokens must be >= 1")
        total = len(req.prompt_token_ids) + req.max_tokens
        if total > self.max_model_len:
            raise ValueError(f"prompt ({len(req.prompt_token_ids)} tokens) + max_tokens "
                             f"({req.max_tokens}) exceeds the maximum model length "
                             f"{self.max_model_len}")
        decoders = [w for w in self.workers.values() if w.role == "decode"]
        if decoders and all(w.kv.blocks_for(total) > w.kv.num_blocks for w in decoders):
            raise ValueError(f"{total} tokens can never fit in a decode worker's KV cache")
        limit = self.config.max_waiting_requests
        if limit and len(self.waiting) >= limit:
            raise QueueFull(f"{len(self.waiting)} requests are waiting already (the limit is "
                            f"{limit}); retry later")
        self.requests[req.request_id] = req
        for f in forks:
            f.status, f.leader = Status.FORKING, req
            req.forks.append(f)
            self.requests[f.request_id] = f
        self.waiting.push(req)

    def abort(self, request_id: str) -> Output | None:
        req = self.requests.get(request_id)
        if req is None:
            return None
        return self._finish(req, "abort")

    @property
    def num_running(self) -> int:
        """Admitted requests (forks count once their first token is out)."""
        pending_forks = sum(r.status is Status.FORKING and not r.output_token_ids
                            for r in self.requests.values())
        return len(self.requests) - len(self.waiting) - pending_forks

    # ---- planning ------------------------------------------------------------------------------

    def has_work(self, worker_id: str) -> bool:
        w = self.workers.get(worker_id)
        if w is None or not w.is_idle:
            return False
        return bool(w.to_drop or w.recvs or w.prefilling or w.decoding or w.arrivals or w.copies
                    or (len(self.waiting) and self._admits(w)) or self._sendable(w))

    def _sendable(self, w: WorkerState) -> list[Transfer]:
        """Transfers w may start now: computed, and the receiver expects them."""
        return [t for t in self.transfers.values() if t.src is w and t.computed
                and t.receiver_ready and not t.ordered and not t.cancelled]

    def _admits(self, w: WorkerState) -> bool:
        """Whether w may take requests from the waiting queue."""
        has_prefill = any(p.role == "prefill" for p in self.workers.values())
        if w.role == "prefill":
            return any(d.role == "decode" for d in self.workers.values())
        return (not has_prefill or self.config.prefill_bypass_threshold > 0
                or self.config.saturated_prefill_bypass
                or any(r.prefill_locally for r in itertools.islice(self.waiting, self._lookahead)))

    @property
    def _lookahead(self) -> int:
        return self.config.max_num_partial_prefills + ADMISSION_LOOKAHEAD

    def schedule(self, worker_id: str) -> worker_pb2.StepPlan | None:
        w = self.workers[worker_id]
        assert w.is_idle, f"worker {worker_id} already runs a step"
        plan = worker_pb2.StepPlan(step_id=next(self._ids))
        step = Step(plan.step_id)
        budget = self.config.max_num_batched_tokens
        for t in self._sendable(w):
            self._order_send(plan, t)
        if w.role == "decode":
            budget -= self._schedule_decodes(w, plan)
        self._schedule_prefills(w, plan, budget)
        # last: planning above may preempt; the worker drops before it adds
        plan.finished_request_ids.extend(w.to_drop)
        plan.recvs.extend(w.recvs)
        for c in w.copies:
            plan.copies.add(src=c.src, dst=c.dst, request_id=c.fork_id, leader_id=c.leader_id)
        step.frees.extend([c.src] for c in w.copies)
        w.copies.clear()
        step.recvs = [r.transfer_id for r in w.recvs]
        w.to_drop.clear()
        w.recvs.clear()
        if not (plan.scheduled or plan.finished_request_ids or plan.recvs or plan.new_requests
                or plan.sends):
            return None
        step.request_ids = {s.request_id for s in plan.scheduled}
        step.decodes_only = (plan.scheduled and not (plan.new_requests or plan.sends or plan.recvs
                             or plan.copies) and all(s.num_tokens == 1 for s in plan.scheduled)
                             and all(self.requests[s.request_id].status is Status.DECODING
                                     for s in plan.scheduled))
        w.steps.append(step)
        return plan

    def schedule_ahead(self, worker_id: str) -> worker_pb2.StepPlan | None:
        """The next decode step of a worker whose running step only decodes, planned before
        that step's result arrives, so that the worker goes on without waiting for a round
        trip. It decodes the same requests once more (the worker appends the tokens it samples
        itself), less those whose running step ends them by length; anything else the worker
        has to do waits for a plan made once it is idle. None when that cannot be."""
        w = self.workers.get(worker_id)
        if not self.config.async_scheduling or w is None or len(w.steps) != 1 or \
                not w.steps[0].decodes_only or self._has_other_work(w):
            return None
        running = w.steps[0].request_ids
        batch = [r for r in w.decoding if r.request_id in running and r.status is Status.DECODING
                 and len(r.output_token_ids) + 1 < r.max_tokens
                 and r.num_tokens + 1 < self.max_model_len]
        # the running step adds a token to each: this step computes its KV
        need = sum(max(0, w.kv.blocks_for(r.num_tokens + 1)
                       - len(w.kv.get_block_ids(r.request_id))) for r in batch)
        if not batch or need > w.kv.num_free_blocks:
            return None  # no preemption ahead of time: the next regular plan decides
        plan = worker_pb2.StepPlan(step_id=next(self._ids))
        for r in batch:
            new_blocks = w.kv.allocate_slots(r.request_id, r.num_tokens + 1)
            if new_blocks:
                plan.cached_requests.add(request_id=r.request_id, new_block_ids=new_blocks)
            plan.scheduled.add(request_id=r.request_id, num_tokens=1)
            self._cache(w, r, r.num_tokens)  # the tokens known: computed by this step at last
        w.steps.append(Step(plan.step_id, {r.request_id for r in batch}, decodes_only=True))
        return plan

    def _has_other_work(self, w: WorkerState) -> bool:
        """Whether w has something to do besides decoding its running batch."""
        room = w.kv.num_free_blocks > 0 and self._num_seqs(w) < self.config.max_num_seqs
        return bool(w.to_drop or w.recvs or w.arrivals or w.copies or self._sendable(w)
                    or any(r.status is Status.PREFILLING for r in w.prefilling)
                    or (room and len(self.waiting) and self._admits(w)))

    def _schedule_decodes(self, w: WorkerState, plan: worker_pb2.StepPlan) -> int:
        arrivals = [(req, req.transfer_id) for req in w.arrivals]
        for req in w.arrivals:
            req.status = Status.DECODING
            w.decoding.append(req)
        w.arrivals.clear()
        scheduled = self._decode_batch(w, plan)
        # after the batch: an arrival preempted by it never reaches the worker (which would
        # drop it before adding it), but its expected transfer is cancelled there
        for req, transfer_id in arrivals:
            if req.status is Status.DECODING:
                self._send_new(w, plan, req, kv_transfer_id=transfer_id)
                req.transfer_id = ""
            elif transfer_id:
                w.to_drop.append(req.request_id)
        return scheduled

    def _decode_batch(self, w: WorkerState, plan: worker_pb2.StepPlan) -> int:
        """One token for each decoding request, preempting the least important ones while the
        blocks do not suffice; returns how many were scheduled."""
        scheduled = 0
        # most important first; victims come from the back, so never one planned already
        order = sorted(w.decoding, key=lambda r: (r.priority, r.arrival_time))
        for req in order:
            if req.status is not Status.DECODING:  # preempted below
                continue
            new_blocks = w.kv.allocate_slots(req.request_id, req.num_tokens)
            while new_blocks is None:
                victim = next(r for r in reversed(order) if r.status is Status.DECODING)
                self._preempt(victim)
                if victim is req:
                    break
                new_blocks = w.kv.allocate_slots(req.request_id, req.num_tokens)
            if new_blocks is None:
                continue
            if new_blocks and req.request_id in w.known:  # else its NewRequest has them all
                plan.cached_requests.add(request_id=req.request_id, new_block_ids=new_blocks)
            plan.scheduled.add(request_id=req.request_id, num_tokens=1)
            self._cache(w, req, req.num_tokens)
            scheduled += 1
        return scheduled

    def _hashes(self, req: Request) -> list[bytes]:
        if len(req.block_hashes) < req.num_tokens // self.block_size:
            extend_block_hashes(req.block_hashes, req.all_token_ids, self.block_size,
                                req.cache_salt)
        return req.block_hashes

    def _cache(self, w: WorkerState, req: Request, num_computed: int) -> None:
        """Full blocks whose KV this step computes become prefix-cache hits for later steps of
        the same worker (its steps run in order)."""
        if num_computed >= (w.kv.num_registered(req.request_id) + 1) * self.block_size:
            w.kv.cache_blocks(req.request_id, self._hashes(req), num_computed)

    @property
    def block_size(self) -> int:
        return next(iter(self.workers.values())).layout.block_size

    def _send_new(self, w: WorkerState, plan: worker_pb2.StepPlan, req: Request,
                  kv_transfer_id: str = "") -> None:
        forks = [] if req.output_token_ids else [
            worker_pb2.Fork(request_id=f.request_id, sampling=f.sampling) for f in req.forks]
        plan.new_requests.add(
            request_id=req.request_id, all_token_ids=req.all_token_ids,
            num_prompt_tokens=len(req.prompt_token_ids),
            num_computed_tokens=req.num_tokens - 1 if kv_transfer_id else req.num_computed_tokens,
            block_ids=w.kv.get_block_ids(req.request_id), sampling=req.sampling,
            kv_transfer_id=kv_transfer_id, eos_token_ids=req.eos_token_ids, forks=forks)
        w.known.add(req.request_id)

    def _num_seqs(self, w: WorkerState) -> int:
        return len(w.kv.request_ids())

    # ---- results -------------------------------------------------------------------------------

    def update(self, worker_id: str, result: worker_pb2.StepResult) -> list[Output]:
        w = self.workers.get(worker_id)
        if w is None:
            return []
        if not w.steps or w.steps[0].step_id != result.step_id:
            raise ValueError(f"worker {worker_id} answered step {result.step_id}, not the "
                             "oldest it runs")
        step = w.steps.popleft()
        ran = step.request_ids
        w.counters.CopyFrom(result.counters)
        for tid in step.recvs:
            if tid in self.transfers:
                self.transfers[tid].receiver_ready = True
        outputs: list[Output] = []
        for err in result.errors:
            req = self._current(w, err.request_id, ran)
            if req is not None:
                outputs.append(self._finish(req, "error", error=err.error))
        # forks first: they fork from their leader's blocks, which its own token may release
        forks = {s.request_id for s in result.sampled
                 if (r := self.requests.get(s.request_id)) is not None
                 and r.status is Status.FORKING}
        for s in sorted(result.sampled, key=lambda s: s.request_id not in forks):
            if s.request_id in forks:
                out = self._on_fork_token(w, self.requests[s.request_id], s, ran)
            else:
                req = self._current(w, s.request_id, ran)
                out = self._on_token(w, req, s) if req is not None else None
            if out is not None:
                outputs.append(out)
        for blocks in step.frees:
            w.kv.pool.free(blocks)
        return outputs

    def _current(self, w: WorkerState, rid: str, ran: set[str]) -> Request | None:
        """The request, if w's step result about it still matters (not finished, not moved)."""
        req = self.requests.get(rid)
        if req is None or rid not in ran or req.status not in (Status.PREFILLING, Status.DECODING):
            return None
        worker = req.prefill_worker if req.status is Status.PREFILLING else req.decode_worker
        return req if worker == w.worker_id else None

    def _on_token(self, w: WorkerState, req: Request, s: worker_pb2.SampledToken) -> Output:
        req.output_token_ids.append(s.token_id)
        logprobs = [s.logprobs] if s.HasField("logprobs") else []
        first = len(req.output_token_ids) == 1
        if req.status is Status.PREFILLING and req.transfer_id:
            req.status = Status.TRANSFERRING
        elif req.status is Status.PREFILLING:  # prefilled by its decode worker itself
            w.prefilling.remove(req)
            w.decoding.append(req)
            req.status = Status.DECODING
        reason, stop_id = req.check_stop(s.token_id, self.max_model_len)
        if reason:
            return self._finish(req, reason, token_ids=[s.token_id], logprobs=logprobs,
                                stop_token_id=stop_id)
        return Output(req.request_id, [s.token_id], logprobs,
                      num_prompt_tokens=len(req.prompt_token_ids) if first else 0,
                      num_cached_tokens=req.num_cached_tokens or 0)

    def _on_fork_token(self, w: WorkerState, fork: Request, s: worker_pb2.SampledToken,
                       ran: set[str]) -> Output | None:
        """A fork's first token, sampled from its leader's last prefill logits on w."""
        leader = fork.leader
        if leader is None or fork.output_token_ids or \
                self._current(w, leader.request_id, ran) is not leader or \
                leader.status is not Status.PREFILLING:
            return None  # sampled for a leader that moved on since
        fork.output_token_ids.append(s.token_id)
        fork.num_cached_tokens = leader.num_cached_tokens
        logprobs = [s.logprobs] if s.HasField("logprobs") else []
        reason, stop_id = fork.check_stop(s.token_id, self.max_model_len)
        if reason:
            return self._finish(fork, reason, token_ids=[s.token_id], logprobs=logprobs,
                                stop_token_id=stop_id)
        if not leader.transfer_id:  # prefilled on its decode worker: its KV is here
            self._fork(w, leader, fork)
        return Output(fork.request_id, [s.token_id], logprobs,
                      num_prompt_tokens=len(fork.prompt_token_ids),
                      num_cached_tokens=fork.num_cached_tokens or 0)

    def _fork(self, d: WorkerState, leader: Request, fork: Request) -> None:
        """The fork joins d's batch on its leader's prompt blocks: the full ones shared, the
        partial one copied (its first token differs from the leader's)."""
        leader.forks.remove(fork)
        fork.leader = None
        n = len(leader.prompt_token_ids)
        try:
            copy = d.kv.fork(fork.request_id, leader.request_id, n)
        except NoFreeBlocks:
            self._requeue(fork)  # on its own now: recomputed from prompt + its token
            return
        if copy is not None:
            d.kv.pool.touch([copy[0]])  # the leader may free it before the copy runs
            d.copies.append(BlockCopy(fork.request_id, leader.request_id, *copy))
        fork.status = Status.TRANSFERRING
        fork.prefill_worker = fork.decode_worker = d.worker_id
        fork.num_computed_tokens = n
        fork.block_hashes = leader.block_hashes[:n // self.block_size]
        d.arrivals.append(fork)

    def _detach_forks(self, leader: Request) -> None:
        """The leader will not give its forks KV any more: each goes its own way."""
        for fork in leader.forks:
            fork.leader = None
            fork.status = Status.WAITING
            self.waiting.push_front(fork)
        leader.forks = []

    def transfers_done(self, worker_id: str, msg: worker_pb2.TransfersDone) -> None:
        w = self.workers.get(worker_id)
        if w is None:
            return
        w.counters.CopyFrom(msg.counters)
        for done in msg.done:
            t = self.transfers.get(done.transfer_id)
            if t is not None and t.src is w:
                self._on_transfer(t, done)

    def _on_transfer(self, t: Transfer, done: worker_pb2.TransferDone) -> None:
        del self.transfers[done.transfer_id]
        for owner, blocks in t.frees:
            owner.kv.pool.free(blocks)
        if t.cancelled:  # its request finished or was re-queued meanwhile
            return
        req, src, dst = t.request, t.src, t.dst
        if done.error:
            log.warning("transfer %s failed (%s); %s is recomputed on a decode worker",
                        done.transfer_id, done.error, req.request_id)
            dst.to_drop.append(req.request_id)  # it expects the transfer: cancel that
            self._requeue(req)
            req.prefill_locally = True  # no second hop for it
            return
        src.kv.free(req.request_id)
        src.prefilling.remove(req)
        src.known.discard(req.request_id)
        src.to_drop.append(req.request_id)
        req.prefill_worker = dst.worker_id
        dst.arrivals.append(req)
        for fork in list(req.forks):
            self._fork(dst, req, fork)

    # ---- finishing and recovery ----------------------------------------------------------------

    def _finish(self, req: Request, reason: str, token_ids: list[int] | None = None,
                logprobs=None, stop_token_id: int = -1, error: str = "") -> Output:
        if req.status is Status.WAITING:
            self.waiting.remove(req)
        if req.leader is not None:
            req.leader.forks.remove(req)
            req.leader = None
        self._detach_forks(req)
        req.status = Status.FINISHED
        req.finish_reason = reason
        self._release(req)
        self.requests.pop(req.request_id, None)
        self.num_finished += 1
        return Output(req.request_id, token_ids or [], logprobs or [], finish_reason=reason,
                      stop_token_id=stop_token_id, num_prompt_tokens=len(req.prompt_token_ids),
                      num_cached_tokens=req.num_cached_tokens or 0, error=error)

    def _preempt(self, req: Request) -> None:
        log.info("preempting %s", req.request_id)
        req.num_preemptions += 1
        self.num_preemptions += 1
        self._requeue(req)

    def _requeue(self, req: Request) -> None:
        """Back to the queue with prompt + tokens so far. Forks without a first token stay
        with their leader (sampled when it prefills again); those with one go their own way."""
        if req.output_token_ids:
            self._detach_forks(req)
        self._release(req)
        req.status = Status.WAITING
        req.prefill_worker = req.decode_worker = None
        req.num_computed_tokens = 0
        req.transfer_id = ""
        self.waiting.push_front(req)

    def _release(self, req: Request) -> None:
        """Drops req from every worker. Blocks still in use go back to their pool later: those of
        a running step when its result arrives, those of an ordered KV send (both sides) when
        the sender reports it done."""
        rid = req.request_id
        transfer = self.transfers.get(req.transfer_id) if req.transfer_id else None
        if transfer is not None and transfer.ordered:
            transfer.cancelled = True  # its sender may be reading and writing blocks right now
        elif transfer is not None:
            del self.transfers[req.transfer_id]
        for w in self.workers.values():
            for c in [c for c in w.copies if c.fork_id == rid]:
                w.copies.remove(c)
                w.kv.pool.free([c.src])
            landed = req in w.arrivals and bool(req.transfer_id)
            for lst in (w.prefilling, w.decoding, w.arrivals):
                if req in lst:
                    lst.remove(req)
            if rid in w.known:
                w.known.discard(rid)
                w.to_drop.append(rid)
            elif any(r.request_id == rid for r in w.recvs):
                w.recvs = [r for r in w.recvs if r.request_id != rid]
            elif (transfer is not None and w is transfer.dst) or landed:
                w.to_drop.append(rid)  # it expects the transfer (or holds it): cancel that
            blocks = w.kv.detach(rid)
            if not blocks:
                continue
            if transfer is not None and transfer.ordered and w in (transfer.src, transfer.dst):
                transfer.frees.append((w, blocks))
            elif (step := w.last_step_with(rid)) is not None:
                step.frees.append(blocks)
            else:
                w.kv.pool.free(blocks)

def _offer(w: WorkerState) -> str:
    return f"transports {', '.join(w.transports) or 'none'}, host id {w.host_id or '?'}"


def _layout_str(layout: worker_pb2.KVLayout) -> str:
    return (f"(layers={layout.num_layers}, kv_heads={layout.num_kv_heads}, "
            f"head_dim={layout.head_dim}, block_size={layout.block_size}, dtype={layout.dtype})")
