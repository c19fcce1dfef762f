"""A peer that stops answering without dying: a decode worker frozen (SIGSTOP) mid-stream is
dropped by the scheduler's keepalive within seconds, not at the step timeout (and, with
keepalive's pings off, at the step timeout); its stream goes on on the other decode worker with
HuggingFace's greedy tokens, and once thawed the worker attaches again and every block comes
back. A gateway that answers keepalive's pings but reads nothing of its Session stream loses the
session at --session-write-timeout, and its requests end."""
import os
import signal
import threading
import time
from pathlib import Path

import grpc
import pytest
import torch
import transformers

from protos import scheduler_pb2, scheduler_pb2_grpc
from tests.e2e.conftest import Stack, stream_completion
from tests.e2e.test_serve import _prompt

MAX_TOKENS = 400  # the stream outlasts the poll that finds it at 20 tokens and the SIGSTOP
# (scheduler flags, seconds its drop may take): keepalive's pings go unanswered; or, pings long
# off, the step the worker froze in never answers
DROPPED_BY = {"keepalive": ("--keepalive-time 1 --keepalive-timeout 2", 1 + 2),
              "step-timeout": ("--keepalive-time 300 --keepalive-timeout 300 --step-timeout 3", 3)}


def _greedy_through_eos(hf, prompt: list[int], n: int) -> list[int]:
    """HuggingFace's greedy tokens as `ignore_eos` has them: an end-of-sequence token is one
    more token, neither a stop nor suppressed (generate's min_new_tokens would suppress it)."""
    out, past, ids = [], None, torch.tensor([prompt])
    with torch.no_grad():
        for _ in range(n):
            step = hf(ids, past_key_values=past, use_cache=True)
            past, token = step.past_key_values, int(step.logits[0, -1].argmax())
            out.append(token)
            ids = torch.tensor([[token]])
    return out


def _pid_holding(stack: Stack, worker_id: str) -> int:
    """The launcher's child that maps worker_id's KV segment."""
    for pid, cmd in stack.children().items():
        if "decode-worker" in cmd and worker_id in Path(f"/proc/{pid}/maps").read_text():
            return pid
    raise AssertionError(f"no process maps the KV cache of {worker_id}")


@pytest.mark.parametrize("by", DROPPED_BY)
def test_a_frozen_decode_worker_is_dropped_in_seconds_and_its_stream_resumes(tiny_llama,
                                                                             tmp_path, by):
    flags, drop_s = DROPPED_BY[by]
    stack = Stack(tiny_llama, tmp_path, "--num-kv-blocks", "256", "--decode-workers", "2",
                  f"--scheduler-args={flags}", wait=False)
    frozen = None
    try:
        # the reference while the stack starts
        hf = transformers.AutoModelForCausalLM.from_pretrained(tiny_llama,
                                                               dtype=torch.float32).eval()
        prompt = _prompt(12, 71)
        want = _greedy_through_eos(hf, prompt, MAX_TOKENS)
        stack.wait_up()
        with grpc.insecure_channel(f"127.0.0.1:{stack.sched_port}") as channel:
            stub = scheduler_pb2_grpc.SchedulerStub(channel)

            def decoders() -> dict[str, scheduler_pb2.WorkerStats]:
                s = stub.Stats(scheduler_pb2.StatsRequest(), timeout=10)
                return {w.worker_id: w for w in s.workers if w.role == "decode"}

            got: list[list[int]] = []
            body = {"prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0,
                    "ignore_eos": True}
            streaming = threading.Thread(
                target=lambda: got.append(stream_completion(stack.url, body)[0]))
            streaming.start()
            deadline = time.monotonic() + 60
            while not (busy := [w for w in decoders().values()
                                if w.num_running and w.tokens_decoded >= 20]):
                assert time.monotonic() < deadline and streaming.is_alive(), \
                    "the stream never reached a decode worker"
                time.sleep(0.01)
            victim = busy[0].worker_id
            frozen = _pid_holding(stack, victim)
            os.kill(frozen, signal.SIGSTOP)
            stopped_at = time.monotonic()
            while victim in decoders():
                assert time.monotonic() - stopped_at < 30, "the frozen worker was not dropped"
                time.sleep(0.05)
            dropped_after = time.monotonic() - stopped_at
            print(f"\nthe frozen decode worker was dropped {dropped_after:.1f} s after SIGSTOP "
                  f"({flags})")
            assert dropped_after < drop_s + 5, dropped_after
            streaming.join(120)
            assert got and got[0] == want  # resumed on the other worker, nothing lost
            os.kill(frozen, signal.SIGCONT)
            frozen = None
            deadline = time.monotonic() + 60
            while len(decoders()) < 2:  # the thawed worker finds its stream gone: it re-attaches
                assert time.monotonic() < deadline, "the thawed worker did not attach again"
                time.sleep(0.2)
        s = stack.wait_idle(timeout=60)
        assert all(w["num_free_blocks"] == w["num_blocks"] for w in s["workers"]), s
    finally:
        if frozen is not None:
            os.kill(frozen, signal.SIGCONT)
        stack.stop()


