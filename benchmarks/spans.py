"""The services' own spans in a benchmark: an OTLP/gRPC receiver run in the benchmark's process,
each request's trace, and the phases a timeline draws (request_spans.py, serve.py --spans).

A stack exports to the receiver with `pdserve up --otlp-traces-endpoint http://127.0.0.1:PORT`;
its spans carry wall-clock times, which `attach` turns into seconds on the load client's clock.
"""
from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Callable

import grpc
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc
from opentelemetry.proto.trace.v1.trace_pb2 import Span

from common.tracing import HOLD_TERMS, REQUEST_SPAN

# what a timeline draws of a request, in the order a request meets them
TIMELINE_PHASES = {"scheduler.queue": "queue", "worker.prefill": "prefill",
                   "kv.send": "kv", "worker.decode": "decode"}
EXPORT_DELAY_MS = "200"  # OTEL_BSP_SCHEDULE_DELAY for stacks exporting here: within 0.2 s


class Receiver(trace_service_pb2_grpc.TraceServiceServicer):
    """An OTLP/gRPC trace collector on 127.0.0.1 (port 0: any free one), on its own event loop
    thread."""

    def __init__(self, port: int = 0):
        self.spans: list[tuple[str, Span]] = []  # (service.name, span)
        self._lock = threading.Lock()
        self._loop = asyncio.new_event_loop()
        self._started = threading.Event()
        self._port = port
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()
        assert self._started.wait(30), "the OTLP receiver did not start"

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    async def Export(self, request, context):
        with self._lock:
            for rs in request.resource_spans:
                service = next((a.value.string_value for a in rs.resource.attributes
                                if a.key == "service.name"), "")
                for ss in rs.scope_spans:
                    self.spans.extend((service, s) for s in ss.spans)
        return trace_service_pb2.ExportTraceServiceResponse()

    def _run(self):
        asyncio.set_event_loop(self._loop)
        self._loop.run_until_complete(self._start())
        self._started.set()
        self._loop.run_forever()

    async def _start(self):
        self._server = grpc.aio.server()
        trace_service_pb2_grpc.add_TraceServiceServicer_to_server(self, self._server)
        self.port = self._server.add_insecure_port(f"127.0.0.1:{self._port}")
        await self._server.start()

    def snapshot(self) -> list[tuple[str, Span]]:
        with self._lock:
            return list(self.spans)

    def take(self) -> list[tuple[str, Span]]:
        """The spans received since the last take (or the start), no longer kept here."""
        with self._lock:
            spans, self.spans = self.spans, []
            return spans

    def close(self):
        asyncio.run_coroutine_threadsafe(self._server.stop(0), self._loop).result(10)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(10)


def attributes(span: Span) -> dict:
    out = {}
    for a in span.attributes:
        kind = a.value.WhichOneof("value")
        out[a.key] = getattr(a.value, kind) if kind else None
    return out


def request_traces(spans: list[tuple[str, Span]]) -> list[dict]:
    """One entry per completed request (a trace with the scheduler's request span), in order of
    arrival: its root's start (ns) and its spans as (service, name, start ms, end ms, attrs)
    from that start."""
    by_trace: dict[bytes, list[tuple[str, Span]]] = {}
    for svc, s in spans:
        by_trace.setdefault(s.trace_id, []).append((svc, s))
    out = []
    for group in by_trace.values():
        if not any(s.name == REQUEST_SPAN and svc == "pdserve-scheduler" for svc, s in group):
            continue
        roots = [s for _, s in group if not s.parent_span_id]
        t0 = min(s.start_time_unix_nano for s in roots or [s for _, s in group])
        rows = [(svc, s.name, (s.start_time_unix_nano - t0) / 1e6,
                 (s.end_time_unix_nano - t0) / 1e6, attributes(s)) for svc, s in group]
        out.append({"start_ns": t0, "spans": sorted(rows, key=lambda r: r[2])})
    return sorted(out, key=lambda t: t["start_ns"])


def hold_terms(trace: dict) -> list[float]:
    """The scheduler's price of holding a long prompt beside a decode worker's batch, from the
    placement that decided where it went: the seconds the batch would lose, those the decode
    worker would take, those the prompt would gain there, the prefill workers' load; [] where
    the placement priced no hold."""
    for r in trace["spans"]:
        if r[1] == "scheduler.placement" and HOLD_TERMS[1] in r[4]:
            return [r[4][k] for k in HOLD_TERMS]
    return []


