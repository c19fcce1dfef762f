"""A worker's metrics and spans, fed by service.py around each step and by Worker.on_send.

Metrics (on --metrics-port): KV bytes and seconds per transport on the sending worker, and the
worker's cumulative counters. Spans (tracing on), each under the request's span whose context
came in NewRequest.trace_context:

    worker.prefill       one per step that computes prompt tokens of the request
    kv.send              prefill worker: the push of the request's blocks to its decode worker
    kv.receive           decode worker: from "expect blocks" until the blocks are in place
    kv.tier_load         its prompt's blocks copied back from the second KV tier
    worker.decode        decode worker: first to last decode step, with the tokens it produced
    worker.decode_step   one per decode step, only with --detailed-traces
"""
from __future__ import annotations

import collections
import time
from dataclasses import dataclass

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import CounterMetricFamily

from common import tracing
from common.metrics import PREFIX, TRANSFER_BUCKETS, start_metrics_server
from common.plans import KVSend, NewRequest, StepPlan, StepResult
from common.worker.worker import Worker


@dataclass
class _Traced:
    context: object                  # the request span's context, parent of spans made here
    decode_start: float = 0.0
    last_step_end: float = 0.0
    decode_tokens: int = 0
    decode_steps: int = 0


class WorkerTelemetry:
    def __init__(self, worker: Worker, worker_id: str, role: str,
                 detailed_traces: bool = False) -> None:
        self.worker = worker
        self.worker_id = worker_id
        self.role = role
        self.detailed = detailed_traces
        self.block_bytes = worker.cache.layout.block_bytes
        self.registry = r = CollectorRegistry()
        self.kv_bytes = Counter(PREFIX + "kv_transfer_bytes",
                                "Bytes of KV cache sent to other workers.", ["transport"],
                                registry=r)
        self.kv_seconds = Histogram(PREFIX + "kv_transfer_seconds",
                                    "Histogram of the time one KV transfer took to send.",
                                    ["transport"], buckets=TRANSFER_BUCKETS, registry=r)
        self.kv_failures = Counter(PREFIX + "kv_transfer_failures",
                                   "KV transfers that failed (recomputed elsewhere).",
                                   ["transport"], registry=r)
        self.tier_seconds = Histogram(PREFIX + "kv_tier_copy_seconds",
                                      "Time a step spent copying KV blocks to (store) or from "
                                      "(load) the second tier before its forward.",
                                      ["direction"], buckets=TRANSFER_BUCKETS, registry=r)
        self.tier_bytes = Counter(PREFIX + "kv_tier_copy_bytes",
                                  "Bytes of KV copied to (store) or from (load) the second tier.",
                                  ["direction"], registry=r)
        r.register(_CountersCollector(worker, worker_id, role))
        self._traced: dict[str, _Traced] = {}
        self._expected: dict[str, tuple[float, int, str]] = {}  # transfer -> since, blocks, tr
        self._step: list[tuple[_Traced, str, int, bool, int]] = []
        self._step_start = 0.0
        self._tier_loading: list[tuple[_Traced, str, int]] = []  # traced requests' loads
        self._tier_load: tuple[float, float] | None = None  # when the step's loads ran
        worker.on_send = self.on_send
        worker.on_tier_copy = self.on_tier_copy

    def reset(self) -> None:
        self._traced.clear()
        self._expected.clear()

    # ---- KV sends (step thread) ------------------------------------------------------------

    def on_send(self, send: KVSend, start: float, end: float, error: str) -> None:
        nbytes = len(send.src_block_ids) * self.block_bytes
        if error:
            self.kv_failures.labels(send.transport).inc()
        else:
            self.kv_bytes.labels(send.transport).inc(nbytes)
            self.kv_seconds.labels(send.transport).observe(end - start)
        t = self._traced.get(send.request_id)
        if t is not None:
            attrs = {"pdserve.request_id": send.request_id, "pdserve.transfer_id": send.transfer_id,
                     "pdserve.transport": send.transport, "pdserve.blocks": len(send.src_block_ids),
                     "pdserve.bytes": nbytes, "pdserve.dst_endpoint": send.dst_endpoint}
            if error:
                attrs["pdserve.error"] = error
            tracing.record_span("kv.send", start, end, t.context, attrs)

    def on_tier_copy(self, direction: str, blocks: int, start: float, end: float) -> None:
        self.tier_seconds.labels(direction).observe(end - start)
        self.tier_bytes.labels(direction).inc(blocks * self.block_bytes)
        if direction == "load":
            self._tier_load = (start, end)

    # ---- steps (event loop; only with tracing on) --------------------------------------------

    def before_step(self, plan: StepPlan) -> None:
        now = time.time()
        for rid in plan.finished_request_ids:
            self._close(rid)
            self._expected.pop(rid, None)  # a prefix fill's, dropped under its transfer id
        for recv in plan.recvs:
            self._expected[recv.transfer_id] = (now, len(recv.block_ids), recv.transport)
        new_by_id = {}
        for new in plan.new_requests:
            context = tracing.extract(new.trace_context)
            if context is None:
                continue
            t = self._traced[new.request_id] = _Traced(context)
            new_by_id[new.request_id] = new
            if new.kv_transfer_id:
                self._received(new, t, now)
        loaded = {b for _, b in plan.tier_loads}
        self._tier_loading = [(self._traced[rid], rid, n) for rid, n in (
            (new.request_id, len(loaded.intersection(new.block_ids))) for new in new_by_id.values())
            if n]
        self._tier_load = None
        self._step = []
        for s in plan.scheduled:
            traced = self._traced.get(s.request_id)
            if traced is None:
                continue
            state = self.worker.requests.get(s.request_id)
            if state is not None:
                computed, total = state.num_computed_tokens, len(state.token_ids)
            elif s.request_id in new_by_id:
                new = new_by_id[s.request_id]
                computed, total = new.num_computed_tokens, len(new.all_token_ids)
            else:
                continue
            is_decode = s.num_tokens == 1 and computed == total - 1
            self._step.append((traced, s.request_id, s.num_tokens, is_decode, computed))
        self._step_start = now

    def _received(self, new: NewRequest, t: _Traced, now: float) -> None:
        since, blocks, transport = self._expected.pop(new.kv_transfer_id, (now, 0, ""))
        tracing.record_span("kv.receive", since, now, t.context, {
            "pdserve.request_id": new.request_id, "pdserve.transfer_id": new.kv_transfer_id,
            "pdserve.transport": transport, "pdserve.blocks": blocks,
            "pdserve.bytes": blocks * self.block_bytes})

    def after_step(self, plan: StepPlan, result: StepResult) -> None:
        end = time.time()
        if self._tier_load is not None:
            for t, rid, blocks in self._tier_loading:
                tracing.record_span("kv.tier_load", *self._tier_load, t.context, {
                    "pdserve.request_id": rid, "pdserve.blocks": blocks,
                    "pdserve.bytes": blocks * self.block_bytes})
        self._tier_loading = []
        sampled = collections.Counter(s.request_id for s in result.sampled)  # several: drafts
        for t, rid, n, is_decode, computed in self._step:
            attrs = {"pdserve.request_id": rid, "pdserve.step_id": plan.step_id,
                     "pdserve.worker_id": self.worker_id}
            if plan.num_threads:  # the CPU threads the scheduler gave the step (cores.py)
                attrs["pdserve.threads"] = plan.num_threads
            if not is_decode:
                attrs.update({"pdserve.tokens": n, "pdserve.computed_tokens": computed,
                              "pdserve.sampled": rid in sampled})
                tracing.record_span("worker.prefill", self._step_start, end, t.context, attrs)
                continue
            if not t.decode_start:
                t.decode_start = self._step_start
            t.last_step_end = end
            t.decode_steps += 1
            t.decode_tokens += sampled[rid]
            if self.detailed:
                attrs["pdserve.batch_size"] = len(plan.scheduled)
                tracing.record_span("worker.decode_step", self._step_start, end, t.context, attrs)
        self._step = []

    def _close(self, rid: str) -> None:
        t = self._traced.pop(rid, None)
        if t is None or not t.decode_start:
            return
        tracing.record_span("worker.decode", t.decode_start, t.last_step_end, t.context, {
            "pdserve.request_id": rid, "pdserve.worker_id": self.worker_id,
            "pdserve.output_tokens": t.decode_tokens, "pdserve.decode_steps": t.decode_steps})