STALLED, STALLED_PROMPT, STALLED_MAX_TOKENS = 24, 1000, 2000
SESSION_WRITE_TIMEOUT_S = 2


def test_a_gateway_reading_nothing_loses_its_session_and_its_requests_end(tiny_llama, tmp_path):
    """A gateway alive to keepalive's pings (gRPC's own threads answer them) but reading
    nothing of its Session stream: its requests' outputs (each prompt's logprobs, top 20) fill
    the stream's flow-control windows, the scheduler's write waits --session-write-timeout, and
    then the session ends and its requests are aborted, their blocks freed, long before their
    tokens would have run out. The real gateway's requests stream to their end meanwhile and
    after."""
    stack = Stack(tiny_llama, tmp_path, "--num-kv-blocks", "4096",
                  f"--scheduler-args=--session-write-timeout {SESSION_WRITE_TIMEOUT_S}")
    open_side = threading.Event()
    try:
        sampling = scheduler_pb2.SamplingParams(max_tokens=STALLED_MAX_TOKENS, ignore_eos=True,
                                                logprobs=20, prompt_logprobs=20, top_p=1.0,
                                                repetition_penalty=1.0)
        requests = [scheduler_pb2.SessionRequest(generate=scheduler_pb2.GenerateRequest(
            request_id=f"stalled-{i}", prompt_token_ids=_prompt(STALLED_PROMPT, 100 + i),
            sampling=sampling)) for i in range(STALLED)]

        def gateway_side():
            yield from requests
            open_side.wait(120)  # its side of the stream stays open, unread

        with grpc.insecure_channel(f"127.0.0.1:{stack.sched_port}") as channel:
            responses = scheduler_pb2_grpc.SchedulerStub(channel).Session(gateway_side())
            try:
                deadline = time.monotonic() + 60
                while stack.stats()["num_running"] == 0:
                    assert time.monotonic() < deadline, "the session's requests never ran"
                    time.sleep(0.1)
                ids, _ = stream_completion(stack.url, {"prompt": _prompt(12, 72),
                                                       "max_tokens": 64, "ignore_eos": True})
                assert len(ids) == 64
                deadline = time.monotonic() + 90
                while "took no outputs" not in stack.log.read_text():
                    assert time.monotonic() < deadline, "the session never ended"
                    time.sleep(0.2)
                s = stack.wait_idle(timeout=30)
                ids, _ = stream_completion(stack.url, {"prompt": _prompt(12, 73),
                                                       "max_tokens": 64, "ignore_eos": True})
                assert len(ids) == 64
            finally:
                open_side.set()
                responses.cancel()
        log = stack.log.read_text()
        assert f"took no outputs in {SESSION_WRITE_TIMEOUT_S}s; its session ends" in log
        assert all(f"request stalled-{i} aborted" in log for i in range(STALLED))
        assert s["num_running"] == 0 and s["num_waiting"] == 0, s
        assert all(w["num_free_blocks"] == w["num_blocks"] for w in s["workers"]), s
        decoded = sum(w["tokens_decoded"] for w in s["workers"])
        assert decoded < STALLED * STALLED_MAX_TOKENS // 2, decoded  # cut off, not run out
    finally:
        open_side.set()
        stack.stop()
