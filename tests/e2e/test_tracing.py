"""Tracing end to end: the four real processes export to an OTLP receiver run by the test, and
one request makes one trace whose spans are parented across every service."""
import time

import httpx
import pytest
from opentelemetry.proto.trace.v1.trace_pb2 import Span

from benchmarks.request_spans import phase_table
from benchmarks.spans import Receiver, request_traces
from benchmarks.spans import attributes as _attrs
from common.tracing import REQUEST_SPAN
from tests.e2e.conftest import Stack

SERVICES = {"pdserve-gateway", "pdserve-scheduler", "pdserve-prefill-worker",
            "pdserve-decode-worker"}
MAX_TOKENS = 6


@pytest.fixture(scope="module")
def traced(tiny_llama, tmp_path_factory):
    receiver = Receiver()
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("OTEL_BSP_SCHEDULE_DELAY", "200")  # export within 0.2 s, not 5 s
        stack = Stack(tiny_llama, tmp_path_factory.mktemp("traced"), "--num-kv-blocks", "64",
                      "--otlp-traces-endpoint", f"http://127.0.0.1:{receiver.port}")
    yield stack, receiver
    stack.stop()
    receiver.close()


def _wait_for(receiver: Receiver, names: set[str], timeout: float = 60.0):
    """Spans once every name was seen from some service, the request's span from both ends
    (the gateway's client span ends first: the scheduler's server span is exported later) and
    the gateway's HTTP server span of the request's trace, its root (it ends after the
    response, so it may be exported after everything inside it)."""
    deadline = time.monotonic() + timeout
    while True:
        spans = receiver.snapshot()
        seen = {s.name for _, s in spans}
        services = {svc for svc, _ in spans}
        request_ends = {svc for svc, s in spans if s.name == REQUEST_SPAN}
        traces = {s.trace_id for _, s in spans if s.name == REQUEST_SPAN}
        root = any(svc == "pdserve-gateway" and not s.parent_span_id and s.trace_id in traces
                   for svc, s in spans)
        if (names <= seen and SERVICES <= services and root and
                {"pdserve-gateway", "pdserve-scheduler"} <= request_ends) \
                or time.monotonic() > deadline:
            return spans
        time.sleep(0.2)


def test_one_request_is_one_trace_across_the_four_services(traced):
    stack, receiver = traced
    prompt = list(range(100, 140))  # 40 tokens: 2 full blocks + a partial one travel
    with httpx.Client(base_url=stack.url, timeout=120) as c:
        model = c.get("/v1/models").json()["data"][0]["id"]
        r = c.post("/v1/completions", json={"model": model, "prompt": prompt,
                                            "max_tokens": MAX_TOKENS, "ignore_eos": True,
                                            "temperature": 0}, headers={"x-request-id": "t-1"})
    assert r.status_code == 200, r.text
    want = {"gateway.generate", "gateway.tokenize", "gateway.detokenize", REQUEST_SPAN,
            "scheduler.queue", "scheduler.placement", "worker.prefill", "kv.send", "kv.receive",
            "worker.decode"}
    spans = _wait_for(receiver, want)
    services = {svc for svc, _ in spans}
    assert SERVICES <= services, services
    assert want <= {s.name for _, s in spans}, sorted({s.name for _, s in spans})
    (trace_id,) = {s.trace_id for _, s in spans if s.name == REQUEST_SPAN}
    others = [(svc, s.name) for svc, s in spans if s.trace_id != trace_id]
    # besides the completion's trace, only the gateway's GET /v1/models (its own trace)
    assert all(svc == "pdserve-gateway" and "/v1/models" in name for svc, name in others), others
    spans = [(svc, s) for svc, s in spans if s.trace_id == trace_id]
    assert {svc for svc, _ in spans} == SERVICES, "one trace id across the four services"

    named = {}
    for svc, s in spans:
        named.setdefault((svc, s.name), []).append(s)

    # gateway: HTTP server span (the root) -> gateway.generate -> gRPC client span
    (http,) = [s for svc, s in spans if svc == "pdserve-gateway" and not s.parent_span_id]
    assert http.kind == Span.SPAN_KIND_SERVER
    (generate,) = named["pdserve-gateway", "gateway.generate"]
    assert generate.parent_span_id == http.span_id
    (client,) = [s for s in named["pdserve-gateway", REQUEST_SPAN]
                 if s.kind == Span.SPAN_KIND_CLIENT]
    assert client.parent_span_id == generate.span_id
    (tokenize,) = named["pdserve-gateway", "gateway.tokenize"]
    assert tokenize.parent_span_id == http.span_id

    # scheduler: the request's span, child of the gateway's client span
    (request,) = named["pdserve-scheduler", REQUEST_SPAN]
    assert request.kind == Span.SPAN_KIND_SERVER and request.parent_span_id == client.span_id
    ra = _attrs(request)
    assert ra["pdserve.prompt_tokens"] == len(prompt)
    # the scheduler's id is the gateway's own; the client's x-request-id is on the HTTP span
    assert ra["pdserve.request_id"] == _attrs(http)["pdserve.request_id"] == \
        _attrs(generate)["pdserve.request_id"]
    assert _attrs(http)["pdserve.client_request_id"] == "t-1"
    assert ra["pdserve.output_tokens"] == MAX_TOKENS and ra["pdserve.finish_reason"] == "length"
    assert ra["pdserve.prefill_worker"] != ra["pdserve.decode_worker"]

    # every phase of the request, in all three backend services, hangs off the request's span
    for svc, name in [("pdserve-scheduler", "scheduler.queue"),
                      ("pdserve-scheduler", "scheduler.placement"),
                      ("pdserve-prefill-worker", "worker.prefill"),
                      ("pdserve-prefill-worker", "kv.send"),
                      ("pdserve-decode-worker", "kv.receive"),
                      ("pdserve-decode-worker", "worker.decode")]:
        found = named.get((svc, name))
        assert found, f"no {name} span from {svc}"
        for s in found:
            assert s.parent_span_id == request.span_id, f"{svc} {name} is not under the request"

    (send,) = named["pdserve-prefill-worker", "kv.send"]
    (recv,) = named["pdserve-decode-worker", "kv.receive"]
    sa, rca = _attrs(send), _attrs(recv)
    assert sa["pdserve.transport"] == ra["pdserve.transport"] != ""
    assert sa["pdserve.blocks"] == rca["pdserve.blocks"] == 3  # 40 tokens in blocks of 16
    assert sa["pdserve.bytes"] == rca["pdserve.bytes"] > 0
    assert recv.end_time_unix_nano >= send.end_time_unix_nano - 50_000_000  # clocks of 1 host
    (decode,) = named["pdserve-decode-worker", "worker.decode"]
    # the prefill worker samples the first token, the decode worker the rest
    assert _attrs(decode)["pdserve.output_tokens"] == MAX_TOKENS - 1
    assert sum(_attrs(s)["pdserve.tokens"] for s in named["pdserve-prefill-worker",
                                                           "worker.prefill"]) == len(prompt)
    assert "worker.decode_step" not in {s.name for _, s in spans}  # only with --detailed-traces

    # benchmarks/request_spans.py reads the same spans as one request's phases, in order
    (trace,) = request_traces(spans)
    times = [(name, start, end) for _, name, start, end, _ in trace["spans"]]
    assert all(0 <= start <= end for _, start, end in times)
    table = phase_table(trace)
    assert [line.split()[0] for line in table] == [
        "gateway.tokenize", "scheduler.queue", "scheduler.placement", "worker.prefill",
        "kv.send", "kv.receive", "worker.decode"]
