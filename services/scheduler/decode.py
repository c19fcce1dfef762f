"""Decode: a decode worker's running batch, one token per request per step (or, on a worker
that speculates, up to its drafts + 1: each request holds lookahead slots for them), preempting
the least important requests when blocks run out; requests whose KV just landed join it; and the
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
        """One token for each decoding request (and its lookahead slots where blocks are free
        for them), preempting the least important ones while the blocks do not suffice;
        returns how many were scheduled."""
        scheduled = 0
        # most important first; victims come from the back, so never one planned already
        order = sorted(w.decoding, key=lambda r: (r.priority, r.arrival_time))
        for req in order:
            if req.status is not Status.DECODING:  # preempted below
                continue
            lookahead = self._lookahead(w, req, req.num_tokens)
            new_blocks = w.kv.allocate_slots(req.request_id, req.num_tokens + lookahead)
            if new_blocks is None and lookahead:  # no preemption for drafts
                lookahead = 0
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
            plan.scheduled.append(ScheduledTokens(req.request_id, 1, lookahead))
            w.cache(req, req.num_tokens)
            scheduled += 1
        return scheduled

    def _lookahead(self, w: WorkerState, req: Request, num_tokens: int) -> int:
        """Draft slots for req on w when it has num_tokens tokens: none past its max_tokens or
        the longest sequence (the tokens a step adds are its drafts + 1)."""
        if not w.num_speculative_tokens:
            return 0
        num_output = num_tokens - len(req.prompt_token_ids)
        return max(0, min(w.num_speculative_tokens, req.max_tokens - num_output - 1,
                          self._max_model_len() - num_tokens - 1))

    def plan_ahead(self, w: WorkerState) -> StepPlan | None:
        """The next step of w, whose one running step only decodes, before its result arrives.
        It decodes the same requests once more (the worker appends the tokens it samples
        itself), less those the running step ends by length; None when the blocks do not
        suffice without preempting (the next regular plan decides that). A running step that
        verifies drafts adds an unknown number of tokens, up to its lookahead + 1: blocks are
        held for the most."""
        running = w.steps[0]
        # tokens each request has once the running step is done: at least one more, at most
        # its lookahead more
        most = {r.request_id: r.num_tokens + 1 + running.lookahead.get(r.request_id, 0)
                for r in w.decoding}
        batch = [r for r in w.decoding if r.request_id in running.request_ids
                 and r.status is Status.DECODING and len(r.output_token_ids) + 1 < r.max_tokens
                 and most[r.request_id] < self._max_model_len()]
        lookahead = {r.request_id: self._ahead_lookahead(w, r, most[r.request_id])
                     for r in batch}
        if self._blocks_needed(w, batch, most, lookahead) > w.kv.num_free_blocks:
            lookahead = dict.fromkeys(lookahead, 0)
        if not batch or self._blocks_needed(w, batch, most, lookahead) > w.kv.num_free_blocks:
            return None
        plan = StepPlan(self._next_id())
        for r in batch:
            # this step computes the KV of the running step's last token, and drafts past it
            slots = most[r.request_id] + lookahead[r.request_id]
            new_blocks = w.kv.allocate_slots(r.request_id, slots)
            if new_blocks:
                plan.cached_requests.append(CachedRequest(r.request_id, tuple(new_blocks)))
            plan.scheduled.append(ScheduledTokens(r.request_id, 1, lookahead[r.request_id]))
            w.cache(r, r.num_tokens)  # the tokens known: computed by this step at last
        w.steps.append(Step(plan.step_id, {r.request_id for r in batch}, decodes_only=True,
                            lookahead={rid: n for rid, n in lookahead.items() if n}))
        return plan

    def _ahead_lookahead(self, w: WorkerState, r: Request, most: int) -> int:
        """Draft slots of a step planned ahead: bounded as if the running step added one token
        (max_tokens) and as if it added all it may (the longest sequence)."""
        by_output = self._lookahead(w, r, r.num_tokens + 1)
        return min(by_output, max(0, self._max_model_len() - most - 1))

    @staticmethod
    def _blocks_needed(w: WorkerState, batch: list[Request], most: dict[str, int],
                       lookahead: dict[str, int]) -> int:
        return sum(max(0, w.kv.blocks_for(most[r.request_id] + lookahead[r.request_id])
                       - len(w.kv.get_block_ids(r.request_id))) for r in batch)

    def more_steps(self, w: WorkerState, plan: StepPlan, step: Step, num_steps: int,
                   ahead: bool) -> None:
        """Makes a plan that only decodes run num_steps decode steps: each request's blocks grow
        for the tokens of the steps after the first, as far as free blocks, its max_tokens and
        the longest sequence allow (a request whose blocks run out stops decoding in this plan
        and goes on in the next). `ahead`: planned while w's running step may still add tokens.
        Records in step.lookahead how many tokens more than one it may add."""
        plan.num_steps = num_steps
        bs = w.kv.block_size
        running = w.steps[0].lookahead if ahead else {}
        by_id = {r.request_id: r for r in w.decoding}
        for s in plan.scheduled:
            r = by_id[s.request_id]
            # tokens it has when this plan starts (at most, planned ahead), its last uncomputed
            base = r.num_tokens + (1 + running.get(r.request_id, 0) if ahead else 0)
            extra = min(num_steps - 1, self._max_model_len() - base - 1,
                        r.max_tokens - len(r.output_token_ids) - (2 if ahead else 1))
            if extra > 0:
                grown = w.kv.allocate_slots(r.request_id, base + extra)
                if grown:
                    plan.cached_requests.append(CachedRequest(r.request_id, tuple(grown)))
            slots = len(w.kv.get_block_ids(r.request_id)) * bs
            # the worker goes on while the blocks hold the last token's KV
            step.lookahead[r.request_id] = max(0, min(num_steps, slots - base + 1) - 1)