def request_id(trace: dict) -> str:
    """The scheduler's id of a trace's request ('' if no span names it)."""
    return next((r[4]["pdserve.request_id"] for r in trace["spans"]
                 if "pdserve.request_id" in r[4]), "")


def phases(trace: dict, sent_unix: float, sent: float) -> list[list]:
    """A trace's timeline phases as [phase, start, end, where, tokens, threads], times in
    seconds on the client's clock (the request was sent at `sent` there, at `sent_unix`
    wall-clock time): the queue, each prefill step ("prefill" on its prefill worker, "local"
    on the worker that decodes it; with its prompt tokens and the CPU threads the scheduler
    gave it, 0 where unset), the KV send, the decode."""
    placement: dict = next((r[4] for r in trace["spans"] if r[1] == "scheduler.placement"), {})
    decoder = placement.get("pdserve.decode_worker", "")
    shift = trace["start_ns"] / 1e9 - sent_unix + sent
    out = []
    for _, name, start, end, attrs in trace["spans"]:
        phase = TIMELINE_PHASES.get(name)
        if phase is None:
            continue
        where = attrs.get("pdserve.worker_id", "")
        if phase == "prefill" and where and where == decoder:
            phase = "local"
        out.append([phase, shift + start / 1000, shift + end / 1000, where,
                    attrs.get("pdserve.tokens", 0), attrs.get("pdserve.threads", 0)])
    return out


# once every request's decode is in, no span for this long: the rest is not coming (a prompt
# cached but for its last token has no prefill step; its one token is counted as decode)
SETTLE_S = 2.0


def decoded(trace: dict) -> bool:
    """Whether a request's trace holds its decode (the decode worker exports it at the end)."""
    return any(r[1] == "worker.decode" for r in trace["spans"])


def complete(trace: dict) -> bool:
    """Whether a request's trace holds its decode and the prefill step that sampled its first
    token (its prompt's last chunk): each service exports on its own schedule, and a prefill
    worker at a low CPU priority (`--cpu-nice`) may export its steps, and its KV sends, after
    the decode worker has exported the whole decode."""
    return decoded(trace) and any(
        r[1] == "worker.prefill" and r[4].get("pdserve.sampled") for r in trace["spans"])


def wait_complete(received: Callable[[], list[tuple[str, Span]]],
                  pick: Callable[[list[dict]], list[dict]], n: int,
                  timeout_s: float) -> tuple[list[dict], list[dict]]:
    """Polls received() (every span received so far) until pick (the traces waited for, each
    holding its decode) gives n traces and either every one is `complete` or SETTLE_S has passed
    without a new span, or until timeout_s; returns the last poll's request traces and pick's."""
    now = time.monotonic()
    deadline, last_span, seen = now + timeout_s, now, 0
    while True:
        spans = received()
        now = time.monotonic()
        if len(spans) > seen:
            seen, last_span = len(spans), now
        traces = request_traces(spans)
        picked = pick(traces)
        settled = now - last_span >= SETTLE_S
        if len(picked) >= n and (settled or all(complete(t) for t in picked)) \
                or now > deadline:
            return traces, picked
        time.sleep(0.3)


def attach(records: list, receiver: Receiver, timeout_s: float = 10.0) -> int:
    """Gives each record (loadgen.Record with its response id) the phases of its request's
    trace, once the services have exported them (`wait_complete`; past timeout_s, the traces
    that hold their decode with what has come of them); returns how many found theirs. It takes
    the receiver's spans: a run's spans are read once, not again with each later run's (a
    warm-up request's, or one's that came too late, are dropped)."""
    want = {r.id for r in records if r.id and not r.error}
    taken: list[tuple[str, Span]] = []

    def received() -> list[tuple[str, Span]]:
        taken.extend(receiver.take())
        return taken

    _, found = wait_complete(
        received, lambda traces: [t for t in traces if request_id(t) in want and decoded(t)],
        len(want), timeout_s)
    by_id = {request_id(t): t for t in found}
    for r in records:
        if r.id in by_id:
            r.phases = phases(by_id[r.id], r.sent_unix, r.start)
            r.hold = hold_terms(by_id[r.id])
    return len(by_id)
