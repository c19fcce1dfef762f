"""Tracing off by default, the /metrics server, and the scheduler's metric sources, in process."""
import asyncio

import httpx
import pytest
from prometheus_client import CollectorRegistry, Counter
from prometheus_client.parser import text_string_to_metric_families

from common import tracing
from common.kv_layout import KVLayout
from common.metrics import start_metrics_server
from common.plans import Registration
from services.scheduler.config import SchedulerConfig
from services.scheduler.kv_cache_manager import KVCacheManager
from services.scheduler.scheduler import Scheduler
from services.scheduler.telemetry import SchedulerTelemetry


@pytest.fixture
def no_otel_env(monkeypatch):
    for name in ("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", "OTEL_EXPORTER_OTLP_ENDPOINT"):
        monkeypatch.delenv(name, raising=False)


def test_endpoint_from_flag_then_env(no_otel_env, monkeypatch):
    assert tracing.resolve_endpoint(None) is None
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", "collector:4317")
    assert tracing.resolve_endpoint(None) == "http://collector:4317"  # bare: plaintext
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", "https://traces:4317")
    assert tracing.resolve_endpoint(None) == "https://traces:4317"
    assert tracing.resolve_endpoint("http://flag:4317") == "http://flag:4317"


def test_without_an_endpoint_nothing_is_installed(no_otel_env):
    assert tracing.setup_tracing("pdserve-test", None) is False
    assert not tracing.enabled()
    assert tracing.aio_client_interceptors() == []
    assert tracing.aio_server_interceptors(("Generate",)) == []
    assert tracing.start_span("x") is None
    with tracing.span("x"), tracing.use_span(None):
        pass


def test_the_gateways_client_traces_requests_but_not_its_long_lived_streams():
    """The filter of the gateway's client interceptor: Generate and Abort get a span; the
    health Watch and the Session stream (each as long-lived as the gateway) do not."""
    import grpc

    from services.gateway.scheduler_client import SESSION_METHOD
    traced = tracing.client_filter(untraced=(SESSION_METHOD,))

    def call(method: str) -> grpc.aio.ClientCallDetails:
        return grpc.aio.ClientCallDetails(method, None, None, None, None)

    assert traced(call("/pdserve.scheduler.Scheduler/Generate"))
    assert traced(call("/pdserve.scheduler.Scheduler/Abort"))
    assert not traced(call("/pdserve.scheduler.Scheduler/Session"))
    assert not traced(call("/grpc.health.v1.Health/Watch"))


def test_metrics_server_answers_get_metrics_only():
    registry = CollectorRegistry()
    Counter("pdserve:things", "Things.", registry=registry).inc(3)

    async def main():
        server, port = await start_metrics_server(registry, "127.0.0.1", 0)
        try:
            async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}") as c:
                ok, missing = await c.get("/metrics"), await c.get("/nope")
        finally:
            server.close()
            await server.wait_closed()
        return ok, missing

    ok, missing = asyncio.run(main())
    assert ok.status_code == 200 and ok.headers["content-type"].startswith("text/plain")
    samples = {s.name: s.value for f in text_string_to_metric_families(ok.text)
               for s in f.samples}
    assert samples["pdserve:things_total"] == 3
    assert missing.status_code == 404


def test_prefix_cache_counts_each_admission_once_in_tokens():
    kv = KVCacheManager(num_blocks=8, block_size=4)
    hashes = [b"a", b"b", b"c"]
    kv.allocate_slots("r1", 10)
    kv.cache_blocks("r1", hashes, 10)
    assert (kv.num_queried_tokens, kv.num_hit_tokens) == (10, 0)
    prefix = kv.find_prefix(hashes, 10)
    kv.find_prefix(hashes, 10)  # probes (placement, lookahead) count nothing
    kv.allocate_slots("r2", 10, prefix)
    assert (kv.num_queried_tokens, kv.num_hit_tokens) == (20, 8)
    kv.allocate_slots("r2", 11)  # growth of a running request is no lookup
    assert kv.num_queried_tokens == 20
    off = KVCacheManager(num_blocks=8, block_size=4, enable_caching=False)
    off.allocate_slots("r", 10)
    assert off.num_queried_tokens == 0


