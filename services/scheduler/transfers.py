"""KV transfers from a prefill worker to a decode worker: opened at admission, ordered into the
sender's plan once its prompt is computed and the receiver expects them, and done (or failed)
when the sender says so.

    opened -> computed (last chunk planned) + receiver ready (its step registered the recv)
           -> ordered (a KVSend in the sender's plan: blocks on both sides in use)
           -> done: the request lands on the decode worker | failed: recomputed there

A request that finishes or is re-queued meanwhile cancels its transfer: before it is ordered
the transfer simply goes; after, its blocks wait for the sender's report (`transfer_event`).
"""
from __future__ import annotations

import logging
from collections.abc import Callable

from common.plans import KVRecv, KVSend, StepPlan, TransferDone
from services.scheduler.request import Request
from services.scheduler.worker_state import Transfer, WorkerState, transfer_event, transport_between

log = logging.getLogger(__name__)


class Transfers:
    def __init__(self, requeue: Callable[[Request], None],
                 land: Callable[[Request, WorkerState, WorkerState], None]):
        self._requeue = requeue  # a request whose KV never landed: recomputed
        self._land = land        # a request whose KV landed on its decode worker
        self.by_id: dict[str, Transfer] = {}

    def get(self, transfer_id: str) -> Transfer | None:
        return self.by_id.get(transfer_id) if transfer_id else None

    def open(self, req: Request, src: WorkerState, dst: WorkerState, dst_prefix: list[int],
             transfer_id: str) -> None:
        """req's KV will go from src to dst: its blocks on dst are reserved here (the cached
        prefix `dst_prefix` stays put, and the blocks after it that dst's second tier holds
        dst loads itself: looked up here, after src's allocation, which may have evicted
        entries of a tier the two share), and dst expects the rest in its next plan."""
        hashes = req.hashes(dst.kv.block_size)
        cached = len(dst_prefix)
        dst_tier = dst.kv.find_tier(hashes, req.num_tokens, cached)
        reserved = dst.kv.allocate_slots(req.request_id, req.num_tokens, dst_prefix, dst_tier)
        assert reserved is not None, "placement checked that the blocks fit"
        req.transfer_id = transfer_id
        skip = cached + len(dst_tier)
        transport = transport_between(src, dst)
        dst.recvs.append(KVRecv(transfer_id, req.request_id,
                                tuple(dst.kv.get_block_ids(req.request_id)[skip:]), transport))
        self.by_id[transfer_id] = Transfer(transfer_id, req, src, dst, transport, skip=skip)

    def sendable(self, w: WorkerState) -> list[Transfer]:
        """Transfers w may start now: computed, and the receiver expects them."""
        return [t for t in self.by_id.values() if t.src is w and t.computed
                and t.receiver_ready and not t.ordered and not t.cancelled]

    def receivers_ready(self, transfer_ids: list[str]) -> None:
        for tid in transfer_ids:
            if tid in self.by_id:
                self.by_id[tid].receiver_ready = True

    def computed(self, plan: StepPlan, req: Request) -> None:
        """The plan computes req's last prompt chunk: its send follows the step, if the receiver
        expects it already (else a later plan orders it)."""
        t = self.by_id[req.transfer_id]
        t.computed = True
        if t.receiver_ready:
            self.order(plan, t)

    def order(self, plan: StepPlan, t: Transfer) -> None:
        """The send runs after the plan's compute; from here on, blocks on both sides stay in
        use until the sender reports it done."""
        rid = t.request.request_id
        t.ordered = True
        plan.sends.append(KVSend(
            transfer_id=t.transfer_id, request_id=rid,
            src_block_ids=tuple(t.src.kv.get_block_ids(rid)[t.skip:]),
            dst_block_ids=tuple(t.dst.kv.get_block_ids(rid)[t.skip:]),
            dst_endpoint=t.dst.endpoints[t.transport], transport=t.transport))

    def done(self, sender: WorkerState, done: TransferDone) -> None:
        t = self.by_id.get(done.transfer_id)
        if t is None or t.src is not sender:
            return
        del self.by_id[done.transfer_id]
        event = transfer_event(t.transfer_id)
        t.src.kv.done(event)
        t.dst.kv.done(event)
        if t.cancelled:  # its request finished or was re-queued meanwhile
            return
        req = t.request
        if done.error:
            log.warning("transfer %s failed (%s); %s is recomputed on a decode worker",
                        done.transfer_id, done.error, req.request_id)
            t.dst.to_drop.append(req.request_id)  # it expects the transfer: cancel that
            self._requeue(req)
            req.prefill_locally = True  # no second hop for it
            return
        self._land(req, t.src, t.dst)

    def sender_lost(self, w: WorkerState) -> None:
        """A dead sender writes nothing more: the blocks its sends held are free now (its
        requests are re-queued by the caller, which drops these transfers)."""
        for t in list(self.by_id.values()):
            if t.src is not w:
                continue  # a live sender still reports its send done, which frees its blocks
            t.dst.kv.done(transfer_event(t.transfer_id))
            t.ordered = False
            if t.cancelled:
                del self.by_id[t.transfer_id]

    def cancel(self, req: Request) -> Transfer | None:
        """req moves on without its transfer: an ordered one is marked (its sender may be
        reading and writing blocks right now: the caller releases them after it), any other
        goes. Returns the transfer, if req had one."""
        t = self.get(req.transfer_id)
        if t is None:
            return None
        if t.ordered:
            t.cancelled = True
        else:
            del self.by_id[t.transfer_id]
        return t
