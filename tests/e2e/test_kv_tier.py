"""The second KV tier through the four real processes: a prefix both workers' caches evicted
comes back from the tier their host shares, the tokens stay transformers' greedy ones, and the
hit shows in cached_tokens, in pdserve stats, on the workers' /metrics and as a kv.tier_load
span in the request's trace."""
import re
import time
from pathlib import Path

import httpx
import pytest

from tests.e2e.conftest import Stack
from tests.e2e.test_metrics import scrape, value
from tests.e2e.test_serve import _complete, _greedy, _prompt, hf  # noqa: F401
from tests.e2e.test_tracing import Receiver, _attrs

BLOCK = 16


def test_an_evicted_prefix_comes_back_from_the_host_tier(tiny_llama, tmp_path, hf):  # noqa: F811
    """24 blocks of 16 tokens per worker; a tier of 0.01 GiB their host shares. It goes with
    the last worker."""
    receiver = Receiver()
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("OTEL_BSP_SCHEDULE_DELAY", "200")  # export within 0.2 s, not 5 s
        stack = Stack(tiny_llama, tmp_path, "--num-kv-blocks", "24", "--kv-offloading-size",
                      "0.01", "--kv-offloading-backend", "host",
                      "--otlp-traces-endpoint", f"http://127.0.0.1:{receiver.port}")
    try:
        tier = _served_from_the_tier(stack, hf, receiver)
    finally:
        stack.stop()
        receiver.close()
    deadline = time.monotonic() + 10
    while (Path("/dev/shm") / tier).exists() and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not (Path("/dev/shm") / tier).exists()


def _served_from_the_tier(stack, hf, receiver) -> str:  # noqa: F811
    prompt = _prompt(200, 40)  # 12 full blocks and 8 tokens
    with httpx.Client(base_url=stack.url, timeout=120) as client:
        first = _complete(client, stack, prompt, max_tokens=6)
        # as long as a worker's cache: every block of the first prompt is evicted on both
        _complete(client, stack, _prompt(360, 41), max_tokens=6)
        again = _again(client, stack, prompt)
    want = _greedy(hf, prompt, 6)
    assert first["choices"][0]["token_ids"] == again["choices"][0]["token_ids"] == want
    assert again["usage"]["prompt_tokens_details"]["cached_tokens"] == 12 * BLOCK
    workers = stack.wait_idle()["workers"]
    assert len({w["tier_id"] for w in workers}) == 1 and workers[0]["tier_id"]
    # the worker that prefilled it loaded what its cache lacked; a decode worker it went to
    # loaded the blocks it lacked too, rather than receive them
    assert max(w["tier_blocks_loaded"] for w in workers) >= 10
    assert sum(w["tier_hit_tokens"] for w in workers) == \
        BLOCK * sum(w["tier_blocks_loaded"] for w in workers)
    assert all(w["num_free_blocks"] == w["num_blocks"] for w in workers)
    line = re.search(r"pdserve metrics: (.*)", stack.log.read_text()).group(1)
    urls = dict(item.split("=", 1) for item in line.split())
    loaded = sum(value(scrape(url), "pdserve:worker_kv_tier_blocks_loaded_total")
                 for name, url in urls.items() if "worker" in name)
    assert loaded == sum(w["tier_blocks_loaded"] for w in workers)
    assert (Path("/dev/shm") / workers[0]["tier_id"]).exists()
    loads = _tier_loads(receiver)
    assert loads and sum(_attrs(s)["pdserve.blocks"] for _, s in loads) >= 10
    return workers[0]["tier_id"]


def _again(client, stack, prompt) -> dict:
    """The prompt again, under a request id of our own (the trace's)."""
    model = client.get("/v1/models").json()["data"][0]["id"]
    r = client.post("/v1/completions", json={
        "model": model, "prompt": prompt, "max_tokens": 6, "temperature": 0,
        "ignore_eos": True, "return_token_ids": True}, headers={"x-request-id": "tier-again"})
    assert r.status_code == 200, r.text
    return r.json()


def _tier_loads(receiver, timeout: float = 30.0) -> list:
    """kv.tier_load spans in the trace of the request sent as x-request-id tier-again."""
    deadline = time.monotonic() + timeout
    while True:
        spans = receiver.snapshot()
        traces = {s.trace_id for _, s in spans
                  if _attrs(s).get("pdserve.client_request_id") == "tier-again"}
        loads = [(svc, s) for svc, s in spans
                 if s.name == "kv.tier_load" and s.trace_id in traces]
        if loads or time.monotonic() > deadline:
            return loads
        time.sleep(0.2)
