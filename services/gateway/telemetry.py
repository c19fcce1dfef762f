"""The gateway's metrics (what a client sees: TTFT, inter-token latency, end to end, finish
reasons) and its spans around one Generate stream.

Latencies are measured from the moment a choice's Generate call starts (after tokenization,
like vLLM's arrival time) with the monotonic clock; one observation per scheduler response.
"""
from __future__ import annotations

import time

from prometheus_client import CollectorRegistry, Counter, Histogram

from common import tracing
from common.metrics import ITL_BUCKETS, LATENCY_BUCKETS, PREFIX, TTFT_BUCKETS
from common.sampling_params import GenerateRequest


class GatewayMetrics:
    def __init__(self, model_name: str) -> None:
        self.registry = r = CollectorRegistry()
        labels = ["model_name"]
        self.ttft = Histogram(
            PREFIX + "time_to_first_token_seconds", "Histogram of time to first token in seconds.",
            labels, buckets=TTFT_BUCKETS, registry=r).labels(model_name)
        self.itl = Histogram(
            PREFIX + "inter_token_latency_seconds", "Histogram of inter-token latency in seconds.",
            labels, buckets=ITL_BUCKETS, registry=r).labels(model_name)
        self.e2e = Histogram(
            PREFIX + "e2e_request_latency_seconds",
            "Histogram of end to end request latency in seconds.",
            labels, buckets=LATENCY_BUCKETS, registry=r).labels(model_name)
        self.prompt_tokens = Counter(
            PREFIX + "prompt_tokens", "Number of prefill tokens processed.", labels,
            registry=r).labels(model_name)
        self.generation_tokens = Counter(
            PREFIX + "generation_tokens", "Number of generation tokens processed.", labels,
            registry=r).labels(model_name)
        self._success = Counter(
            PREFIX + "request_success", "Count of finished requests, by finish reason.",
            labels + ["finish_reason"], registry=r)
        self._model_name = model_name
        for reason in ("stop", "length", "abort", "error"):
            self._success.labels(model_name, reason)  # exported at 0 from the start

    def success(self, finish_reason: str) -> None:
        self._success.labels(self._model_name, finish_reason).inc()


class SequenceTelemetry:
    """One choice's Generate stream: metrics always, spans when tracing is on.

        gateway.generate   the stream, from the Generate call to its finish (the gRPC client
                           span of Scheduler.Generate is its child)
        gateway.detokenize first token to finish; attribute: CPU time spent detokenizing
    """

    def __init__(self, metrics: GatewayMetrics | None,
                 request: GenerateRequest, request_id: str,
                 counts_prompt: bool = True) -> None:
        """counts_prompt: false for samples 1.. of a prompt, computed once for all of them."""
        self.metrics = metrics
        self.start = time.monotonic()
        self.last: float | None = None
        self.num_tokens = 0
        self.num_prompt_tokens = len(request.prompt_token_ids)
        self._counts_prompt = counts_prompt
        self.detokenize_s = 0.0
        self._first_wall = 0.0
        self._done = False
        self.span = tracing.start_span("gateway.generate", attributes={
            "pdserve.request_id": request_id,
            "pdserve.prompt_tokens": self.num_prompt_tokens,
            "pdserve.max_tokens": request.sampling.max_tokens,
        })

    @property
    def tracing(self) -> bool:
        return self.span is not None

    def on_tokens(self, n: int) -> None:
        now = time.monotonic()
        if self.metrics is not None:
            if self.last is None:
                self.metrics.ttft.observe(now - self.start)
            elif n:
                self.metrics.itl.observe(now - self.last)
        if self.last is None and self.span is not None:
            self._first_wall = time.time()
        self.last = now
        self.num_tokens += n

    def finish(self, finish_reason: str | None, num_cached_tokens: int = 0) -> None:
        """finish_reason None: the stream failed before any output (the client got an error
        status), which is not a finished request."""
        if self._done:
            return
        self._done = True
        if self.metrics is not None and (finish_reason is not None or self.last is not None):
            self.metrics.e2e.observe(time.monotonic() - self.start)
            self.metrics.success(finish_reason or "abort")
            self.metrics.prompt_tokens.inc(self.num_prompt_tokens if self._counts_prompt else 0)
            self.metrics.generation_tokens.inc(self.num_tokens)
        if self.span is None:
            return
        if self._first_wall:
            tracing.record_span("gateway.detokenize", self._first_wall, time.time(),
                                tracing.context_of(self.span), {
                                    "pdserve.output_tokens": self.num_tokens,
                                    "pdserve.detokenize_cpu_seconds": self.detokenize_s})
        self.span.set_attributes({
            "pdserve.output_tokens": self.num_tokens,
            "pdserve.cached_tokens": num_cached_tokens,
            "pdserve.finish_reason": finish_reason or "abort",
        })
        tracing.end_span(self.span)
