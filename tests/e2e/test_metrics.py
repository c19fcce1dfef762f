"""Prometheus metrics end to end: the four real processes (`pdserve up` gives the scheduler and
the workers free metrics ports and prints them); real traffic moves the numbers as it should."""
import re

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.e2e.conftest import Stack

PROMPT_LEN = 40      # two full blocks of 16 and a partial one
MAX_TOKENS = 5


@pytest.fixture(scope="module")
def stack(tiny_llama, tmp_path_factory):
    """Every prompt through the prefill worker: with the default placement a decode worker
    prefills a short prompt itself whenever the prefill worker is still busy, and on a loaded
    host that timing would move the per-role counters below."""
    s = Stack(tiny_llama, tmp_path_factory.mktemp("stack"), "--num-kv-blocks", "256",
              "--scheduler-args=--prefill-bypass-threshold 0 --no-saturated-prefill-bypass "
              "--no-shared-cores-prefill-bypass")
    yield s
    s.stop()


@pytest.fixture(scope="module")
def urls(stack) -> dict[str, str]:
    line = re.search(r"pdserve metrics: (.*)", stack.log.read_text()).group(1)
    return dict(item.split("=", 1) for item in line.split())


def scrape(url: str) -> dict[tuple, float]:
    """(sample name, sorted labels) -> value."""
    r = httpx.get(url, timeout=10)
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/plain")
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(r.text) for s in family.samples}


def value(samples: dict, name: str, **labels) -> float:
    """The sum over samples of `name` whose labels include `labels` (0 when none)."""
    return sum(v for (n, ls), v in samples.items()
               if n == name and set(labels.items()) <= set(ls))


def scrape_all(urls: dict[str, str]) -> dict[str, dict]:
    return {name: scrape(url) for name, url in urls.items()}


def _complete(client: httpx.Client, prompt: list[int], **kw) -> dict:
    model = client.get("/v1/models").json()["data"][0]["id"]
    r = client.post("/v1/completions", json={"model": model, "prompt": prompt, "temperature": 0,
                                             "max_tokens": MAX_TOKENS, "ignore_eos": True, **kw})
    assert r.status_code == 200, r.text
    return r.json()


def test_every_service_serves_metrics(urls):
    assert set(urls) == {"gateway", "scheduler", "prefill-worker-0", "decode-worker-0"}
    m = scrape_all(urls)
    reasons = {dict(ls)["finish_reason"] for n, ls in m["gateway"]
               if n == "pdserve:request_success_total"}
    assert reasons == {"stop", "length", "abort", "error"}  # exported before any request
    for name in ("pdserve:num_requests_running", "pdserve:num_requests_waiting",
                 "pdserve:num_preemptions_total", "pdserve:kv_cache_usage_perc",
                 "pdserve:prefix_cache_queries_total", "pdserve:prefix_cache_hits_total",
                 "pdserve:request_queue_time_seconds_count"):
        assert any(n == name for n, _ in m["scheduler"]), name
    for worker in ("prefill-worker-0", "decode-worker-0"):
        assert any(n == "pdserve:worker_steps_total" for n, _ in m[worker])


