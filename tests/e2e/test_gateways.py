"""Several gateway processes on one port (`pdserve up --gateways 2`): concurrent requests with
the same x-request-id do not collide and give the tokens one gateway gives, both processes
serve, /metrics sums them, and a gateway process killed is replaced while the other serves."""
import json
import os
import shutil
import signal
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest
from prometheus_client import CollectorRegistry, multiprocess

from tests.e2e.conftest import Stack, child_processes

PROMPTS = [f"Request {i} asks for a few tokens" for i in range(16)]


@pytest.fixture(scope="module")
def two(tiny_llama, tmp_path_factory):
    s = Stack(tiny_llama, tmp_path_factory.mktemp("gateways"), "--gateways", "2")
    yield s
    s.stop()


def gateway_children(stack: Stack) -> list[int]:
    """The gateway processes that serve: children of the `pdserve gateway` parent."""
    parents = [pid for pid, cmd in stack.children().items() if " gateway " in f" {cmd} "]
    assert len(parents) == 1, parents
    return sorted(pid for pid, cmd in child_processes(parents[0]).items() if "spawn_main" in cmd)


def finished_by(pid: int, tmp: Path) -> float:
    """Requests process `pid` finished, from its own files in the shared metrics directory."""
    env = dict(e.split("=", 1) for e in
               Path(f"/proc/{pid}/environ").read_bytes().decode().split("\0") if "=" in e)
    mine = tmp / str(pid)
    mine.mkdir(parents=True)
    for f in Path(env["PROMETHEUS_MULTIPROC_DIR"]).glob(f"*_{pid}.db"):
        shutil.copy(f, mine)
    registry = CollectorRegistry()
    multiprocess.MultiProcessCollector(registry, path=str(mine))
    return sum(s.value for m in registry.collect() for s in m.samples
               if s.name == "pdserve:request_success_total")


def complete(url: str, prompt: str) -> tuple[str, list[int]]:
    with httpx.Client(base_url=url, timeout=120) as c:
        r = c.post("/v1/completions", headers={"x-request-id": "same-id"}, json={
            "model": c.get("/v1/models").json()["data"][0]["id"], "prompt": prompt,
            "max_tokens": 8, "temperature": 0, "ignore_eos": True, "return_token_ids": True})
        assert r.status_code == 200, r.text
        return r.headers["x-request-id"], r.json()["choices"][0]["token_ids"]


def test_two_gateway_processes_serve_one_port(stack, two, tmp_path):
    children = gateway_children(two)
    assert len(children) == 2
    want = [complete(stack.url, p)[1] for p in PROMPTS]  # one gateway, same weights
    for attempt in range(3):  # the kernel spreads connections: rounds until both took some
        with ThreadPoolExecutor(16) as pool:
            got = list(pool.map(lambda p: complete(two.url, p), PROMPTS))
        assert [ids for _, ids in got] == want
        assert {rid for rid, _ in got} == {"same-id"}
        served = [finished_by(pid, tmp_path / str(attempt)) for pid in children]
        if all(n >= 1 for n in served):
            break
    assert all(n >= 1 for n in served), served
    text = httpx.get(f"{two.url}/metrics").text
    total = sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
                if line.startswith("pdserve:request_success_total{"))
    assert total == sum(served) >= len(PROMPTS)
    assert two.wait_idle()["num_running"] == 0


def test_a_killed_gateway_process_is_replaced(two):
    victim, other = gateway_children(two)
    os.kill(victim, signal.SIGKILL)
    for prompt in PROMPTS[:4]:  # the other serves meanwhile
        assert complete(two.url, prompt)[0] == "same-id"
    deadline = time.monotonic() + 60
    while (now := gateway_children(two)) == [other] or len(now) < 2:
        assert time.monotonic() < deadline, now
        time.sleep(0.5)
    assert other in now and victim not in now
    with httpx.Client(base_url=two.url, timeout=60) as c:
        deadline = time.monotonic() + 60
        while c.get("/ready").status_code != 200:
            assert time.monotonic() < deadline
            time.sleep(0.5)
        for prompt in PROMPTS[:4]:
            assert complete(two.url, prompt)[0] == "same-id"
    json.loads(httpx.get(f"{two.url}/v1/models").text)
