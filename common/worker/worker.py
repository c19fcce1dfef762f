"""A worker's step logic: apply a StepPlan to its request states, run it, answer a StepResult,
then run the plan's KV sends and answer TransfersDone.

No I/O here besides the KV transport calls the plan orders; the gRPC loop lives in service.py.
"""
from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field

import torch

from common.kv_cache import LocalTier, PagedKVCache, SharedTier, copy_blocks, on_device
from common.kv_transfer.base import KVListener, KVReceiver, KVSender, KVTransferError
from common.plans import (
    BlockCopy,
    KVSend,
    NewRequest,
    PromptLogprobs,
    RequestError,
    SampledToken,
    StepPlan,
    StepResult,
    TransferDone,
    TransfersDone,
    WorkerCounters,
)
from common.worker.core_board import QUIET_S, CoreBoard
from common.worker.layer_streamer import LayerStreamer
from common.worker.model_runner import ModelRunner, RequestState, stops
from common.worker.pipeline import LastStage, Outcome
from common.worker.step_threads import StepThreads

log = logging.getLogger(__name__)

# A step of STARVED_MIN_S or more whose thread ran less than STARVED_SHARE of that time was kept
# off its core: on a CPU a step's thread computes throughout (its OpenMP team's first thread).
# A prefill worker sharing cores runs at nice 19 and yields its core to any busy process, not
# only to the decode worker: beside one busy loop a ~950-token prompt took 60-80 s instead of
# 1-2 (2-core Zen 1). Shorter steps say little (a wake-up, a burst of the gateway's).
STARVED_MIN_S = 0.5
STARVED_SHARE = 0.25
STARVED_LOG_EVERY_S = 60.0


@dataclass
class _Counts:
    prompt_tokens: int = 0
    decoded: int = 0
    blocks_sent: int = 0
    blocks_received: int = 0
    steps: int = 0
    spec_drafts: int = 0
    spec_draft_tokens: int = 0
    spec_accepted_tokens: int = 0
    spec_accepted_per_pos: list[int] = field(default_factory=list)
    tier_stored: int = 0
    tier_loaded: int = 0
    bytes_sent: int = 0
    # a group leader's: what each follower reported it sent (group.py), after its own
    follower_bytes_sent: list[int] = field(default_factory=list)


