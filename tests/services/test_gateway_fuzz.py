"""Property-based fuzzing of the gateway through its own OpenAPI schema (schemathesis): generated
bodies, paths and headers for every operation, seeded and bounded. Whatever a client sends, the
answer is never a 5xx, and the gateway keeps serving."""

from __future__ import annotations

import asyncio
import os
import threading
from collections.abc import Iterator

import httpx
import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings

from tests.services.fake_scheduler import fake_gateway

# a deeper run: PDSERVE_FUZZ_EXAMPLES=1000 pytest tests/services/test_gateway_fuzz.py
EXAMPLES_PER_OPERATION = int(os.environ.get("PDSERVE_FUZZ_EXAMPLES", "60"))


@pytest.fixture(scope="module")
def live_gateway(model_dir: str, tokenizer) -> Iterator[str]:
    """The real gateway app against a FakeScheduler, served from a thread of its own (the
    fuzzer's client is synchronous); yields its base URL."""
    loop = asyncio.new_event_loop()
    ready: asyncio.Future[str] = loop.create_future()
    stop = asyncio.Event()

    async def serve() -> None:
        async with fake_gateway(model_dir, tokenizer, max_model_len=256) as gw:
            ready.set_result(gw.url)
            await stop.wait()

    thread = threading.Thread(target=loop.run_until_complete, args=(serve(),), daemon=True)
    thread.start()
    url = asyncio.run_coroutine_threadsafe(asyncio.wait_for(asyncio.shield(ready), 60),
                                           loop).result(90)
    yield url
    loop.call_soon_threadsafe(stop.set)
    thread.join(30)


@pytest.fixture(scope="module")
def api_schema(live_gateway: str):
    return schemathesis.openapi.from_url(f"{live_gateway}/openapi.json")


def _fuzz(operation, base_url: str, sent: dict[str, int]) -> None:
    """EXAMPLES_PER_OPERATION generated cases of one operation; none may get a 5xx."""

    @settings(max_examples=EXAMPLES_PER_OPERATION, derandomize=True, deadline=None,
              suppress_health_check=list(HealthCheck), database=None)
    @given(case=operation.as_strategy())
    def check(case) -> None:
        response = case.call(base_url=base_url, timeout=30)
        sent[operation.label] = sent.get(operation.label, 0) + 1
        assert response.status_code < 500, (
            f"{case.method} {case.formatted_path} -> {response.status_code}: "
            f"{response.text[:500]}\nbody: {case.body!r}")

    check()


def test_no_request_gets_a_server_error(api_schema, live_gateway: str) -> None:
    """Every operation of the schema (Hypothesis driven directly: schemathesis' pytest plugin
    does not load on this pytest)."""
    sent: dict[str, int] = {}
    for result in api_schema.get_all_operations():
        _fuzz(result.ok(), live_gateway, sent)
    print(f"\n{sum(sent.values())} fuzzed requests: {sent}")
    assert len(sent) >= 6  # completions, chat, models, a model, tokenize, detokenize at least


def test_it_still_serves_after_the_fuzzing(live_gateway: str) -> None:
    r = httpx.post(f"{live_gateway}/v1/completions", json={"prompt": "x y", "max_tokens": 2},
                   timeout=30)
    assert r.status_code == 200, r.text
