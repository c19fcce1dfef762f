"""A scheduler that restarts: the workers re-dial and register afresh, and serving goes on; under
`pdserve up`, streams in flight go on through it with the tokens of an undisturbed run."""
import json
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import grpc
import torch
import transformers

from protos import scheduler_pb2, scheduler_pb2_grpc
from tests.e2e.conftest import free_port, stop_all, stream_completion
from tests.e2e.test_serve import _greedy, _prompt

PDSERVE = str(Path(sys.executable).parent / "pdserve")


def _stats(addr: str) -> dict:
    out = subprocess.run([PDSERVE, "stats", "--scheduler", addr], capture_output=True, text=True,
                         timeout=30)
    return json.loads(out.stdout) if out.returncode == 0 else {"workers": []}


def _wait_workers(addr: str, n: int, timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    while len(_stats(addr)["workers"]) < n:
        assert time.monotonic() < deadline, "workers did not register"
        time.sleep(0.3)


def _generate(addr: str, prompt: list[int], n: int) -> list[int]:
    with grpc.insecure_channel(addr) as ch:
        stream = scheduler_pb2_grpc.SchedulerStub(ch).Generate(scheduler_pb2.GenerateRequest(
            prompt_token_ids=prompt, sampling=scheduler_pb2.SamplingParams(
                max_tokens=n, ignore_eos=True, logprobs=-1)), timeout=120)
        return [t for r in stream for t in r.token_ids]


def test_workers_reattach_to_a_restarted_scheduler(tiny_llama, tmp_path):
    port = free_port()
    addr = f"127.0.0.1:{port}"
    sched_cmd = [PDSERVE, "scheduler", "--port", str(port)]
    # float32 as the reference, whatever --dtype auto picks on this host
    worker = ["--model", str(tiny_llama), "--scheduler", addr, "--cpu-threads", "1",
              "--num-kv-blocks", "64", "--dtype", "float32"]
    log = open(tmp_path / "log", "w")
    procs = [subprocess.Popen(sched_cmd, stdout=log, stderr=subprocess.STDOUT)]
    try:
        procs += [subprocess.Popen([PDSERVE, role, *worker], stdout=log, stderr=subprocess.STDOUT)
                  for role in ("prefill-worker", "decode-worker")]
        _wait_workers(addr, 2)
        hf = transformers.AutoModelForCausalLM.from_pretrained(tiny_llama, dtype=torch.float32)
        prompt = _prompt(19, 800)
        want = _greedy(hf.eval(), prompt, 6)
        assert _generate(addr, prompt, 6) == want
        procs[0].send_signal(signal.SIGKILL)  # the scheduler dies with everything it knew
        procs[0].wait(10)
        procs[0] = subprocess.Popen(sched_cmd, stdout=log, stderr=subprocess.STDOUT)
        _wait_workers(addr, 2)
        assert _generate(addr, prompt, 6) == want
        s = _stats(addr)
        assert all(w["num_free_blocks"] == w["num_blocks"] for w in s["workers"])
    finally:
        stop_all(procs)


def _stream(url: str, i: int, on_tokens=None) -> tuple[list[int], list[float]]:
    """Choice tokens and arrival times of stream i (greedy when i is even, else seeded)."""
    return stream_completion(url, {
        "prompt": f"Stream {i} keeps going through a failover", "max_tokens": 96,
        "ignore_eos": True, "temperature": 0.0 if i % 2 == 0 else 0.9, "seed": 1000 + i},
        on_tokens=on_tokens)


def test_streams_go_on_through_a_scheduler_killed_under_load(tiny_llama, tmp_path):
    """SIGKILL of the scheduler under 16 streams: `pdserve up` restarts it, the workers
    re-attach with what their caches hold, the gateway resubmits each stream with its tokens so
    far, and every stream ends with the tokens of an undisturbed run (greedy and seeded); every
    block is free after, and a prompt cached before the kill is a prefix hit after it."""
    from concurrent.futures import ThreadPoolExecutor

    from tests.e2e.conftest import Stack
    stack = Stack(tiny_llama, tmp_path, "--num-kv-blocks", "512")
    try:
        seen = _cached_tokens(stack.url, LONG)  # its blocks in both workers' caches
        with ThreadPoolExecutor(16) as pool:
            want = [ids for ids, _ in pool.map(lambda i: _stream(stack.url, i), range(16))]
            # the kill once a stream is an eighth of the way: the others are under way too
            # (a fixed wait let a fast machine finish all 96 tokens first)
            under_way = threading.Event()
            running = [pool.submit(_stream, stack.url, i,
                                   lambda n: n >= 12 and under_way.set()) for i in range(16)]
            assert under_way.wait(120), "no stream got under way"
            scheduler = [pid for pid, cmd in stack.children().items() if " scheduler " in cmd]
            assert len(scheduler) == 1
            killed_at = time.monotonic()
            subprocess.run(["kill", "-KILL", str(scheduler[0])], check=True)
            got = [f.result() for f in running]
        assert [ids for ids, _ in got] == want
        assert all(len(ids) == 96 for ids in want)
        resumed = [next(t for t in times if t > killed_at) - killed_at
                   for _, times in got if times[-1] > killed_at]
        assert resumed, "the streams ended before the kill"
        print(f"\nscheduler killed: next token after {min(resumed):.2f}-{max(resumed):.2f} s")
        stats = stack.wait_idle()
        assert stats["num_running"] == 0
        assert all(w["num_free_blocks"] == w["num_blocks"] for w in stats["workers"])
        assert "exited with -9; restarting it" in stack.log.read_text()
        # the workers reported what their caches hold: the new scheduler hits the old prompt
        assert seen == 0 and _cached_tokens(stack.url, LONG) >= 64
    finally:
        stack.stop()


LONG = list(range(300, 380))  # 80 tokens: five full blocks


def _cached_tokens(url: str, prompt: list[int]) -> int:
    import httpx
    with httpx.Client(base_url=url, timeout=120) as c:
        r = c.post("/v1/completions", json={
            "model": c.get("/v1/models").json()["data"][0]["id"], "prompt": prompt,
            "max_tokens": 2})
        assert r.status_code == 200, r.text
        return r.json()["usage"]["prompt_tokens_details"]["cached_tokens"]
