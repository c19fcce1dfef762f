"""A scheduler that restarts: the workers re-dial and register afresh, and serving goes on."""
import json
import signal
import subprocess
import sys
import time
from pathlib import Path

import grpc
import torch
import transformers

from protos import scheduler_pb2, scheduler_pb2_grpc
from tests.e2e.conftest import free_port, stop_all
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
    worker = ["--model", str(tiny_llama), "--scheduler", addr, "--cpu-threads", "1",
              "--num-kv-blocks", "64"]
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
