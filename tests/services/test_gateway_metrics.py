"""The gateway's /metrics against the fake scheduler: what one request adds."""

from __future__ import annotations

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from services.gateway.tokenizer import Tokenizer
from tests.services.fake_scheduler import fake_gateway

pytestmark = pytest.mark.anyio


def samples(text: str) -> dict[tuple, float]:
    return {(s.name, s.labels.get("finish_reason")): s.value
            for f in text_string_to_metric_families(text) for s in f.samples}


async def test_one_request_moves_the_gateway_metrics(model_dir: str, tokenizer: Tokenizer) -> None:
    async with fake_gateway(model_dir, tokenizer) as gw, \
            httpx.AsyncClient(base_url=gw.url, timeout=30) as client:
        before = samples((await client.get("/metrics")).text)
        r = await client.post("/v1/completions", json={
            "model": model_dir, "prompt": "Hello world", "max_tokens": 4, "stream": True})
        assert r.status_code == 200
        metrics = await client.get("/metrics")
    assert metrics.headers["content-type"].startswith("text/plain")
    after = samples(metrics.text)
    assert before[("pdserve:request_success_total", "length")] == 0
    assert after[("pdserve:request_success_total", "length")] == 1
    assert after[("pdserve:time_to_first_token_seconds_count", None)] == 1
    assert after[("pdserve:e2e_request_latency_seconds_count", None)] == 1
    assert after[("pdserve:generation_tokens_total", None)] == 4
    assert after[("pdserve:prompt_tokens_total", None)] == len(
        tokenizer.encode_batch(["Hello world"], add_special_tokens=True)[0])
