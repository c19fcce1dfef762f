"""The scheduler's metrics and spans, fed by server.py; the policy (scheduler.py) never sees them.

Metrics: gauges and counters are read from the scheduler's state when /metrics is scraped (no
per-step cost); request_queue_time_seconds is observed when a request is first admitted.

Spans, under the request's span (tracing.REQUEST_SPAN: the gRPC server span of a Generate call,
or the span server.py makes for a request on a Session):

    scheduler.queue      arrival -> first admission
    scheduler.placement  the planning call that admitted it; the chosen workers and transport

The request's span context is injected into every NewRequest the workers get (trace_context),
so that their spans join the same trace.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from prometheus_client import CollectorRegistry, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from common import tracing
from common.metrics import LATENCY_BUCKETS, PREFIX
from common.plans import NewRequest, StepPlan
from services.scheduler.prefill import LOAD_WINDOW_S
from services.scheduler.request import Output, Request
from services.scheduler.scheduler import Scheduler

if TYPE_CHECKING:
    from opentelemetry.trace import Span  # only when tracing is on, so imported lazily there


@dataclass
class _Tracked:
    arrival_wall: float
    arrival: float                          # monotonic
    carrier: dict[str, str] = field(default_factory=dict)
    span: Span | None = None                # the request's span (tracing on)
    context: object = None                  # ... as the parent of the spans made here
    admitted: bool = False
    sample: int = 0                         # n > 1: its index; the samples share one span
    output_tokens: int = 0                  # streamed so far


class SchedulerTelemetry:
    def __init__(self, scheduler: Scheduler) -> None:
        self.scheduler = scheduler
        self.registry = CollectorRegistry()
        self.queue_time = Histogram(
            PREFIX + "request_queue_time_seconds",
            "Histogram of time spent in the waiting queue before first admission, in seconds.",
            buckets=LATENCY_BUCKETS, registry=self.registry)
        self.registry.register(_StateCollector(scheduler))
        self.metrics_on = False                 # set when a /metrics server runs
        self._tracked: dict[str, _Tracked] = {}

    @property
    def active(self) -> bool:
        return self.metrics_on or tracing.enabled()

    def on_generate(self, req: Request, sample: int = 0, span=None) -> None:
        """When the request starts; `span`: its span (tracing on), whose attributes describe
        sample 0."""
        if not self.active:
            return
        t = _Tracked(time.time(), time.monotonic(), sample=sample)
        if span is not None and sample:
            t.span = span
        elif span is not None:
            span.set_attributes({"pdserve.request_id": req.request_id,
                                 "pdserve.prompt_tokens": len(req.prompt_token_ids),
                                 "pdserve.max_tokens": req.max_tokens,
                                 "pdserve.priority": req.priority})
            t.span, t.context = span, tracing.context_of(span)
            tracing.inject(t.carrier, t.context)
        self._tracked[req.request_id] = t

    def on_plan(self, worker_id: str, plan: StepPlan | None,
                planned_at: float) -> None:
        """Before the plan goes out: context into its new requests; first admissions."""
        if plan is None or not self._tracked:
            return
        for new in plan.new_requests:
            t = self._tracked.get(new.request_id)
            if t is None:
                continue
            if t.carrier:
                new.trace_context.update(t.carrier)
            req = self.scheduler.requests.get(new.request_id)
            if req is not None and req.taken_back and t.context is not None and \
                    not new.kv_transfer_id:
                self._trace_placement(worker_id, new, req, t, planned_at)  # placed again
            if new.kv_transfer_id or t.admitted:
                continue  # the decode worker taking over, or a request re-queued and resumed
            forks = [self._tracked.get(f.request_id) for f in new.forks]
            for tracked in [t, *filter(None, forks)]:  # samples of one prompt start together
                tracked.admitted = True
                if self.metrics_on:
                    self.queue_time.observe(time.monotonic() - tracked.arrival)
            if t.context is not None:
                tracing.record_span("scheduler.queue", t.arrival_wall, planned_at, t.context)
                if req is not None:
                    self._trace_placement(worker_id, new, req, t, planned_at)

    def _trace_placement(self, worker_id: str, new: NewRequest, req: Request, t: _Tracked,
                         planned_at: float) -> None:
        """A placement span, its attributes on the request's span too: at admission, and
        again when a prefill worker takes the prompt back from a decode worker."""
        now = time.time()
        transfer = self.scheduler.transfers.get(req.transfer_id) if req.transfer_id else None
        attrs = {"pdserve.prefill_worker": req.prefill_worker or worker_id,
                 "pdserve.decode_worker": req.decode_worker or worker_id,
                 "pdserve.cached_tokens": new.num_computed_tokens,
                 "pdserve.transport": getattr(transfer, "transport", "") if transfer else "",
                 "pdserve.disaggregated": transfer is not None,
                 "pdserve.taken_back": req.taken_back,
                 "pdserve.hold_declined": req.hold_declined}
        if req.hold_terms is not None:
            attrs.update(zip(tracing.HOLD_TERMS, req.hold_terms))
        tracing.record_span("scheduler.placement", planned_at, now, t.context, attrs)
        assert t.span is not None, "on_generate sets the span whenever it sets the context"
        t.span.set_attributes(attrs)

    def on_output(self, out: Output) -> None:
        """Each output its stream sends; the last one (a finish) describes it in its span."""
        t = self._tracked.get(out.request_id)
        if t is None:
            return
        t.output_tokens += len(out.token_ids)
        if not out.finish_reason or t.span is None or t.sample:
            return
        t.span.set_attributes({
            "pdserve.output_tokens": t.output_tokens,
            "pdserve.cached_tokens": out.num_cached_tokens,
            "pdserve.finish_reason": out.finish_reason})

    def on_end(self, request_id: str) -> None:
        self._tracked.pop(request_id, None)


class _StateCollector:
    """Gauges and counters read from the scheduler at scrape time."""

    def __init__(self, scheduler: Scheduler) -> None:
        self.scheduler = scheduler

    def collect(self):
        s = self.scheduler
        yield GaugeMetricFamily(PREFIX + "num_requests_running",
                                "Number of requests admitted (prefilling, transferring or "
                                "decoding).", value=s.num_running)
        yield GaugeMetricFamily(PREFIX + "num_requests_waiting",
                                "Number of requests waiting to be admitted.", value=len(s.waiting))
        yield CounterMetricFamily(PREFIX + "num_preemptions",
                                  "Cumulative number of preemptions.", value=s.num_preemptions)
        yield CounterMetricFamily(PREFIX + "decode_worker_long_prefills",
                                  "Long prompts a decode worker prefilled beside its batch: on "
                                  "the cores of an idle prefill worker sharing them, or "
                                  "because it would finish them before a busy one.",
                                  value=s.num_long_prefills_on_decode)
        yield CounterMetricFamily(PREFIX + "decode_worker_long_prefills_taken_back",
                                  "Of those, the ones a prefill worker with nothing left to "
                                  "compute took back because it would finish them sooner.",
                                  value=s.num_long_prefills_taken_back)
        yield CounterMetricFamily(PREFIX + "decode_worker_long_prefills_left",
                                  "Long prompts a decode worker would have prefilled beside "
                                  "its batch but left to a prefill worker: its batch would "
                                  "have lost more time than the prompts gained.",
                                  value=s.num_long_prefills_left)
        yield GaugeMetricFamily(PREFIX + "prefill_long_load",
                                "The prefill workers' load from long prompts: their tokens "
                                f"arrived over the last {LOAD_WINDOW_S:g} s at the measured "
                                "prefill speed (1: as fast as the prefill workers compute "
                                "them; 0 unmeasured).",
                                value=s.prefill.long_load() or 0.0)
        labels = ["worker_id", "role"]
        usage = GaugeMetricFamily(PREFIX + "kv_cache_usage_perc",
                                  "KV-cache usage of a worker: 1 means 100 percent.",
                                  labels=labels)
        queries = CounterMetricFamily(PREFIX + "prefix_cache_queries",
                                      "Prefix cache queries, in queried tokens.", labels=labels)
        hits = CounterMetricFamily(PREFIX + "prefix_cache_hits",
                                   "Prefix cache hits, in cached tokens.", labels=labels)
        running = GaugeMetricFamily(PREFIX + "worker_num_requests",
                                    "Requests holding KV blocks on a worker.", labels=labels)
        speed = GaugeMetricFamily(PREFIX + "worker_prefill_seconds_per_token",
                                  "A worker's measured seconds per prompt token in its steps "
                                  "that prefill (0: none timed yet); long prompts are placed "
                                  "by it.", labels=labels)
        tier_hits = CounterMetricFamily(PREFIX + "kv_tier_hits",
                                        "Prefix hits loaded from a worker's second KV tier "
                                        "(--kv-offloading-size), in tokens; part of "
                                        "prefix_cache_hits.", labels=labels)
        tier_stores = CounterMetricFamily(PREFIX + "kv_tier_stores",
                                          "Blocks the cache evicted into the second tier.",
                                          labels=labels)
        tier_evictions = CounterMetricFamily(PREFIX + "kv_tier_evictions",
                                             "Blocks a worker's own second tier evicted (least "
                                             "recently used) to make room.", labels=labels)
        shared_evictions = CounterMetricFamily(PREFIX + "kv_shared_tier_evictions",
                                               "Blocks a second tier that the workers of a host "
                                               "share evicted (least recently used) to make "
                                               "room: once per tier, not per worker.",
                                               labels=["tier_id"])
        for tier_id, pool in sorted(s.workers.shared_tiers().items()):
            shared_evictions.add_metric([tier_id], pool.num_evicted)
        for w in list(s.workers.values()):
            key = [w.worker_id, w.role]
            usage.add_metric(key, 1.0 - w.kv.num_free_blocks / w.kv.num_blocks)
            queries.add_metric(key, w.kv.num_queried_tokens)
            hits.add_metric(key, w.kv.num_hit_tokens)
            running.add_metric(key, len(w.kv.request_ids()))
            speed.add_metric(key, w.prefill_speed.seconds_per_token)
            if w.kv.tier is not None:
                tier_hits.add_metric(key, w.kv.num_tier_hit_tokens)
                tier_stores.add_metric(key, w.kv.num_tier_stores)
                if not w.tier_id:  # a shared tier's are counted once, above
                    tier_evictions.add_metric(key, w.kv.tier.num_evicted)
        yield from (usage, queries, hits, running, speed, tier_hits, tier_stores, tier_evictions,
                    shared_evictions)
