"""A peer that stops answering without dying: a decode worker frozen (SIGSTOP) mid-stream is
dropped by the scheduler's keepalive within seconds, not at the step timeout (and, with
keepalive's pings off, at the step timeout); its stream goes on on the other decode worker with
HuggingFace's greedy tokens, and once thawed the worker attaches again and every block comes
back. A gateway that answers keepalive's pings but reads nothing of its Session stream loses the
session at --session-write-timeout, and its requests end; a scheduler that reads nothing of a
worker's stream loses the worker at the worker's --write-timeout, and the worker attaches
again."""
import os
import signal
import subprocess
import threading
import time
from concurrent import futures
from pathlib import Path

import grpc
import pytest
import torch
import transformers

from common.grpc_options import server_options
from common.plans import NewRequest, ScheduledTokens, StepPlan
from common.sampling_params import SamplingParams
from protos import scheduler_pb2, scheduler_pb2_grpc, worker_pb2, worker_pb2_grpc
from protos.worker_codec import plan_to_pb
from tests.e2e.conftest import PDSERVE, Stack, stop_all, stream_completion
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


WORKER_WRITE_TIMEOUT_S = 1
STUCK_PLANS, STUCK_PROMPT = 400, 500


def _prefill_plan(step_id: int, rid: str, prompt: list[int], prompt_logprobs: int = -1,
                  finished: tuple[str, ...] = ()) -> worker_pb2.SchedulerMessage:
    blocks = tuple(range(-(-len(prompt) // 16)))
    return worker_pb2.SchedulerMessage(plan=plan_to_pb(StepPlan(
        step_id, new_requests=[NewRequest(rid, tuple(prompt), len(prompt), 0, blocks,
                                          SamplingParams(max_tokens=1,
                                                         prompt_logprobs=prompt_logprobs))],
        scheduled=[ScheduledTokens(rid, len(prompt))], finished_request_ids=list(finished))))


class _StopsReading(worker_pb2_grpc.WorkerControlServicer):
    """The scheduler's end of a worker's Attach stream, its process alive to keepalive's pings
    (gRPC's own threads answer them). On the first stream it acks the registration and sends
    plans (each a 500-token prompt whose logprobs, top 20, the worker answers with), reading
    nothing more; on the next it runs one plan, reads its result and ends the stream when the
    worker leaves."""

    def __init__(self, probe: list[int]):
        self.probe = probe
        self.registered: list[str] = []
        self.first_ended = threading.Event()
        self.probe_token: list[int] = []
        self.release = threading.Event()

    def Attach(self, request_iterator, context):
        self.registered.append(next(request_iterator).register.worker_id)
        yield worker_pb2.SchedulerMessage(ack=worker_pb2.RegisterAck(
            worker_id=self.registered[-1]))
        if len(self.registered) == 1:
            context.add_callback(self.first_ended.set)
            for i in range(STUCK_PLANS):
                yield _prefill_plan(i + 1, f"r{i}", _prompt(STUCK_PROMPT, 200 + i), 20,
                                    (f"r{i - 1}",) if i else ())
            self.release.wait(120)
            return
        yield _prefill_plan(1, "probe", self.probe)
        for msg in request_iterator:
            if msg.HasField("result"):
                self.probe_token += [s.token_id for s in msg.result.sampled]
            if msg.HasField("leave"):
                return


def test_a_scheduler_reading_nothing_loses_the_worker_which_attaches_again(tiny_llama,
                                                                           tmp_path):
    """A scheduler whose process answers keepalive's pings but reads nothing of a worker's
    stream: the worker's step results (prompt logprobs) fill the stream's flow-control windows,
    its write waits --write-timeout, and then the worker drops the stream, attaches again and
    runs the next plan with HuggingFace's greedy token."""
    hf = transformers.AutoModelForCausalLM.from_pretrained(tiny_llama,
                                                           dtype=torch.float32).eval()
    probe = _prompt(20, 74)
    with torch.no_grad():
        want = int(hf(torch.tensor([probe])).logits[0, -1].argmax())
    scheduler = _StopsReading(probe)
    server = grpc.server(futures.ThreadPoolExecutor(4), options=server_options())
    worker_pb2_grpc.add_WorkerControlServicer_to_server(scheduler, server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    log = tmp_path / "worker.log"
    with open(log, "w") as out:
        worker = subprocess.Popen(
            [PDSERVE, "prefill-worker", "--model", str(tiny_llama), "--dtype", "float32",
             "--scheduler", f"127.0.0.1:{port}", "--num-kv-blocks", "64",
             "--write-timeout", str(WORKER_WRITE_TIMEOUT_S)], stdout=out,
            stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 120
        while not scheduler.registered:
            assert time.monotonic() < deadline and worker.poll() is None, log.read_text()
            time.sleep(0.1)
        assert scheduler.first_ended.wait(60), "the worker never dropped the unread stream"
        deadline = time.monotonic() + 30
        while not scheduler.probe_token:
            assert time.monotonic() < deadline and worker.poll() is None, log.read_text()
            time.sleep(0.1)
        assert scheduler.probe_token == [want]
        assert len(scheduler.registered) == 2 and len(set(scheduler.registered)) == 1
        assert (f"the scheduler took no message in {WORKER_WRITE_TIMEOUT_S} s"
                in log.read_text())
    finally:
        scheduler.release.set()
        stop_all([worker])
        server.stop(0)
