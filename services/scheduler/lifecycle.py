"""What happens to a request between managers: it is queued (or refused), its tokens go out
(finishing it where one stops it), it is preempted or re-queued to be recomputed, or it
finishes; either way it is released from every worker, its blocks back to their pools once
nothing reads or writes them.

    add --> WAITING (or ValueError / QueueFull)
    running --token--> Output (finished when the token stops it)
    running --preempt / lost worker / failed transfer--> WAITING (prompt + tokens so far)
    any --finish (stop, length, abort, error)--> FINISHED, released
"""
from __future__ import annotations

import logging
from collections.abc import Sequence

from common.plans import SampledToken
from common.sampling_params import TokenLogprobs
from services.scheduler.forks import Forks
from services.scheduler.request import Output, Request, Status
from services.scheduler.request_queue import RequestQueue
from services.scheduler.transfers import Transfers
from services.scheduler.worker_state import step_event, transfer_event
from services.scheduler.workers import Workers

log = logging.getLogger(__name__)


class QueueFull(Exception):
    """The waiting queue is at --max-waiting-requests: retry later."""


class Lifecycle:
    def __init__(self, requests: dict[str, Request], waiting: RequestQueue, workers: Workers):
        self.requests = requests
        self.waiting = waiting
        self.workers = workers
        self.transfers: Transfers | None = None  # wired by the Scheduler (they call back here)
        self.forks: Forks | None = None
        self.num_finished = 0
        self.num_preemptions = 0

    def add(self, req: Request, forks: Sequence[Request], max_waiting: int) -> None:
        """Queues req and its forks (more samples of its prompt); raises ValueError for a
        request that can never run, QueueFull at `max_waiting` waiting requests (0: no limit)."""
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
        max_len = self.workers.max_model_len
        if total > max_len:
            raise ValueError(f"prompt ({len(req.prompt_token_ids)} tokens) + max_tokens "
                             f"({req.max_tokens}) exceeds the maximum model length {max_len}")
        decoders = self.workers.of_role("decode")
        if decoders and all(w.kv.blocks_for(total) > w.kv.num_blocks for w in decoders):
            raise ValueError(f"{total} tokens can never fit in a decode worker's KV cache")
        if max_waiting and len(self.waiting) >= max_waiting:
            raise QueueFull(f"{len(self.waiting)} requests are waiting already (the limit is "
                            f"{max_waiting}); retry later")
        self.requests[req.request_id] = req
        for f in forks:
            f.status, f.leader = Status.FORKING, req
            req.forks.append(f)
            self.requests[f.request_id] = f
        self.waiting.push(req)

    @property
    def num_running(self) -> int:
        """Admitted requests (forks count once their first token is out)."""
        pending_forks = sum(r.status is Status.FORKING and not r.output_token_ids
                            for r in self.requests.values())
        return len(self.requests) - len(self.waiting) - pending_forks

    def emit(self, req: Request, tokens: Sequence[SampledToken],
             num_prompt_tokens: int) -> Output:
        """req's new tokens out to its stream, in order, up to one that stops it (finishing it;
        those after it are dropped); the first one takes the prompt's logprobs along when they
        were asked for."""
        prompt_logprobs: list[TokenLogprobs] = []
        if req.scores_prompt:
            prompt_logprobs, req.prompt_logprobs = req.prompt_logprobs, []
            assert len(prompt_logprobs) == len(req.prompt_token_ids) - 1, (
                f"{req.request_id}: {len(prompt_logprobs)} prompt logprobs for a prompt of "
                f"{len(req.prompt_token_ids)} tokens")
        token_ids: list[int] = []
        logprobs: list[TokenLogprobs] = []
        for s in tokens:
            req.output_token_ids.append(s.token_id)
            token_ids.append(s.token_id)
            if s.logprobs is not None:
                logprobs.append(s.logprobs)
            reason, stop_id = req.check_stop(s.token_id, self.workers.max_model_len)
            if reason:
                return self.finish(req, reason, token_ids=token_ids, logprobs=logprobs,
                                   stop_token_id=stop_id, prompt_logprobs=prompt_logprobs)
        return Output(req.request_id, token_ids, logprobs,
                      num_prompt_tokens=num_prompt_tokens,
                      num_cached_tokens=req.num_cached_tokens or 0,
                      prompt_logprobs=prompt_logprobs)

    def finish(self, req: Request, reason: str, token_ids: list[int] | None = None,
               logprobs: list[TokenLogprobs] | None = None, stop_token_id: int = -1,
               error: str = "", prompt_logprobs: list[TokenLogprobs] | None = None) -> Output:
        assert self.forks is not None
        if req.status is Status.WAITING:
            self.waiting.remove(req)
        if req.leader is not None:
            req.leader.forks.remove(req)
            req.leader = None
        self.forks.detach(req)
        req.status = Status.FINISHED
        req.finish_reason = reason
        self.release(req)
        self.requests.pop(req.request_id, None)
        self.num_finished += 1
        return Output(req.request_id, token_ids or [], logprobs or [], finish_reason=reason,
                      stop_token_id=stop_token_id, num_prompt_tokens=len(req.prompt_token_ids),
                      num_cached_tokens=req.num_cached_tokens or 0, error=error,
                      prompt_logprobs=prompt_logprobs or [])

    def preempt(self, req: Request) -> None:
        log.info("preempting %s", req.request_id)
        req.num_preemptions += 1
        self.num_preemptions += 1
        self.requeue(req)

    def requeue(self, req: Request) -> None:
        """Back to the queue with prompt + tokens so far. Forks without a first token stay
        with their leader (sampled when it prefills again); those with one go their own way."""
        assert self.forks is not None
        if req.output_token_ids:
            self.forks.detach(req)
        self.release(req)
        req.status = Status.WAITING
        req.prefill_worker = req.decode_worker = None
        req.num_computed_tokens = 0
        req.transfer_id = ""
        req.prompt_logprobs = []  # a prompt still to score is scored again from its start
        self.waiting.push_front(req)

    def release(self, req: Request) -> None:
        """Drops req from every worker. Blocks still in use go back to their pool later: those of
        a running step when its result arrives, those of an ordered KV send (both sides) when
        the sender reports it done."""
        assert self.transfers is not None
        rid = req.request_id
        transfer = self.transfers.cancel(req)
        for w in self.workers.values():
            for c in [c for c in w.copies if c.request_id == rid]:
                w.copies.remove(c)
                w.kv.release([c.src])
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
            if transfer is not None and transfer.ordered and w in (transfer.src, transfer.dst):
                w.kv.free(rid, after=transfer_event(transfer.transfer_id))
            elif (step := w.last_step_with(rid)) is not None:
                w.kv.free(rid, after=step_event(step.step_id))
            else:
                w.kv.free(rid)
