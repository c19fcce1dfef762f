"""Decode: a decode worker's running batch, one token per request per step, preempting the
least important requests when blocks run out; requests whose KV just landed join it; and the
step planned ahead, while the one before it runs (async scheduling)."""
from __future__ import annotations

from collections.abc import Callable

from common.plans import CachedRequest, ScheduledTokens, StepPlan
from services.scheduler.request import Request, Status
from services.scheduler.worker_state import Step, WorkerState


class Decode:
    def __init__(self, preempt: Callable[[Request], None], max_model_len: Callable[[], int],
                 next_id: Callable[[], int]):
        self._preempt = preempt              # back to the queue, to be recomputed
        self._max_model_len = max_model_len
        self._next_id = next_id

    def schedule(self, w: WorkerState, plan: StepPlan) -> int:
        """Arrivals join the batch, then the batch decodes; returns the tokens scheduled."""
        arrivals = [(req, req.transfer_id) for req in w.arrivals]
        for req in w.arrivals:
            req.status = Status.DECODING
            w.decoding.append(req)
        w.arrivals.clear()
        scheduled = self._batch(w, plan)
        # after the batch: an arrival preempted by it never reaches the worker (which would
        # drop it before adding it), but its expected transfer is cancelled there
        for req, transfer_id in arrivals:
            if req.status is Status.DECODING:
                w.introduce(plan, req, kv_transfer_id=transfer_id)
                req.transfer_id = ""
            elif transfer_id:
                w.to_drop.append(req.request_id)
        return scheduled

    def _batch(self, w: WorkerState, plan: StepPlan) -> int:
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
                plan.cached_requests.append(CachedRequest(req.request_id, tuple(new_blocks)))
            plan.scheduled.append(ScheduledTokens(req.request_id, 1))
            w.cache(req, req.num_tokens)
            scheduled += 1
        return scheduled

    def plan_ahead(self, w: WorkerState) -> StepPlan | None:
        """The next step of w, whose one running step only decodes, before its result arrives.
        It decodes the same requests once more (the worker appends the tokens it samples
        itself), less those the running step ends by length; None when the blocks do not
        suffice without preempting (the next regular plan decides that)."""
        running = w.steps[0].request_ids
        batch = [r for r in w.decoding if r.request_id in running and r.status is Status.DECODING
                 and len(r.output_token_ids) + 1 < r.max_tokens
                 and r.num_tokens + 1 < self._max_model_len()]
        # the running step adds a token to each: this step computes its KV
        need = sum(max(0, w.kv.blocks_for(r.num_tokens + 1)
                       - len(w.kv.get_block_ids(r.request_id))) for r in batch)
        if not batch or need > w.kv.num_free_blocks:
            return None
        plan = StepPlan(self._next_id())
        for r in batch:
            new_blocks = w.kv.allocate_slots(r.request_id, r.num_tokens + 1)
            if new_blocks:
                plan.cached_requests.append(CachedRequest(r.request_id, tuple(new_blocks)))
            plan.scheduled.append(ScheduledTokens(r.request_id, 1))
            w.cache(r, r.num_tokens)  # the tokens known: computed by this step at last
        w.steps.append(Step(plan.step_id, {r.request_id for r in batch}, decodes_only=True))
        return plan
