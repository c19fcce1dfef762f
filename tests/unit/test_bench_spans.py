"""benchmarks/spans.py's attach, and benchmarks/request_spans.py's wait_for: a request's phases
wait for every service's spans, the prefill steps of a prefill worker that exports after the
decode worker included, and no longer than SETTLE_S for a request with no prefill step; spans
sent over OTLP/gRPC to the benchmark's own receiver."""
import threading
import time

import grpc
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc
from opentelemetry.proto.common.v1.common_pb2 import AnyValue, KeyValue
from opentelemetry.proto.resource.v1.resource_pb2 import Resource
from opentelemetry.proto.trace.v1.trace_pb2 import ResourceSpans, ScopeSpans, Span

from benchmarks.loadgen import Record
from benchmarks.request_spans import wait_for
from benchmarks.serve import long_prompts
from benchmarks.spans import SETTLE_S, Receiver, attach, hold_terms, phases
from common.tracing import REQUEST_SPAN

TRACE = bytes(range(16))
ROOT = b"\x01" * 8
T0 = 1_700_000_000_000_000_000  # the request's start, ns since the epoch


def _attr(key: str, value) -> KeyValue:
    if isinstance(value, bool):
        v = AnyValue(bool_value=value)
    elif isinstance(value, int):
        v = AnyValue(int_value=value)
    else:
        v = AnyValue(string_value=value)
    return KeyValue(key=key, value=v)


def _span(name: str, span_id: int, start_ms: float, end_ms: float, **attrs) -> Span:
    root = span_id == 1
    return Span(trace_id=TRACE, span_id=ROOT if root else span_id.to_bytes(8, "big"),
                parent_span_id=b"" if root else ROOT, name=name,
                start_time_unix_nano=T0 + int(start_ms * 1e6),
                end_time_unix_nano=T0 + int(end_ms * 1e6),
                attributes=[_attr(k.replace("_", ".", 1), v) for k, v in attrs.items()])


def _export(port: int, service: str, *spans: Span) -> None:
    with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
        trace_service_pb2_grpc.TraceServiceStub(channel).Export(
            trace_service_pb2.ExportTraceServiceRequest(resource_spans=[ResourceSpans(
                resource=Resource(attributes=[_attr("service.name", service)]),
                scope_spans=[ScopeSpans(spans=list(spans))])]), timeout=10)


def _request(port: int) -> None:
    """A disaggregated request's scheduler and decode worker spans (not its prefill steps)."""
    _export(port, "pdserve-scheduler",
            _span(REQUEST_SPAN, 1, 0, 100, pdserve_request_id="cmpl-1"),
            _span("scheduler.queue", 2, 1, 3),
            _span("scheduler.placement", 3, 3, 4, pdserve_decode_worker="d0"))
    _export(port, "pdserve-decode-worker", _span("worker.decode", 4, 40, 99,
                                                 pdserve_worker_id="d0"))


def _chunk(port: int, span_id: int, start_ms: float, end_ms: float, tokens: int,
           sampled: bool) -> None:
    _export(port, "pdserve-prefill-worker",
            _span("worker.prefill", span_id, start_ms, end_ms, pdserve_worker_id="p0",
                  pdserve_tokens=tokens, pdserve_threads=1, pdserve_sampled=sampled))


def _record() -> Record:
    return Record(prompt_tokens=12, start=2.0, id="cmpl-1", sent_unix=T0 / 1e9)


def _attach(receiver: Receiver, timeout_s: float) -> tuple[Record, float]:
    rec = _record()
    began = time.monotonic()
    assert attach([rec], receiver, timeout_s=timeout_s) == 1
    return rec, time.monotonic() - began


def test_phases_wait_for_the_last_prefill_chunk_exported_after_the_decode():
    receiver = Receiver()
    late = threading.Timer(0.8, _chunk, args=(receiver.port, 6, 20, 30, 5, True))
    try:
        _request(receiver.port)
        _chunk(receiver.port, 5, 5, 20, 7, False)  # the first chunk, in an earlier export
        late.start()
        rec, waited = _attach(receiver, timeout_s=20)
        assert waited >= 0.7  # the prompt's last chunk came after the decode
        assert [p[0] for p in rec.phases] == ["queue", "prefill", "prefill", "decode"]
        last = rec.phases[2]
        assert last[3:] == ["p0", 5, 1]
        # on the client's clock: sent at 2.0 s, the chunk 20-30 ms into the request
        assert abs(last[1] - 2.020) < 1e-6 and abs(last[2] - 2.030) < 1e-6
    finally:
        late.cancel()
        late.join()
        receiver.close()


