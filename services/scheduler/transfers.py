"""KV transfers from a prefill worker to a decode worker: opened at admission, ordered into the
sender's plan once its prompt is computed and the receiver expects them, and done (or failed)
when the sender says so.

    opened -> computed (last chunk planned) + receiver ready (its step registered the recv)
           -> ordered (a KVSend in the sender's plan: blocks on both sides in use)
           -> done: the request lands on the decode worker | failed: recomputed there

A request that finishes or is re-queued meanwhile cancels its transfer: before it is ordered
the transfer simply goes; after, its blocks wait for the sender's report (`transfer_event`).

A *prefix fill* moves no request: the blocks of a prompt one worker has computed (a decode
worker's long prompt) go into another's prefix cache (a prefill worker's, which then takes the
prompt over from there, `Prefill.to_take_back`). It goes the same way (receiver ready, ordered,
done), holds the sender's blocks until it is done, whatever becomes of its request, and when
it fails or either worker leaves it simply ends: the receiver caches nothing.
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

    def open_fill(self, req: Request, src: WorkerState, dst: WorkerState, num_blocks: int,
                  dst_prefix: list[int], transfer_id: str) -> None:
        """The first num_blocks blocks of req's prompt, computed on src, go into dst's prefix
        cache: those after dst's cached `dst_prefix`. dst's blocks are reserved under the
        transfer id (its expectation's request id on the worker too), src's are held; the
        send is ordered with src's next plan once dst's step has registered the recv."""
        skip = len(dst_prefix)
        reserved = dst.kv.allocate_slots(transfer_id, num_blocks * dst.kv.block_size, dst_prefix,
                                         lookup=False)
        assert reserved is not None, "the caller checked that the blocks fit"
        src_blocks = tuple(src.kv.get_block_ids(req.request_id)[skip:num_blocks])
        src.kv.hold(src_blocks)
        transport = transport_between(src, dst)
        dst.recvs.append(KVRecv(transfer_id, transfer_id, tuple(reserved), transport))
        self.by_id[transfer_id] = Transfer(
            transfer_id, req, src, dst, transport, skip=skip, computed=True,
            fill=tuple(req.hashes(dst.kv.block_size)[:num_blocks]), src_block_ids=src_blocks)

    def filling(self, dst: WorkerState) -> Transfer | None:
        """The prefix fill into dst under way, if any."""
        return next((t for t in self.by_id.values() if t.fill and t.dst is dst), None)

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
        src_ids = t.src_block_ids if t.fill else tuple(t.src.kv.get_block_ids(rid)[t.skip:])
        dst_rid = t.transfer_id if t.fill else rid
        plan.sends.append(KVSend(
            transfer_id=t.transfer_id, request_id=rid, src_block_ids=src_ids,
            dst_block_ids=tuple(t.dst.kv.get_block_ids(dst_rid)[t.skip:]),
            dst_endpoint=t.dst.endpoints[t.transport], transport=t.transport))

    def done(self, sender: WorkerState, done: TransferDone) -> None:
        t = self.by_id.get(done.transfer_id)
        if t is None or t.src is not sender:
            return
        del self.by_id[done.transfer_id]
        if t.fill:
            self._end_fill(t, cache=not done.error)  # nothing to cache where it was cancelled
            return
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

    def _end_fill(self, t: Transfer, cache: bool, sender_alive: bool = True) -> None:
        """A prefix fill is over: the sender's blocks are released, and the receiver's go to
        its prefix cache (`cache`, it landed) or back to its pool; the receiver forgets its
        expectation (the transfer id as a request id: its recv not sent yet, or dropped)."""
        if sender_alive:
            t.src.kv.release(t.src_block_ids)
        if t.cancelled:  # the receiver left
            return
        if cache:
            t.dst.kv.cache_blocks(t.transfer_id, list(t.fill), len(t.fill) * t.dst.kv.block_size)
        t.dst.kv.free(t.transfer_id)
        pending = [r for r in t.dst.recvs if r.transfer_id != t.transfer_id]
        if len(pending) < len(t.dst.recvs):
            t.dst.recvs = pending
        else:
            t.dst.to_drop.append(t.transfer_id)

    def receiver_lost(self, w: WorkerState) -> None:
        """Prefix fills into a dead worker end: unordered ones now, ordered ones when their
        live sender reports them done (it may be reading its blocks right now)."""
        for t in [t for t in self.by_id.values() if t.fill and t.dst is w]:
            t.cancelled = True
            if not t.ordered:
                del self.by_id[t.transfer_id]
                self._end_fill(t, cache=False)

    def sender_lost(self, w: WorkerState) -> None:
        """A dead sender writes nothing more: the blocks its sends held are free now (its
        requests are re-queued by the caller, which drops these transfers); its prefix fills
        end, the receivers caching nothing."""
        for t in list(self.by_id.values()):
            if t.src is not w:
                continue  # a live sender still reports its send done, which frees its blocks
            if t.fill:
                del self.by_id[t.transfer_id]
                self._end_fill(t, cache=False, sender_alive=False)
                continue
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