class Worker:
    # called after each KV send with (send, start, end as time.time(), error or ""): metrics, spans
    on_send: Callable[[KVSend, float, float, str], None] | None = None
    # called after a step's copies to ("store") or from ("load") the second tier with (direction,
    # blocks, start, end as time.time()): metrics, spans
    on_tier_copy: Callable[[str, int, float, float], None] | None = None

    def __init__(self, runner: ModelRunner, cache: PagedKVCache, senders: dict[str, KVSender],
                 receiver: KVReceiver, listeners: dict[str, KVListener],
                 tier: LocalTier | SharedTier | None = None, group_size: int = 1,
                 pipeline: LastStage | None = None, board: CoreBoard | None = None):
        self.runner = runner
        self.cache = cache
        self.tier = tier  # the second KV tier: blocks laid out as the cache's, in host memory
        self.senders = senders
        self.receiver = receiver
        self.listeners = listeners
        self.group_size = group_size  # ranks of its group sharing a plan's threads (group.py)
        self.pipeline = pipeline  # a pipeline group's: the last stage samples for every rank
        self.board = board  # a CPU worker's: which peers sharing its cores step now
        self.yielded = 0  # times a step gave lent cores back to a peer (core_board.py)
        self.taken = 0  # times a step took a quiet peer's cores beyond its plan
        self.starved_s = 0.0  # wall seconds of its steps kept off their core (STARVED_SHARE)
        self._starved_logged = float("-inf")
        self._planned_threads = 0  # the running step's plan's CPU threads (0: not planned)
        self._streamer: LayerStreamer | None = None  # sends of the step that ran last
        self.requests: dict[str, RequestState] = {}
        # block id -> hash of the tokens it holds, as the scheduler announced it, for as long as
        # nothing writes the block again: what a new scheduler's prefix cache starts from
        self.block_hashes: dict[int, bytes] = {}
        self._counts = _Counts(follower_bytes_sent=[0] * (group_size - 1))
        self._decoding: list[str] = []  # requests the running plan's next decode step runs
        # stores ahead, one thread (no second OpenMP team beside the step's on a CPU)
        self._copier = ThreadPoolExecutor(1, thread_name_prefix="kv-tier",
                                          initializer=torch.set_num_threads, initargs=(1,))
        self._ahead: Future[int] | None = None  # the running step's
        self._copy_stream: torch.cuda.Stream | None = None  # its stream, beside a GPU
        self._closed = False

    @property
    def threads(self) -> StepThreads:
        """What the steps compute on, and how many: the runner's."""
        return self.runner.threads

    def reset(self) -> None:
        """Forgets every request: the scheduler that planned them is gone (the cache's content,
        block_hashes, stays for the next one)."""
        self.requests.clear()
        self.receiver.reset()

    def close(self) -> None:
        """Ends what the worker holds outside its process's memory: its shm cache and core
        board segments, the second tier, the senders' connections (the listeners are async:
        their owner closes them); the kernels' pool, where its steps ran on it. Once: a second
        call does nothing."""
        if self._closed:
            return
        self._closed = True
        self.threads.close()
        self.cache.close()
        if self.board is not None:
            self.board.close()
        if self.tier is not None:
            self.tier.close()
        for sender in self.senders.values():
            sender.close()
        self._copier.shutdown(wait=False)

    @property
    def counters(self) -> WorkerCounters:
        """Cumulative, reported to the scheduler with every answer."""
        c = self._counts
        return WorkerCounters(c.prompt_tokens, c.decoded, c.blocks_sent, c.blocks_received,
                              c.steps, c.spec_drafts, c.spec_draft_tokens,
                              c.spec_accepted_tokens, tuple(c.spec_accepted_per_pos),
                              self.receiver.frames_rejected, c.tier_stored, c.tier_loaded,
                              (c.bytes_sent, *c.follower_bytes_sent))

    def followers_sent(self, bytes_sent: list[int]) -> None:
        """A group leader's followers' cumulative KV bytes sent, as they last reported them."""
        self._counts.follower_bytes_sent = list(bytes_sent)

    def execute(self, plan: StepPlan, sub_step: int = 0) -> StepResult:
        """Runs the plan (sub_step 0), or, for a plan of several decode steps, its next one:
        the requests of the step before whose token did not stop them decode again (their
        blocks came with the plan). StepResult.more: call again with sub_step + 1."""
        # per step and on the thread that runs it: torch's thread count is per calling thread
        # (the kernels' pool's, where it runs the steps, is the process's)
        threads = max(1, plan.num_threads // self.group_size)
        if plan.num_threads and threads != self.threads.get():
            self.threads.set(threads)
        self._planned_threads = plan.num_threads
        board = self.board if plan.scheduled else None  # steps that compute tokens
        if board is not None:
            board.stepping(True)
        start, cpu = time.monotonic(), time.thread_time()
        try:
            with on_device(self.cache.tensor.device):
                if sub_step == 0:
                    return self._execute(plan)
                return self._next_step(plan, sub_step)
        finally:
            if board is not None:
                board.stepping(False)
                self._cpu_share(time.monotonic() - start, time.thread_time() - cpu)
            if plan.num_threads and self.threads.get() > threads:
                self.threads.set(threads)  # cores taken go back with the step

    def _cpu_share(self, wall: float, cpu: float) -> None:
        """Counts a step that ran `wall` seconds with its thread on a core for `cpu` of them as
        starved where that is under STARVED_SHARE (and the step STARVED_MIN_S or more), and
        says so in the log at most every STARVED_LOG_EVERY_S."""
        if wall < STARVED_MIN_S or cpu >= STARVED_SHARE * wall:
            return
        self.starved_s += wall
        now = time.monotonic()
        if now - self._starved_logged >= STARVED_LOG_EVERY_S:
            self._starved_logged = now
            niced = os.getpriority(os.PRIO_PROCESS, 0) > 0  # this thread's nice value
            log.warning("a step of %.1f s ran on a core for %.2f s of it: another process is "
                        "busy on this worker's cores%s; give the server cores of its own "
                        "(pdserve up --pin-cpus, --cpu-cores, a cpuset)", wall, cpu,
                        " and this worker, at a lower priority (--cpu-nice), yields them to it"
                        if niced else "")

    def _yield_check(self) -> Callable[[int], None] | None:
        """For a step of a worker sharing its cores with peers (core_board.py), what runs after
        each layer (and now): while a peer sharing them steps, this worker's share of them (at
        most the threads planned); while none does, the threads planned, or every core of its
        share once each peer has been quiet for QUIET_S (a step planned on one core beside a
        busy peer that then went idle); None when there is nothing to give back or take."""
        board = self.board
        planned = self.threads.get()
        # more than planned only where the scheduler splits the cores (it plans thread counts)
        grow = self._planned_threads > 0 and self.group_size == 1
        if board is None or (planned <= 1 and (not grow or len(board.cores) <= 1)):
            return None

        def check(_layer: int = -1) -> None:
            want = min(planned, board.share())
            if grow and want == planned:
                want = max(want, board.share(QUIET_S))
            now = self.threads.get()
            if want != now:
                self.threads.set(want)
                self.yielded += want < min(now, planned)  # lent cores, not taken ones
                self.taken += want > max(now, planned)

        check()
        return check

    def _layer_hook(self) -> Callable[[int], None] | None:
        """What runs after each layer of this step's forward: the layer-wise KV sends, the
        check whether lent cores go back."""
        hooks = [h for h in (self._streamer.on_layer if self._streamer else None,
                             self._yield_check()) if h is not None]
        if len(hooks) < 2:
            return hooks[0] if hooks else None

        def both(layer: int) -> None:
            for h in hooks:
                h(layer)
        return both

    def _next_step(self, plan: StepPlan, sub_step: int) -> StepResult:
        assert self._decoding and sub_step < plan.num_steps, \
            f"step {plan.step_id} has no decode step {sub_step}"
        scheduled = [(self.requests[rid], 1) for rid in self._decoding if rid in self.requests]
        bs = self.cache.layout.block_size
        for r, _ in scheduled:
            self._overwritten(r.block_ids[r.num_computed_tokens // bs:
                                          r.num_computed_tokens // bs + 1])
        out, stats = self.runner.execute(scheduled, self._yield_check())
        self._counts.decoded += stats.decode_tokens
        self._counts.steps += 1
        sampled, errors, _ = self._outcome(out, stats)
        self._decoding = self._go_on(sampled, errors) if sub_step + 1 < plan.num_steps else []
        return StepResult(plan.step_id, tuple(sampled), tuple(errors), self.counters,
                          more=bool(self._decoding))

    def _outcome(self, out, stats) -> Outcome:
        """A step's sampled tokens, errors and prompt logprobs; in a pipeline group the last
        stage's, whose tokens the other stages' ranks append to their requests here."""
        sampled = [SampledToken(s.request_id, s.token_id, s.logprobs) for s in out]
        if self.pipeline is None:
            return sampled, stats.errors, stats.prompt_logprobs
        sampled, errors, prompt_logprobs = self.pipeline.share(sampled, stats.errors,
                                                               stats.prompt_logprobs)
        if not self.pipeline.samples:
            for s in sampled:  # its own requests that reached their last token (not forks)
                r = self.requests.get(s.request_id)
                if r is not None and r.num_computed_tokens == len(r.token_ids):
                    r.token_ids.append(s.token_id)
        return sampled, errors, prompt_logprobs

    def _go_on(self, sampled, errors) -> list[str]:
        """The requests that decode again in a plan's next decode step: those that sampled a
        token which does not stop them, with a block slot for it."""
        failed = {e.request_id for e in errors}
        out = []
        bs = self.cache.layout.block_size
        for s in sampled:
            r = self.requests.get(s.request_id)
            if r is None or r.request_id in failed or not r.is_decode:
                continue
            num_output = len(r.token_ids) - r.num_prompt_tokens
            if not stops(r.sampling, r.eos_token_ids, r.token_ids[-1], num_output) and \
                    len(r.block_ids) * bs >= len(r.token_ids):
                out.append(r.request_id)
        return out

    def _execute(self, plan: StepPlan) -> StepResult:
        if plan.tier_stores or plan.tier_loads:  # before anything writes a block
            self._tier_copies(plan)
        if plan.tier_stores_ahead:
            self._ahead = self._copier.submit(self._store_ahead, plan.tier_stores_ahead)
        try:
            return self._run(plan)
        finally:
            self._join_ahead()

    def _join_ahead(self) -> None:
        """The stores ahead are done when the step answers: the scheduler may reuse the
        blocks after that."""
        if self._ahead is not None:
            ahead, self._ahead = self._ahead, None
            self._counts.tier_stored += ahead.result()

    def _run(self, plan: StepPlan) -> StepResult:
        errors: list[RequestError] = []
        for rid in plan.finished_request_ids:
            self.requests.pop(rid, None)
            self.receiver.cancel_request(rid)
        for recv in plan.recvs:
            self._overwritten(recv.block_ids)
            self.receiver.expect(recv.transfer_id, recv.request_id, list(recv.block_ids),
                                 recv.transport or "shm")
        for new in plan.new_requests:
            self._add(new, errors)
        failed = {e.request_id for e in errors}
        for diff in plan.cached_requests:
            req = self.requests.get(diff.request_id)
            if req is None and diff.request_id in failed:
                continue  # it could not join (its KV never landed): reported already
            assert req is not None, f"diff for unknown request {diff.request_id}"
            req.block_ids.extend(diff.new_block_ids)
            req.token_ids.extend(diff.new_token_ids)
        if plan.copies:
            self._overwritten([c.dst for c in plan.copies])
            self._copy(plan.copies, failed, errors)

        scheduled = [(self.requests[s.request_id], s.num_tokens) for s in plan.scheduled
                     if s.request_id in self.requests]
        lookahead = {s.request_id: s.num_lookahead for s in plan.scheduled if s.num_lookahead}
        bs = self.cache.layout.block_size
        for r, n in scheduled:  # the blocks this forward writes (drafts too)
            last = r.num_computed_tokens + n + lookahead.get(r.request_id, 0) - 1
            self._overwritten(r.block_ids[r.num_computed_tokens // bs:last // bs + 1])
        self._streamer = self._layerwise(plan, scheduled)
        sampled: list[SampledToken] = []
        prompt_logprobs: list[PromptLogprobs] = []
        if scheduled:
            try:
                out, stats = self.runner.execute(scheduled, self._layer_hook(), lookahead)
            except BaseException:
                if self._streamer is not None:
                    self._streamer.abort()
                raise
            sampled, step_errors, prompt_logprobs = self._outcome(out, stats)
            errors.extend(step_errors)
            self._counts.prompt_tokens += stats.prompt_tokens
            self._counts.decoded += stats.decode_tokens
            self._count_speculation(stats)
        self._counts.steps += 1
        # after this step's writes: the plan announces the blocks it computes, among others,
        # but not those of a request that could not join (its KV never landed)
        unwritten = {b for new in plan.new_requests if new.request_id in failed
                     for b in new.block_ids}
        self.block_hashes.update((b, h) for b, h in plan.cached_blocks if b not in unwritten)
        self._decoding = self._go_on(sampled, errors) if plan.num_steps > 1 else []
        self._join_ahead()
        return StepResult(plan.step_id, tuple(sampled), tuple(errors), self.counters,
                          tuple(prompt_logprobs), more=bool(self._decoding))

    def _tier_copies(self, plan: StepPlan) -> None:
        """Blocks the plan reuses into the second tier, then prefix hits back from it."""
        if self.tier is None:
            raise ValueError(f"step {plan.step_id} copies KV to a second tier this worker lacks")
        if plan.tier_stores:
            self._counts.tier_stored += self._store(plan.tier_stores, "store")
        if plan.tier_loads:
            start = time.time()
            slots, blocks = zip(*plan.tier_loads)
            self._overwritten(blocks)
            copy_blocks(self.cache.tensor, blocks, self.tier.tensor, slots)
            self._counts.tier_loaded += len(blocks)
            self._tier_copied("load", len(blocks), start)

    def _store_ahead(self, copies: list[tuple[int, int]]) -> int:
        """Free cached blocks next in line for eviction into the tier, on a thread of its own
        (a stream of its own beside a GPU) while the step computes: nothing writes them before
        the step has answered."""
        device = self.cache.tensor.device
        if device.type != "cuda":
            return self._store(copies, "store_ahead")
        if self._copy_stream is None:
            self._copy_stream = torch.cuda.Stream(device)
        with on_device(device), torch.cuda.stream(self._copy_stream):
            return self._store(copies, "store_ahead")

    def _store(self, copies: list[tuple[int, int]], direction: str) -> int:
        """(block, slot) copies into the tier; how many."""
        assert self.tier is not None, "stores for a worker without a tier"
        start = time.time()
        blocks, slots = zip(*copies)
        copy_blocks(self.tier.tensor, slots, self.cache.tensor, blocks)
        self._tier_copied(direction, len(blocks), start)
        return len(blocks)

    def _tier_copied(self, direction: str, blocks: int, start: float) -> None:
        if self.cache.tensor.device.type == "cuda":  # the copy's time, not its launch
            torch.cuda.current_stream(self.cache.tensor.device).synchronize()
        if self.on_tier_copy is not None:
            self.on_tier_copy(direction, blocks, start, time.time())

    def _count_speculation(self, stats) -> None:
        c = self._counts
        c.spec_drafts += stats.spec_drafts
        c.spec_draft_tokens += stats.spec_draft_tokens
        c.spec_accepted_tokens += stats.spec_accepted_tokens
        per_pos = stats.spec_accepted_per_pos
        c.spec_accepted_per_pos += [0] * (len(per_pos) - len(c.spec_accepted_per_pos))
        for j, n in enumerate(per_pos):
            c.spec_accepted_per_pos[j] += n

    def _overwritten(self, block_ids) -> None:
        for b in block_ids:
            self.block_hashes.pop(b, None)

    def ready_sends(self, plan: StepPlan) -> list[KVSend]:
        """The plan's sends of prompts that earlier steps finished computing, taken out of it:
        they go before its forward (send_kv), the rest once its StepResult went out."""
        scheduled = {s.request_id for s in plan.scheduled}
        ready = [s for s in plan.sends if s.request_id not in scheduled]
        if ready:
            plan.sends = [s for s in plan.sends if s.request_id in scheduled]
        return ready

    def send_kv(self, sends: list[KVSend]) -> TransfersDone:
        """Runs (or finishes, for those streamed layer by layer) KV sends: a plan's ready ones
        before its forward, the others after its StepResult went out."""
        with on_device(self.cache.tensor.device):
            return self._send_kv(sends)

    def _send_kv(self, sends: list[KVSend]) -> TransfersDone:
        streamed = self._streamer.finish() if self._streamer is not None else {}
        self._streamer = None
        done = [self._timed_send(send) if (stream := streamed.get(send.transfer_id)) is None
                else self._streamed(stream) for send in sends]
        return TransfersDone(tuple(done), self.counters)

    def _layerwise(self, plan: StepPlan, scheduled) -> LayerStreamer | None:
        """Sends of prompts whose last chunk this step computes start during its forward."""
        completing = {r.request_id for r, n in scheduled
                      if r.num_computed_tokens + n == len(r.token_ids)}
        sends = [(s, self.senders[s.transport]) for s in plan.sends
                 if s.request_id in completing and s.transport in self.senders]
        return LayerStreamer(self.cache, sends) if sends else None

    def _streamed(self, stream) -> TransferDone:
        send = stream.send
        if self.on_send is not None:
            self.on_send(send, stream.start, stream.end, stream.error)
        if stream.error:
            log.warning("KV transfer %s failed: %s", send.transfer_id, stream.error)
            return TransferDone(send.transfer_id, stream.error)
        self._counts.blocks_sent += len(send.src_block_ids)
        self._counts.bytes_sent += stream.bytes
        return TransferDone(send.transfer_id)

    def _add(self, new: NewRequest, errors: list[RequestError]) -> None:
        if new.kv_transfer_id:
            try:
                self._counts.blocks_received += self.receiver.complete(
                    new.kv_transfer_id, list(new.block_ids))
            except KVTransferError as e:
                errors.append(RequestError(new.request_id, str(e)))
                return
        self.requests[new.request_id] = RequestState(
            request_id=new.request_id,
            token_ids=list(new.all_token_ids),
            num_prompt_tokens=new.num_prompt_tokens,
            num_computed_tokens=new.num_computed_tokens,
            block_ids=list(new.block_ids),
            sampling=new.sampling,
            eos_token_ids=list(new.eos_token_ids),
            forks=list(new.forks),
        )

    def _copy(self, copies: list[BlockCopy], failed: set[str],
              errors: list[RequestError]) -> None:
        """Forks' copies of their leaders' partial blocks; a fork whose leader could not join
        (its KV never landed: in `failed`) fails with it."""
        done = []
        for c in copies:
            if c.leader_id in failed:
                self.requests.pop(c.request_id, None)
                errors.append(RequestError(
                    c.request_id, f"the KV it shares with {c.leader_id} never landed"))
            else:
                done.append(c)
        tensor = self.cache.tensor
        copy_blocks(tensor, [c.dst for c in done], tensor, [c.src for c in done])

    def _timed_send(self, send: KVSend) -> TransferDone:
        if self.on_send is None:
            return self._send(send)
        start = time.time()
        done = self._send(send)
        self.on_send(send, start, time.time(), done.error)
        return done

    def _send(self, send: KVSend) -> TransferDone:
        sender = self.senders.get(send.transport)
        try:
            if sender is None:
                raise KVTransferError(f"this worker does not send over {send.transport!r}")
            self._counts.bytes_sent += sender.send(
                send.transfer_id, self.cache, list(send.src_block_ids), send.dst_endpoint,
                list(send.dst_block_ids))
        except KVTransferError as e:
            log.warning("KV transfer %s failed: %s", send.transfer_id, e)
            return TransferDone(send.transfer_id, str(e))
        self._counts.blocks_sent += len(send.src_block_ids)
        return TransferDone(send.transfer_id)
