"""OpenTelemetry tracing, off unless an OTLP endpoint is given.

`setup_tracing(service_name, endpoint)` installs a TracerProvider that batches spans to an
OTLP/gRPC collector (Jaeger, the OpenTelemetry Collector, ...) when `--otlp-traces-endpoint` or
OTEL_EXPORTER_OTLP_TRACES_ENDPOINT / OTEL_EXPORTER_OTLP_ENDPOINT is set. Without one nothing is
installed: `enabled()` is False, the helpers below return no-ops and callers skip span work.

How a request's context travels:

    gateway   HTTP server span (FastAPI instrumentation) -> manual spans -> client span
              REQUEST_SPAN
    scheduler server span REQUEST_SPAN = the request's span. On the gateway's Session stream
              (long-lived, one for all its requests) both are made here and the context
              rides in GenerateRequest.trace_context; a Generate call's are the gRPC
              instrumentation's, with the context in the call's metadata
    workers   the request's span context rides in NewRequest.trace_context (the Attach stream
              is long-lived, so per-request context must travel inside the messages)
"""
from __future__ import annotations

import argparse
import contextlib
import os
from collections.abc import Iterator, Mapping, MutableMapping

SERVICE_PREFIX = "pdserve-"
REQUEST_SPAN = "/pdserve.scheduler.Scheduler/Generate"  # as the gRPC instrumentation names it
# a priced hold's attributes on the placement span, in the order of Request.hold_terms
HOLD_TERMS = ("pdserve.hold_loss_s", "pdserve.hold_here_s", "pdserve.hold_gain_s",
              "pdserve.prefill_long_load")
_enabled = False


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--otlp-traces-endpoint", default=None,
                   help="OTLP/gRPC collector for traces, e.g. http://jaeger:4317 (default: "
                        "$OTEL_EXPORTER_OTLP_TRACES_ENDPOINT or $OTEL_EXPORTER_OTLP_ENDPOINT; "
                        "unset: no tracing)")


def resolve_endpoint(endpoint: str | None) -> str | None:
    """The flag, else the standard env vars; a bare host:port means plaintext (http://)."""
    endpoint = (endpoint or os.environ.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT")
                or os.environ.get("OTEL_EXPORTER_OTLP_ENDPOINT"))
    if not endpoint:
        return None
    return endpoint if "://" in endpoint else f"http://{endpoint}"


def setup_tracing(service_name: str, endpoint: str | None) -> bool:
    """Installs the global TracerProvider for `service_name` (e.g. pdserve-scheduler) exporting
    to `endpoint`; returns whether tracing is on. Call once, before building gRPC servers,
    channels or the HTTP app (they pick up interceptors only when tracing is on)."""
    global _enabled
    endpoint = resolve_endpoint(endpoint)
    if endpoint is None:
        return False
    from opentelemetry import trace
    from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter
    from opentelemetry.sdk.resources import SERVICE_NAME, Resource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor

    provider = TracerProvider(resource=Resource.create({SERVICE_NAME: service_name}))
    provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter(endpoint=endpoint)))
    trace.set_tracer_provider(provider)  # its atexit hook flushes what is still batched
    _enabled = True
    return True


def enabled() -> bool:
    return _enabled


def tracer():
    from opentelemetry import trace
    return trace.get_tracer("pdserve")


def span(name: str, attributes: Mapping | None = None, context=None):
    """A current span for a `with` block (never across a yield), or a no-op when tracing is
    off."""
    if not _enabled:
        return contextlib.nullcontext()
    return tracer().start_as_current_span(name, context=context, attributes=attributes)


def start_span(name: str, context=None, attributes: Mapping | None = None,
               start_time_s: float | None = None, kind: str = "internal"):
    """A span the caller ends (`end_span`), not made current: for phases that outlive one
    synchronous block. `start_time_s` is a time.time() value, for spans recorded after the
    fact; `kind`: internal, client or server. None when tracing is off."""
    if not _enabled:
        return None
    from opentelemetry.trace import SpanKind
    start = None if start_time_s is None else int(start_time_s * 1e9)
    return tracer().start_span(name, context=context, attributes=attributes, start_time=start,
                               kind=SpanKind[kind.upper()])


def end_span(span_, end_time_s: float | None = None) -> None:
    if span_ is not None:
        span_.end(None if end_time_s is None else int(end_time_s * 1e9))


def record_span(name: str, start_s: float, end_s: float, context=None,
                attributes: Mapping | None = None) -> None:
    """A finished span from two time.time() values (a phase measured elsewhere)."""
    end_span(start_span(name, context, attributes, start_s), end_s)


@contextlib.contextmanager
def use_span(span_) -> Iterator[None]:
    """Makes span_ current for a synchronous block (e.g. while a gRPC call is created, so that
    its client interceptor parents under span_). A no-op for None."""
    if span_ is None:
        yield
        return
    from opentelemetry import trace
    with trace.use_span(span_, end_on_exit=False):
        yield


def inject(carrier: MutableMapping[str, str], context=None) -> None:
    """Writes the current context, or `context` (W3C traceparent/tracestate), into carrier."""
    from opentelemetry.propagate import inject as _inject
    _inject(carrier, context=context)


def extract(carrier: Mapping[str, str]):
    """The context a carrier holds (None when empty), to parent spans explicitly."""
    if not carrier:
        return None
    from opentelemetry.propagate import extract as _extract
    return _extract(dict(carrier))


def current_span():
    from opentelemetry import trace
    return trace.get_current_span()


def context_of(span_):
    """A context whose current span is span_: the explicit parent of spans made later."""
    from opentelemetry import trace
    return trace.set_span_in_context(span_)


def aio_client_interceptors(untraced: tuple[str, ...] = ()) -> list:
    """Every call but health checks and the `untraced` methods, by name ("Session"): streams
    as long-lived as the caller (a gateway's health Watch, its Session)."""
    if not _enabled:
        return []
    from opentelemetry.instrumentation.grpc import aio_client_interceptors as make
    return make(filter_=client_filter(untraced))


def client_filter(untraced: tuple[str, ...] = ()):
    """aio_client_interceptors' filter: true for the calls it traces."""
    from opentelemetry.instrumentation.grpc import filters
    skip = filters.any_of(filters.health_check(), *map(filters.method_name, untraced))
    return filters.negate(skip)


def aio_server_interceptors(methods: tuple[str, ...]) -> list:
    """A server interceptor tracing only `methods` (long-lived streams like Attach would make
    one span as long as the worker's life)."""
    if not _enabled:
        return []
    from opentelemetry.instrumentation.grpc import aio_server_interceptor, filters
    return [aio_server_interceptor(
        filter_=filters.any_of(*(filters.method_name(m) for m in methods)))]


def instrument_fastapi(app, excluded_urls: str = "health,ready,metrics") -> None:
    """HTTP server spans; no per-message spans (an SSE stream would get one per chunk)."""
    if not _enabled:
        return
    from opentelemetry.instrumentation.fastapi import FastAPIInstrumentor
    FastAPIInstrumentor.instrument_app(app, excluded_urls=excluded_urls,
                                       exclude_spans=["receive", "send"])