def test_counts_and_histograms_move_by_the_requests_sent(stack, client, urls):
    before = scrape_all(urls)
    n = 3
    outs = [_complete(client, [1000 + 50 * i + k for k in range(PROMPT_LEN)]) for i in range(n)]
    stats = stack.wait_idle()
    after = scrape_all(urls)

    def delta(service, name, **labels):
        return value(after[service], name, **labels) - value(before[service], name, **labels)

    g = "gateway"
    assert delta(g, "pdserve:request_success_total", finish_reason="length") == n
    assert delta(g, "pdserve:request_success_total") == n
    assert delta(g, "pdserve:time_to_first_token_seconds_count") == n
    assert delta(g, "pdserve:e2e_request_latency_seconds_count") == n
    assert delta(g, "pdserve:e2e_request_latency_seconds_sum") > 0
    # one observation per response after the first: the other MAX_TOKENS - 1 tokens
    assert n <= delta(g, "pdserve:inter_token_latency_seconds_count") <= n * (MAX_TOKENS - 1)
    assert delta(g, "pdserve:prompt_tokens_total") == n * PROMPT_LEN
    assert delta(g, "pdserve:generation_tokens_total") == sum(
        o["usage"]["completion_tokens"] for o in outs) == n * MAX_TOKENS

    s = "scheduler"
    assert delta(s, "pdserve:request_queue_time_seconds_count") == n
    assert value(after[s], "pdserve:num_requests_running") == 0
    assert value(after[s], "pdserve:num_requests_waiting") == 0
    usage = [v for (name, _), v in after[s].items() if name == "pdserve:kv_cache_usage_perc"]
    assert usage == [0.0, 0.0], "every block is free again after completion"
    assert value(after[s], "pdserve:num_preemptions_total") == stats["num_preemptions"]
    assert delta(s, "pdserve:prefix_cache_queries_total", role="prefill") == n * PROMPT_LEN

    p = "prefill-worker-0"
    blocks = delta(p, "pdserve:worker_kv_blocks_sent_total")
    assert blocks == n * 3  # distinct prompts: all three blocks of each travel
    assert delta(p, "pdserve:kv_transfer_seconds_count", transport="shm") == n
    assert delta(p, "pdserve:kv_transfer_bytes_total", transport="shm") > 0
    assert delta(p, "pdserve:kv_transfer_bytes_total") % blocks == 0
    assert delta("decode-worker-0", "pdserve:worker_kv_blocks_received_total") == blocks
    assert delta("decode-worker-0", "pdserve:worker_generation_tokens_total") == \
        n * (MAX_TOKENS - 1)


def test_prefix_hits_increase_on_a_repeated_prompt(stack, client, urls):
    prompt = [2000 + k for k in range(PROMPT_LEN)]
    first = _complete(client, prompt)
    stack.wait_idle()
    before = scrape(urls["scheduler"])
    second = _complete(client, prompt)
    stack.wait_idle()
    after = scrape(urls["scheduler"])
    assert first["usage"].get("prompt_tokens_details", {}) in (None, {}, {"cached_tokens": 0})
    assert second["usage"]["prompt_tokens_details"]["cached_tokens"] == 32
    hits = value(after, "pdserve:prefix_cache_hits_total", role="prefill") - \
        value(before, "pdserve:prefix_cache_hits_total", role="prefill")
    queries = value(after, "pdserve:prefix_cache_queries_total", role="prefill") - \
        value(before, "pdserve:prefix_cache_queries_total", role="prefill")
    assert (hits, queries) == (32, PROMPT_LEN)  # two full blocks; the last token is recomputed
    # the decode worker holds the first request's full blocks too: only the last one travels
    assert value(after, "pdserve:prefix_cache_hits_total", role="decode") - \
        value(before, "pdserve:prefix_cache_hits_total", role="decode") == 32


def test_gauges_follow_a_running_request(stack, client, urls):
    """Scraped while a request streams, then after the client hung up on it (which aborts it).
    It asks for 4000 tokens (nearly all of the 256 blocks), so that it is still running at the
    scrape however slowly a loaded host streams the first one out."""
    model = client.get("/v1/models").json()["data"][0]["id"]
    body = {"model": model, "prompt": [1500 + k for k in range(PROMPT_LEN)], "max_tokens": 4000,
            "ignore_eos": True, "stream": True}
    with client.stream("POST", "/v1/completions", json=body) as r:
        assert r.status_code == 200, r.read()
        lines = r.iter_lines()  # kept: a line iterator dropped closes the stream
        next(line for line in lines if line.startswith("data:"))
        during = scrape(urls["scheduler"])
    assert value(during, "pdserve:num_requests_running") == 1
    assert value(during, "pdserve:kv_cache_usage_perc", role="decode") > 0
    stack.wait_idle()
    after = scrape(urls["scheduler"])
    assert value(after, "pdserve:num_requests_running") == 0
    assert value(after, "pdserve:kv_cache_usage_perc") == 0