def test_a_shared_tier_counts_its_evictions_once():
    """Two decode workers of a host share one second tier, a third has its own: the shared
    tier's evictions are one sample of their own, not one per worker that maps it."""
    sched = Scheduler(SchedulerConfig())
    layout = KVLayout(num_layers=1, num_kv_heads=1, head_dim=4, block_size=4, dtype="float32")

    def join(worker_id, tier_id):
        return sched.add_worker(Registration(
            worker_id=worker_id, role="decode", model_fingerprint="m", num_blocks=10,
            layout=layout, transports=("shm",), kv_endpoints={"shm": worker_id},
            num_tier_blocks=2, tier_id=tier_id))
    x, y, own = join("x", "host-a"), join("y", "host-a"), join("o", "")
    assert x.kv.tier is y.kv.tier is not own.kv.tier
    for tier, worker, n in ((x.kv.tier, "x", 5), (own.kv.tier, "o", 3)):
        for i in range(n):  # one block each, every step answered: n - 2 evictions
            slot = tier.store(bytes([i]) * 16, worker)
            tier.seal(("step", i), worker, [slot], [])
            tier.done(("step", i))
    samples = {(s.name, tuple(sorted(s.labels.items()))): s.value
               for f in SchedulerTelemetry(sched).registry.collect() for s in f.samples}
    evictions = {k: v for k, v in samples.items() if "tier_evictions_total" in k[0]}
    assert evictions == {
        ("pdserve:kv_shared_tier_evictions_total", (("tier_id", "host-a"),)): 3,
        ("pdserve:kv_tier_evictions_total", (("role", "decode"), ("worker_id", "o"))): 1}
    sched.remove_worker("x")
    sched.remove_worker("y")  # the last one mapping it: the tier goes, its counter with it
    assert not any(f.name == "pdserve:kv_shared_tier_evictions" and f.samples
                   for f in SchedulerTelemetry(sched).registry.collect())


def test_scheduler_metrics_read_its_state():
    sched = Scheduler(SchedulerConfig())
    w = sched.add_worker(Registration(
        worker_id="d0", role="decode", model_fingerprint="m", num_blocks=10,
        layout=KVLayout(num_layers=1, num_kv_heads=1, head_dim=4, block_size=4, dtype="float32"),
        transports=("shm",), kv_endpoints={"shm": "x"}))
    w.kv.allocate_slots("r", 12)  # 3 of 10 blocks
    telemetry = SchedulerTelemetry(sched)
    samples = {(s.name, tuple(sorted(s.labels.items()))): s.value
               for f in telemetry.registry.collect() for s in f.samples}
    key = (("role", "decode"), ("worker_id", "d0"))
    assert samples["pdserve:kv_cache_usage_perc", key] == pytest.approx(0.3)
    assert samples["pdserve:prefix_cache_queries_total", key] == 12
    assert samples["pdserve:num_requests_waiting", ()] == 0
    assert samples["pdserve:num_preemptions_total", ()] == 0
    assert samples["pdserve:decode_worker_long_prefills_total", ()] == 0
    assert samples["pdserve:decode_worker_long_prefills_taken_back_total", ()] == 0
    assert samples["pdserve:decode_worker_long_prefills_left_total", ()] == 0
    assert samples["pdserve:prefill_long_load", ()] == 0  # no prefill worker's speed measured
    assert samples["pdserve:worker_prefill_seconds_per_token", key] == 0  # none timed yet
    w.prefill_speed.observe(32, 0.064)
    samples = {(s.name, tuple(sorted(s.labels.items()))): s.value
               for f in telemetry.registry.collect() for s in f.samples}
    assert samples["pdserve:worker_prefill_seconds_per_token", key] == pytest.approx(0.002)
    assert not telemetry.active  # no metrics server, no tracing: per-request hooks do nothing


