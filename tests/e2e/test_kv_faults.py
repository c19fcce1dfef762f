"""KV transfer faults through the four real processes, over tcp: the transfer is dropped, stalls
past its deadline, has a byte of its payload altered on the way, or its prefill worker is killed
mid-transfer. Each request still completes with HuggingFace's greedy tokens, and every worker's
blocks come back.

The decode worker advertises a proxy in front of its real KV port; the proxy injects the fault.
"""
import asyncio
import os
import signal
import threading
import time

import pytest
import torch
import transformers

from tests.e2e.conftest import Stack, free_port
from tests.e2e.test_serve import _body, _greedy, _prompt


class FaultProxy:
    """Forwards 127.0.0.1:port -> 127.0.0.1:target, unless told to drop, stall or corrupt (flip
    one bit of the next large chunk: KV payload, past the frame's small header)."""

    def __init__(self, target: int):
        self.port, self.target = free_port(), target
        self.mode = "pass"
        self.connections = 0
        self.faults = 0
        self.loop = asyncio.new_event_loop()
        threading.Thread(target=self.loop.run_forever, daemon=True).start()
        asyncio.run_coroutine_threadsafe(self._start(), self.loop).result(10)

    async def _start(self):
        self.server = await asyncio.start_server(self._handle, "127.0.0.1", self.port)

    async def _handle(self, reader, writer):
        self.connections += 1
        up_reader, up_writer = await asyncio.open_connection("127.0.0.1", self.target)

        async def forward(r, w, faults: bool):
            while data := await r.read(1 << 16):
                if faults and self.mode == "drop":  # the line goes dead mid-frame
                    self.faults += 1
                    writer.close()
                    up_writer.close()
                    return
                if faults and self.mode == "stall":  # swallow everything, answer nothing
                    self.faults += 1
                    continue
                if faults and self.mode == "corrupt" and len(data) >= 4096:
                    self.faults += 1
                    self.mode = "pass"  # one bit, once
                    data = data[:-1] + bytes([data[-1] ^ 0x10])
                w.write(data)
                await w.drain()
            w.close()
        await asyncio.gather(forward(reader, up_writer, True), forward(up_reader, writer, False),
                             return_exceptions=True)

    def close(self):
        self.server.close()
        self.loop.call_soon_threadsafe(self.loop.stop)


@pytest.fixture(scope="module")
def hf(tiny_llama):
    return transformers.AutoModelForCausalLM.from_pretrained(tiny_llama, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def faulty(tiny_llama, tmp_path_factory):
    kv_port = free_port()
    proxy = FaultProxy(kv_port)
    tcp = "--kv-transports tcp --kv-transfer-timeout 3"
    stack = Stack(tiny_llama, tmp_path_factory.mktemp("faults"), "--num-kv-blocks", "64",
                  "--prefill-worker-args", tcp,
                  "--decode-worker-args",
                  f"{tcp} --kv-port {kv_port} --kv-advertise-port {proxy.port}")
    yield stack, proxy
    stack.stop()
    proxy.close()


def _generate(stack, prompt, max_tokens=8):
    import httpx
    with httpx.Client(base_url=stack.url, timeout=120) as c:
        name = c.get("/v1/models").json()["data"][0]["id"]
        r = c.post("/v1/completions", json=_body(prompt, model=name, max_tokens=max_tokens))
        assert r.status_code == 200, r.text
        return r.json()["choices"][0]["token_ids"]


def _assert_all_free(stack):
    s = stack.wait_idle(timeout=60)
    for w in s["workers"]:
        assert w["num_free_blocks"] == w["num_blocks"], w
    return s


def _frames_rejected(stack) -> int:
    return sum(int(w.get("kv_frames_rejected", 0)) for w in stack.stats()["workers"])


@pytest.mark.parametrize("mode", ["pass", "drop", "stall", "corrupt"])
def test_transfer_fault_recovers_with_the_same_tokens(faulty, hf, mode):
    stack, proxy = faulty
    proxy.mode = mode
    prompt = _prompt(33, {"pass": 1, "drop": 2, "stall": 3, "corrupt": 4}[mode])
    before, rejected = proxy.faults, _frames_rejected(stack)
    assert _generate(stack, prompt) == _greedy(hf, prompt, 8)
    if mode != "pass":
        assert proxy.faults > before  # the fault was really on the path
    proxy.mode = "pass"
    s = _assert_all_free(stack)
    if mode == "corrupt":  # refused on arrival, counted, recomputed: never decoded from
        assert sum(int(w.get("kv_frames_rejected", 0)) for w in s["workers"]) > rejected


def test_prefill_worker_killed_mid_transfer(faulty, hf):
    stack, proxy = faulty
    proxy.mode = "stall"
    prompt = _prompt(41, 9)
    victim = next(pid for pid, cmd in stack.children().items() if "prefill-worker" in cmd)
    before = proxy.faults

    def kill_when_sending():
        deadline = time.monotonic() + 60
        while proxy.faults == before and time.monotonic() < deadline:
            time.sleep(0.01)
        os.kill(victim, signal.SIGKILL)  # the transfer is in flight: its sender dies
        proxy.mode = "pass"
    killer = threading.Thread(target=kill_when_sending)
    killer.start()
    assert _generate(stack, prompt) == _greedy(hf, prompt, 8)
    killer.join()
    _assert_all_free(stack)
    # the launcher brought a fresh prefill worker up, and the dead one's segment is gone
    deadline = time.monotonic() + 60
    while len(stack.stats()["workers"]) < 2 and time.monotonic() < deadline:
        time.sleep(0.2)
    assert {w["role"] for w in stack.stats()["workers"]} == {"prefill", "decode"}
