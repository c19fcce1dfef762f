"""Prefill planning: which prompts a worker starts or continues in a step, in chunks under the
step's token budget, and where their KV goes. A mixin of Scheduler: it plans with the
scheduler's state (workers, waiting queue, transfers) and owns none of its own.
"""
from __future__ import annotations

import itertools

from protos import worker_pb2
from services.scheduler.request import Request, Status
from services.scheduler.worker_state import Transfer, WorkerState, transport_between

ADMISSION_LOOKAHEAD = 8  # waiting requests a worker looks past a head that cannot start now


class PrefillPlanning:
    # ---- prefill: chunks under the step's token budget --------------------------------------
    #
    # A prompt is a *partial* prefill from the step that starts it until the step that
    # finishes it. At most max_num_partial_prefills are partial on a worker at once, at most
    # max_long_partial_prefills of them long; a prompt that fits whole in what is left of the
    # budget may always start, so short prompts pass long ones.

    def _schedule_prefills(self, w: WorkerState, plan: worker_pb2.StepPlan, budget: int) -> None:
        for req in w.prefilling:
            if budget <= 0:
                break
            if req.status is Status.PREFILLING and req.num_computed_tokens < req.num_tokens:
                budget -= self._schedule_chunk(w, plan, req, budget)
        if not self._admits(w):
            return
        for req in list(itertools.islice(self.waiting, self._lookahead)):
            if budget <= 0 or self._num_seqs(w) >= self.config.max_num_seqs:
                return
            verdict = self._try_admit(w, plan, req, budget)
            if verdict is None:
                return  # no room anywhere: keep the queue's order
            budget -= verdict

    def _try_admit(self, w: WorkerState, plan: worker_pb2.StepPlan, req: Request,
                   budget: int) -> int | None:
        """Starts req on w; returns the tokens it scheduled (0: req skipped, later ones may
        go) or None (stop admitting this step)."""
        n = req.num_tokens
        hashes = self._hashes(req)
        prefix = w.kv.find_prefix(hashes, n)
        todo = n - len(prefix) * w.kv.block_size
        short = todo <= self.config.prefill_bypass_threshold or req.prefill_locally
        if w.role == "decode" and not short and \
                any(p.role == "prefill" for p in self.workers.values()) and \
                not self._decode_may_relieve(w, req, todo):
            return 0  # a prefill worker takes it
        if w.role == "prefill" and (req.prefill_locally or self._short_for_a_decoder(req, hashes)):
            return 0  # its decode worker prefills it: no KV hop for a short prompt
        if w.role == "prefill" and self._better_prefill(w, req, hashes, len(prefix)):
            return 0  # another prefill worker holds more of its prefix: leave it to that one
        if todo > min(budget, self._chunk_cap(req)) and not self._may_start_partial(w, req):
            return 0
        dst = dst_prefix = None
        if w.role == "prefill":
            decoders = [d for d in self.workers.values() if d.role == "decode"
                        and self._num_seqs(d) < self.config.max_num_seqs and transport_between(w, d)]
            dst = self.placement.choose_decode(req, decoders, n + 1, hashes)
            if dst is None:
                return None
            dst_prefix = dst.kv.find_prefix(hashes, n)
        if w.kv.allocate_slots(req.request_id, n, prefix) is None:
            return None
        self.waiting.remove(req)
        req.status = Status.PREFILLING
        req.prefill_worker = w.worker_id
        req.decode_worker = (dst or w).worker_id
        req.num_computed_tokens = len(prefix) * w.kv.block_size
        if req.num_cached_tokens is None:  # first admission: the hit the client is told
            req.num_cached_tokens = req.num_computed_tokens
        w.prefilling.append(req)
        if dst is not None:
            assert dst.kv.allocate_slots(req.request_id, n, dst_prefix) is not None
            req.transfer_id = f"{req.request_id}/{next(self._ids)}"
            skip = len(dst_prefix)  # blocks the decode worker has cached already
            transport = transport_between(w, dst)
            dst.recvs.append(worker_pb2.KVRecv(
                transfer_id=req.transfer_id, request_id=req.request_id,
                block_ids=dst.kv.get_block_ids(req.request_id)[skip:], transport=transport))
            self.transfers[req.transfer_id] = Transfer(req, w, dst, transport=transport,
                                                       skip=skip)
        self._send_new(w, plan, req)
        return self._schedule_chunk(w, plan, req, budget)

    def _short_for_a_decoder(self, req: Request, hashes: list[bytes]) -> bool:
        """Whether a decode worker would prefill req itself: shortness is judged by what the
        decode workers hold, so that the one a prefill worker leaves a prompt to takes it."""
        t = self.config.prefill_bypass_threshold
        n = req.num_tokens
        return t > 0 and any(
            d.role == "decode" and n - len(d.kv.find_prefix(hashes, n)) * d.kv.block_size <= t
            for d in self.workers.values())

    @property
    def long_prefill_token_threshold(self) -> int:
        t = self.config.long_prefill_token_threshold
        if t == 0 and self.config.max_num_partial_prefills > 1:
            # half the step: a long prompt's chunk leaves the other half to short prompts
            t = max(1, self.config.max_num_batched_tokens // 2)
        return t

    def _decode_may_relieve(self, w: WorkerState, req: Request, todo: int) -> bool:
        """--saturated-prefill-bypass: no prefill worker can start req now, and w has room to
        prefill it itself (no prefill of its own running, a quarter of its blocks left)."""
        if not self.config.saturated_prefill_bypass:
            return False
        prefillers = [p for p in self.workers.values() if p.role == "prefill"]
        saturated = all(self._num_seqs(p) >= self.config.max_num_seqs
                        or not self._may_start_partial(p, req) for p in prefillers)
        own_prefill = any(r.status is Status.PREFILLING for r in w.prefilling)
        room = w.kv.num_free_blocks - w.kv.blocks_for(todo + 1) >= w.kv.num_blocks // 4
        return saturated and not own_prefill and room

    def _better_prefill(self, w: WorkerState, req: Request, hashes: list[bytes],
                        hit: int) -> bool:
        """Whether another prefill worker caches a longer prefix of req and can start it."""
        for other in self.workers.values():
            if other is w or other.role != "prefill" or \
                    self._num_seqs(other) >= self.config.max_num_seqs:
                continue
            prefix = other.kv.find_prefix(hashes, req.num_tokens)
            if len(prefix) > hit and other.kv.can_fit(req.request_id, req.num_tokens, prefix):
                return True
        return False

    def _chunk_cap(self, req: Request) -> int:
        """Most tokens of one prompt in one step: long prompts are capped when several partial
        prefills share a step, so that none of them takes the whole budget."""
        if self.config.max_num_partial_prefills > 1:
            return self.long_prefill_token_threshold
        return self.max_model_len

    def _is_long(self, req: Request) -> bool:
        t = self.long_prefill_token_threshold
        return t > 0 and req.num_tokens > t

    def _may_start_partial(self, w: WorkerState, req: Request) -> bool:
        partial = [r for r in w.prefilling
                   if r.status is Status.PREFILLING and r.num_computed_tokens < r.num_tokens]
        if len(partial) >= self.config.max_num_partial_prefills:
            return False
        if self._is_long(req):
            return sum(map(self._is_long, partial)) < self.config.max_long_partial_prefills
        return True

    def _schedule_chunk(self, w: WorkerState, plan: worker_pb2.StepPlan, req: Request,
                        budget: int) -> int:
        n = min(req.num_tokens - req.num_computed_tokens, budget, self._chunk_cap(req))
        plan.scheduled.add(request_id=req.request_id, num_tokens=n)
        req.num_computed_tokens += n
        self._cache(w, req, req.num_computed_tokens)
        if req.num_computed_tokens == req.num_tokens and req.transfer_id:
            t = self.transfers[req.transfer_id]
            t.computed = True
            if t.receiver_ready:  # else a later plan orders it, once the receiver expects it
                self._order_send(plan, t)
        return n

    def _order_send(self, plan: worker_pb2.StepPlan, t: Transfer) -> None:
        """The send runs after the plan's compute; from here on, blocks on both sides stay in
        use until the sender reports it done."""
        rid = t.request.request_id
        t.ordered = True
        plan.sends.add(transfer_id=t.request.transfer_id, request_id=rid,
                       src_block_ids=t.src.kv.get_block_ids(rid)[t.skip:],
                       dst_block_ids=t.dst.kv.get_block_ids(rid)[t.skip:],
                       dst_endpoint=t.dst.endpoints[t.transport], transport=t.transport)