def test_a_request_with_no_prefill_step_waits_until_the_spans_settle():
    receiver = Receiver()
    try:
        _request(receiver.port)  # its prompt cached but for its last token: decode only
        rec, waited = _attach(receiver, timeout_s=30)
        assert SETTLE_S - 0.1 <= waited < SETTLE_S + 3
        assert [p[0] for p in rec.phases] == ["queue", "decode"]
    finally:
        receiver.close()


def test_past_the_deadline_a_trace_with_its_decode_keeps_what_came():
    receiver = Receiver()
    try:
        _request(receiver.port)
        _chunk(receiver.port, 5, 5, 20, 7, False)
        rec, waited = _attach(receiver, timeout_s=0.5)
        assert 0.4 <= waited < 5
        assert [p[0] for p in rec.phases] == ["queue", "prefill", "decode"]
    finally:
        receiver.close()


def _gateway(port: int) -> None:
    _export(port, "pdserve-gateway", _span("gateway.generate", 7, 0, 101))


def test_the_phase_table_waits_for_the_last_prefill_chunk_exported_after_the_decode():
    receiver = Receiver()
    late = threading.Timer(0.8, _chunk, args=(receiver.port, 6, 20, 30, 5, True))
    try:
        _request(receiver.port)
        _gateway(receiver.port)
        _chunk(receiver.port, 5, 5, 20, 7, False)
        late.start()
        began = time.monotonic()
        (trace,) = wait_for(receiver, 1, timeout_s=20)
        assert time.monotonic() - began >= 0.7
        assert sum(r[1] == "worker.prefill" for r in trace["spans"]) == 2  # both chunks
    finally:
        late.cancel()
        late.join()
        receiver.close()


def test_the_phase_table_of_a_request_with_no_prefill_step_waits_until_the_spans_settle():
    receiver = Receiver()
    try:
        _request(receiver.port)
        _gateway(receiver.port)
        began = time.monotonic()
        (trace,) = wait_for(receiver, 1, timeout_s=30)
        assert SETTLE_S - 0.1 <= time.monotonic() - began < SETTLE_S + 3
        assert {r[1] for r in trace["spans"]} >= {"gateway.generate", "worker.decode"}
    finally:
        receiver.close()


def test_a_priced_placement_puts_its_estimates_beside_the_long_prompt_it_placed():
    """The placement that priced a hold gives the record its terms (the take-back's placement
    after it has none), and the long-prompt table prints the times the scheduler expected on
    the decode worker (here) and on a prefill worker (here + gain) beside the batch's loss."""
    terms = {"pdserve.hold_loss_s": 1.5, "pdserve.hold_here_s": 4.25,
             "pdserve.hold_gain_s": 2.0, "pdserve.prefill_long_load": 0.5}
    trace = {"start_ns": T0, "spans": [
        ("pdserve-scheduler", "scheduler.queue", 1.0, 3.0, {}),
        ("pdserve-scheduler", "scheduler.placement", 3.0, 4.0,
         {"pdserve.decode_worker": "d0", **terms}),
        ("pdserve-scheduler", "scheduler.placement", 900.0, 901.0,
         {"pdserve.decode_worker": "d0", "pdserve.taken_back": True}),
        ("pdserve-decode-worker", "worker.prefill", 5.0, 6000.0,
         {"pdserve.worker_id": "d0", "pdserve.tokens": 3000, "pdserve.threads": 1})]}
    assert hold_terms(trace) == [1.5, 4.25, 2.0, 0.5]
    rec = Record(prompt_tokens=3000, start=2.0, first=8.0, id="cmpl-1", sent_unix=T0 / 1e9,
                 phases=phases(trace, T0 / 1e9, 2.0), hold=hold_terms(trace))
    header, line = long_prompts([rec], 1000)
    assert header.split()[-3:] == ["here", "there", "loss"]
    assert line.split()[-3:] == ["4.25", "6.25", "1.50"]
    assert "x1" in line  # its one step on the decode worker
    unpriced = Record(prompt_tokens=3000, start=2.0, first=8.0, phases=rec.phases)
    assert long_prompts([unpriced], 1000)[1] == line[:line.index("4.25")].rstrip()