def test_a_prompt_taken_back_is_placed_again_in_its_trace(monkeypatch):
    """The request's span and a second scheduler.placement span say where a long prompt went
    when a prefill worker took it back from the decode worker prefilling it."""
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import SimpleSpanProcessor
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

    from tests.policy.harness import Cluster

    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    monkeypatch.setattr(tracing, "_enabled", True)
    monkeypatch.setattr(tracing, "tracer", lambda: provider.get_tracer("pdserve"))
    c = Cluster({"p0": 64, "d0": 64}, prefill_bypass_threshold=4, decode_prefill_tokens=8,
                max_num_batched_tokens=8, max_num_partial_prefills=1, prefill_take_back=True)
    telemetry = SchedulerTelemetry(c.sched)
    schedule = c.sched.schedule

    def traced_schedule(wid):
        plan = schedule(wid)
        telemetry.on_plan(wid, plan, 0.0)
        return plan
    c.sched.schedule = traced_schedule
    c.sched.workers["p0"].prefill_speed.seconds_per_token = 0.001
    spans = {}
    for rid, first, n in (("long1", 100, 20), ("long2", 200, 96)):
        c.submit(rid, list(range(first, first + n)), max_tokens=2)
        spans[rid] = tracing.start_span("request")
        telemetry.on_generate(c.sched.requests[rid], span=spans[rid])
        c.plan("p0" if rid == "long1" else "d0")  # d0 takes long2 beside p0's long1
    c.run_step("d0")
    c.now = 0.024  # d0's pace on long2: 3 ms a token, p0 would be sooner
    for _ in range(2):  # p0's second chunk of long1, then its last one and long2's fill
        c.run_step("p0")
        c.plan("p0")
    for _ in range(3):  # the fill lands, and p0 takes long2 over
        c.now += 0.024
        c.step()
    c.run()
    assert c.sched.num_long_prefills_taken_back == 1
    tracing.end_span(spans["long2"])
    placed = [dict(s.attributes) for s in exporter.get_finished_spans()
              if s.name == "scheduler.placement"]
    # long1 on p0; long2 on d0 beside its batch, then on p0 again, its KV for d0
    assert [(a["pdserve.prefill_worker"], a["pdserve.decode_worker"], a["pdserve.taken_back"],
             a["pdserve.disaggregated"]) for a in placed] == [
        ("p0", "d0", False, True), ("d0", "d0", False, False), ("p0", "d0", True, True)]
    request = next(s for s in exporter.get_finished_spans() if s.name == "request")
    assert request.attributes["pdserve.prefill_worker"] == "p0"
    assert request.attributes["pdserve.taken_back"] is True


def test_a_long_prompt_left_to_a_prefill_worker_is_counted_and_traced(monkeypatch):
    """The priced case where d0's batch would lose more than the prompt gains: the counter,
    the load gauge, and `pdserve.hold_declined` with the terms on its placement span."""
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import SimpleSpanProcessor
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

    from tests.policy.test_flow import _priced

    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    monkeypatch.setattr(tracing, "_enabled", True)
    monkeypatch.setattr(tracing, "tracer", lambda: provider.get_tracer("pdserve"))
    c = _priced(share_ms=150, step_ms=1000)
    telemetry = SchedulerTelemetry(c.sched)
    c.submit("long2", list(range(200, 212)), max_tokens=1)
    telemetry.on_generate(c.sched.requests["long2"], span=tracing.start_span("request"))
    telemetry.on_plan("p0", c.plan("p0"), 0.0)
    samples = {s.name: s.value for f in telemetry.registry.collect() for s in f.samples
               if not s.labels}
    assert samples["pdserve:decode_worker_long_prefills_left_total"] == 1
    assert samples["pdserve:decode_worker_long_prefills_total"] == 0
    assert samples["pdserve:prefill_long_load"] == pytest.approx(12 * 0.1 / 20)
    placed = [dict(s.attributes) for s in exporter.get_finished_spans()
              if s.name == "scheduler.placement"]
    assert [(a["pdserve.prefill_worker"], a["pdserve.hold_declined"]) for a in placed] == \
        [("p0", True)]
    # d0 would take 1.2 s; `a` would lose as much and the short requests arriving meanwhile
    # (one in 20 s) 1.2^2 / 2 s at 0.05 a second; long2 would gain 1.8 - 1.2 s, at a load of 0.06
    h = 1.2
    assert (placed[0]["pdserve.hold_loss_s"], placed[0]["pdserve.hold_here_s"],
            placed[0]["pdserve.hold_gain_s"], placed[0]["pdserve.prefill_long_load"]) == \
        pytest.approx((h + 0.05 * h * h / 2, h, 1.8 - h, 0.06))
    c.run()
    c.assert_all_free()
