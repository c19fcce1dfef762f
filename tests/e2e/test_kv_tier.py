"""The second KV tier through the four real processes: a prefix both workers' caches evicted
comes back from the tier their host shares, the tokens stay transformers' greedy ones, and the
hit shows in cached_tokens, in pdserve stats and on the workers' /metrics."""
import re
import time
from pathlib import Path

import httpx

from tests.e2e.conftest import Stack
from tests.e2e.test_metrics import scrape, value
from tests.e2e.test_serve import _complete, _greedy, _prompt, hf  # noqa: F401

BLOCK = 16


def test_an_evicted_prefix_comes_back_from_the_host_tier(tiny_llama, tmp_path, hf):  # noqa: F811
    """24 blocks of 16 tokens per worker; a tier of 0.01 GiB their host shares. It goes with
    the last worker."""
    stack = Stack(tiny_llama, tmp_path, "--num-kv-blocks", "24", "--kv-offloading-size", "0.01",
                  "--kv-offloading-backend", "host")
    try:
        tier = _served_from_the_tier(stack, hf)
    finally:
        stack.stop()
    deadline = time.monotonic() + 10
    while (Path("/dev/shm") / tier).exists() and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not (Path("/dev/shm") / tier).exists()


def _served_from_the_tier(stack, hf) -> str:  # noqa: F811
    prompt = _prompt(200, 40)  # 12 full blocks and 8 tokens
    with httpx.Client(base_url=stack.url, timeout=120) as client:
        first = _complete(client, stack, prompt, max_tokens=6)
        # as long as a worker's cache: every block of the first prompt is evicted on both
        _complete(client, stack, _prompt(360, 41), max_tokens=6)
        again = _complete(client, stack, prompt, max_tokens=6)
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
    return workers[0]["tier_id"]