async def start_telemetry(cfg, worker: Worker) -> WorkerTelemetry | None:
    """The worker's telemetry, serving /metrics on cfg.metrics_port; None when neither metrics
    nor tracing is on (then nothing is measured at all)."""
    if not (cfg.metrics_port or tracing.enabled()):
        return None
    telemetry = WorkerTelemetry(worker, cfg.worker_id, cfg.role, cfg.detailed_traces)
    if cfg.metrics_port:
        await start_metrics_server(telemetry.registry, cfg.metrics_host, cfg.metrics_port)
        print(f"pdserve {cfg.role}-worker metrics on "
              f"http://{cfg.metrics_host}:{cfg.metrics_port}/metrics", flush=True)
    return telemetry


class _CountersCollector:
    """The worker's cumulative counters (also reported to the scheduler with every result)."""

    def __init__(self, worker: Worker, worker_id: str, role: str) -> None:
        self.worker = worker
        self.key = [worker_id, role]

    def collect(self):
        c = self.worker.counters
        counters: list[tuple[str, float, str]] = [
            ("worker_prompt_tokens", c.prompt_tokens_computed, "Prompt tokens computed."),
            ("worker_generation_tokens", c.tokens_decoded, "Tokens decoded."),
            ("worker_kv_blocks_sent", c.kv_blocks_sent, "KV blocks sent."),
            ("worker_kv_blocks_received", c.kv_blocks_received, "KV blocks received."),
            ("worker_kv_frames_rejected", c.kv_frames_rejected,
             "KV frames refused on arrival: bad header, authentication tag or payload digest."),
            ("worker_steps", c.steps, "Steps run."),
            ("worker_kv_tier_blocks_stored", c.tier_blocks_stored,
             "KV blocks copied to the second tier (--kv-offloading-size) before the cache "
             "reused them."),
            ("worker_kv_tier_blocks_loaded", c.tier_blocks_loaded,
             "KV blocks copied back from the second tier: prefix hits there.")]
        if self.worker.board is not None:
            counters += [
                ("worker_cpu_cores_yielded", self.worker.yielded,
                 "Times a step gave CPU cores lent to it back mid-step, a peer sharing them "
                 "having started one (it takes them again once the peer's step ends)."),
                ("worker_cpu_cores_taken", self.worker.taken,
                 "Times a step took CPU cores beyond those planned for it (at its start or "
                 "after a layer), every peer sharing them having been quiet for a while "
                 "(core_board.QUIET_S); it gives them back when a peer starts a step, or with "
                 "its end."),
                ("worker_cpu_starved_seconds", self.worker.starved_s,
                 "Wall seconds of steps (of 0.5 s or more) whose thread ran on a core less than "
                 "a quarter of the time: another process busy on the worker's cores. A prefill "
                 "worker sharing cores runs at nice 19 and yields them to any such process.")]
        speculates = bool(self.worker.runner.num_speculative_tokens)
        if speculates:
            counters += [
                ("spec_decode_num_drafts", c.spec_drafts,
                 "Decode rows that verified draft tokens."),
                ("spec_decode_num_draft_tokens", c.spec_draft_tokens, "Draft tokens verified."),
                ("spec_decode_num_accepted_tokens", c.spec_accepted_tokens,
                 "Draft tokens accepted.")]
        for name, value, doc in counters:
            m = CounterMetricFamily(PREFIX + name, doc, labels=["worker_id", "role"])
            m.add_metric(self.key, value)
            yield m
        if not speculates:
            return
        per_pos = CounterMetricFamily(
            PREFIX + "spec_decode_num_accepted_tokens_per_pos",
            "Draft tokens accepted at each position of a step's drafts.",
            labels=["worker_id", "role", "position"])
        accepted = list(c.spec_accepted_per_pos)
        for pos in range(self.worker.runner.num_speculative_tokens):
            per_pos.add_metric([*self.key, str(pos)], accepted[pos] if pos < len(accepted) else 0)
        yield per_pos
