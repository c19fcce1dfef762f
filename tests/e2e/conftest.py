"""The whole stack as `pdserve up` starts it: four real processes on 127.0.0.1."""
import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import httpx
import pytest

from common.ports import free_port, free_ports
from common.worker.group import stat_fields

ROOT = Path(__file__).resolve().parents[2]
PDSERVE = Path(sys.executable).parent / "pdserve"




def child_processes(pid: int) -> dict[int, str]:
    """pid -> command line of process `pid`'s children (their parent as /proc/PID/stat has it)."""
    out = {}
    for d in Path("/proc").iterdir():
        if d.name.isdigit() and stat_fields(int(d.name))[1:2] == [str(pid).encode()]:
            with contextlib.suppress(OSError):  # gone meanwhile
                out[int(d.name)] = (d / "cmdline").read_bytes().replace(b"\0", b" ").decode()
    return out


def stop_all(procs: list[subprocess.Popen], timeout: float = 15.0) -> None:
    """SIGTERM to each, then wait; whatever outlives the timeout is killed."""
    for p in procs:
        p.terminate()
    for p in procs:
        try:
            p.wait(timeout)
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()


def stream_completion(url: str, body: dict, connection_retries: int = 0,
                      on_tokens: Callable[[int], None] | None = None
                      ) -> tuple[list[int], list[float]]:
    """POST /v1/completions streamed (body gets the served model and return_token_ids): the
    choice tokens and each chunk's arrival time; fails on a non-200 or an error event.
    on_tokens(n) runs as each chunk arrives, n the tokens so far.

    connection_retries: sends the request again when its connection failed before any response
    began, as the OpenAI client does (a gateway process that drains for a restart closes the
    keep-alive connections it has not read a request from; the request was never taken). An
    error once the response began is never retried."""
    for attempt in range(connection_retries + 1):
        ids: list[int] = []
        times: list[float] = []
        began = False
        try:
            with httpx.Client(base_url=url, timeout=120) as c:
                body = {**body, "stream": True, "return_token_ids": True,
                        "model": c.get("/v1/models").json()["data"][0]["id"]}
                with c.stream("POST", "/v1/completions", json=body) as r:
                    began = True
                    assert r.status_code == 200, r.read()
                    for line in r.iter_lines():
                        if line.startswith("data: ") and line != "data: [DONE]":
                            event = json.loads(line[6:])
                            assert "error" not in event, event
                            for choice in event["choices"]:
                                ids += choice.get("token_ids") or []
                                times.append(time.monotonic())
                                if on_tokens is not None:
                                    on_tokens(len(ids))
            return ids, times
        except httpx.TransportError:
            if began or attempt == connection_retries:
                raise
    raise AssertionError("unreachable")


class Stack:
    def __init__(self, model_dir: Path, tmp: Path, *extra: str, command: str = "up",
                 wait: bool = True):
        """`pdserve up --model DIR`, or `pdserve serve DIR` with command="serve"; up when it
        returns, or with wait=False started only (wait_up later: work can overlap the start)."""
        self.port, self.sched_port = free_ports(2)  # distinct: neither is bound yet
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = tmp / "stack.log"
        # `pdserve stats` speaks mutual TLS to a stack that does
        self.tls = [a for i, a in enumerate(extra) if i and extra[i - 1] == "--tls-dir"]
        model = [str(model_dir)] if command == "serve" else ["--model", str(model_dir)]
        # float32, as the tests' references are, whatever --dtype auto picks on this host
        cmd = [str(PDSERVE), command, *model, "--port", str(self.port),
               "--scheduler-port", str(self.sched_port), "--cpu-threads", "1",
               "--dtype", "float32", *extra]
        self.proc = subprocess.Popen(cmd, stdout=open(self.log, "w"), stderr=subprocess.STDOUT,
                                     cwd=ROOT, start_new_session=True)
        if wait:
            self.wait_up()

    def wait_up(self, timeout: float = 240.0) -> None:
        """Until the launcher says it is up; stops the stack and raises if it exits or the
        timeout passes first."""
        deadline = time.monotonic() + timeout
        while "pdserve is up" not in self.log.read_text():
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"the stack did not come up:\n{self.log.read_text()[-4000:]}")
            time.sleep(0.3)

    def stats(self) -> dict:
        """`pdserve stats` as a dict, asked in-process (polling loops call it often); raises
        grpc.RpcError while the scheduler is away."""
        import grpc

        from common.tls import TLSFiles, grpc_channel_credentials, scheduler_channel_options
        from protos import scheduler_pb2, scheduler_pb2_grpc
        from services.cli import _to_dict
        address = f"127.0.0.1:{self.sched_port}"
        if self.tls:
            files = TLSFiles.in_dir(self.tls[0], "admin")
            channel = grpc.secure_channel(address, grpc_channel_credentials(files),
                                          options=scheduler_channel_options(files))
        else:
            channel = grpc.insecure_channel(address)
        with channel:
            return _to_dict(scheduler_pb2_grpc.SchedulerStub(channel).Stats(
                scheduler_pb2.StatsRequest(), timeout=30))

    def children(self) -> dict[int, str]:
        """pid -> command line of the launcher's child processes."""
        return child_processes(self.proc.pid)

    def wait_idle(self, timeout: float = 30.0) -> dict:
        """Stats once nothing runs or waits and every block is free (or the last seen)."""
        deadline = time.monotonic() + timeout
        while True:
            s = self.stats()
            idle = (s["num_running"] == 0 and s["num_waiting"] == 0 and
                    all(w["num_free_blocks"] == w["num_blocks"] for w in s["workers"]))
            if idle or time.monotonic() > deadline:
                return s
            time.sleep(0.2)

    def stop(self, sig=signal.SIGINT, timeout: float = 30.0) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()
        return self.proc.returncode


@pytest.fixture(scope="module")
def stack(tiny_llama, tmp_path_factory):
    s = Stack(tiny_llama, tmp_path_factory.mktemp("stack"), "--num-kv-blocks", "256")
    yield s
    s.stop()


@pytest.fixture
def client(stack):
    with httpx.Client(base_url=stack.url, timeout=120) as c:
        yield c
