"""Where each request's time goes, from its spans: starts `pdserve up` exporting traces to an
OTLP receiver run here, sends prompts one at a time (after the load client's warm-up request),
and prints per request the client's TTFT beside each phase the services traced (tokenize, queue,
placement, prefill steps, KV send and receive, decode steps), as start and end in ms from the
request's arrival at the gateway. A first request slower than the next shows which phase pays.

    .venv/bin/python benchmarks/request_spans.py --model DIR [--up-args "--device cuda"]
        [--prompts 128 128 1024 3000] [--max-tokens 8] [--out FILE.json]
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import shlex
import sys
import tempfile
import threading
import time
from pathlib import Path

import grpc
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc
from opentelemetry.proto.trace.v1.trace_pb2 import Span

REQUEST_SPAN = "/pdserve.scheduler.Scheduler/Generate"
# the phases printed, in the order a request meets them; others are kept in --out only
PHASES = ("gateway.tokenize", "scheduler.queue", "scheduler.placement", "worker.prefill",
          "kv.send", "kv.receive", "worker.decode_step", "worker.decode")


class Receiver(trace_service_pb2_grpc.TraceServiceServicer):
    """An OTLP/gRPC trace collector on 127.0.0.1 (port 0), on its own event loop thread."""

    def __init__(self):
        self.spans: list[tuple[str, Span]] = []  # (service.name, span)
        self._lock = threading.Lock()
        self._loop = asyncio.new_event_loop()
        self._started = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()
        assert self._started.wait(30), "the OTLP receiver did not start"

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
        self.port = self._server.add_insecure_port("127.0.0.1:0")
        await self._server.start()

    def snapshot(self) -> list[tuple[str, Span]]:
        with self._lock:
            return list(self.spans)

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


def phase_table(trace: dict) -> list[str]:
    """A request's phases: each name with its spans' count, first start, last end and summed
    time (ms from the request's arrival at the gateway)."""
    lines = []
    for name in PHASES:
        rows = [r for r in trace["spans"] if r[1] == name]
        if rows:
            busy = sum(end - start for _, _, start, end, _ in rows)
            lines.append(f"    {name:<20} x{len(rows):<3} {rows[0][2]:9.1f} .. "
                         f"{max(r[3] for r in rows):9.1f} ms  ({busy:.1f} ms in them)")
    return lines


def wait_for(receiver: Receiver, n: int, timeout_s: float = 30.0) -> list[dict]:
    """The traces of n requests once each has its spans from the gateway, scheduler and
    workers (spans are exported in batches, a request's last ones after it has ended)."""
    deadline = time.monotonic() + timeout_s
    while True:
        traces = request_traces(receiver.snapshot())
        done = [t for t in traces if {"worker.decode", "gateway.generate"} <=
                {r[1] for r in t["spans"]}]
        if len(done) >= n or time.monotonic() > deadline:
            return traces
        time.sleep(0.3)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", required=True)
    p.add_argument("--up-args", default="", help="more flags for `pdserve up`, one string")
    p.add_argument("--prompts", type=int, nargs="+", default=[128, 128, 1024, 3000],
                   help="prompt lengths in tokens, sent in this order one at a time")
    p.add_argument("--max-tokens", type=int, default=8)
    p.add_argument("--out", type=Path, help="every request's spans as JSON")
    args = p.parse_args()

    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from loadgen import launch, run_load, stop, workload

    receiver = Receiver()
    log = Path(tempfile.gettempdir()) / "pdserve-request-spans.log"
    flags = [*shlex.split(args.up_args), "--detailed-traces",
             "--otlp-traces-endpoint", f"http://127.0.0.1:{receiver.port}"]
    os.environ["OTEL_BSP_SCHEDULE_DELAY"] = "200"  # the services export within 0.2 s
    proc, url, _ = launch(args.model, flags, log)
    try:
        tokens = workload("random", 1, 0)[0] * (max(args.prompts) // 256 + 1)
        prompts = [tokens[i:i + n] for i, n in enumerate(args.prompts)]  # each its own
        records, _ = asyncio.run(run_load(url, prompts, -1, args.max_tokens, 0))
        traces = wait_for(receiver, len(prompts) + 1)
    finally:
        stop([proc])
        receiver.close()
    warm_up = traces[:-len(prompts)]  # the load client's warm-up request's trace comes first
    traces = traces[-len(prompts):]
    if warm_up:  # the first request a fresh stack serves: what start-up left to it shows here
        span = warm_up[0]["spans"]
        print(f"warm-up request: {max(r[3] for r in span):.1f} ms from arrival to its last span")
        print("\n".join(phase_table(warm_up[0])))
    for rec, trace in zip(records, traces):
        print(f"{rec.prompt_tokens} prompt tokens: TTFT {rec.ttft * 1000:.1f} ms (client), "
              f"first gap {rec.gaps[0] * 1000 if rec.gaps else float('nan'):.1f} ms")
        print("\n".join(phase_table(trace)))
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(
            [{"prompt_tokens": r.prompt_tokens, "ttft_ms": r.ttft * 1000,
              "gaps_ms": [g * 1000 for g in r.gaps], "spans": t["spans"]}
             for r, t in zip(records, traces)]
            + [{"warm_up": True, "spans": t["spans"]} for t in warm_up], indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
