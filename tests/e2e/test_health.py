"""Health and readiness follow the workers, as real processes come and go: the scheduler's and
the workers' grpc.health.v1 statuses, the gateway's /ready, and a request with no worker to
serve it, which gets a 503 with Retry-After after --no-worker-wait instead of hanging. Then the
client's x-request-id: echoed, never the scheduler's id, so equal ids never collide."""
import json
import signal
import subprocess
import time

import grpc
import httpx

from common.health import check
from protos import scheduler_pb2, scheduler_pb2_grpc
from tests.e2e.conftest import PDSERVE, free_ports, stop_all

NO_WORKER_WAIT_S = 1.5
START_TIMEOUT_S = 180.0
CHANGE_TIMEOUT_S = 30.0
SERVICES = ("", "pdserve.prefill", "pdserve.decode", "pdserve.scheduler.Scheduler")


def _statuses(address: str, services=("",)) -> tuple[str, ...]:
    """Each service's status; UNREACHABLE while nothing answers the port."""
    try:
        return tuple(check(address, s, timeout_s=5) for s in services)
    except grpc.RpcError:
        return ("UNREACHABLE",) * len(services)


def _wait(what: str, read, want, timeout_s: float, log) -> None:
    deadline = time.monotonic() + timeout_s
    while (seen := read()) != want:
        if time.monotonic() > deadline:
            raise AssertionError(f"{what}: {seen}, want {want}\n{log.read_text()[-3000:]}")
        time.sleep(0.2)


def _ready(http: httpx.Client) -> int:
    try:
        return http.get("/ready").status_code
    except httpx.TransportError:
        return -1


def _complete(http: httpx.Client, **headers) -> httpx.Response:
    return http.post("/v1/completions", headers=headers, json={
        "prompt": "the quick brown fox", "max_tokens": 12, "temperature": 0, "ignore_eos": True})


def test_health_and_readiness_follow_the_workers(tiny_llama, tmp_path):
    sched, gateway, prefill, decode = free_ports(4)  # distinct: none is bound yet
    addr = f"127.0.0.1:{sched}"
    health = {"prefill": prefill, "decode": decode}
    log_path = tmp_path / "log"
    log = open(log_path, "w")

    def start(*args: str) -> subprocess.Popen:
        return subprocess.Popen([str(PDSERVE), *args], stdout=log, stderr=subprocess.STDOUT)

    def worker(role: str) -> subprocess.Popen:
        return start(f"{role}-worker", "--model", str(tiny_llama), "--scheduler", addr,
                     "--cpu-threads", "1", "--num-kv-blocks", "64", "--dtype", "float32",
                     "--health-port", str(health[role]))

    def scheduler_says(*want: str) -> None:
        _wait("scheduler health", lambda: _statuses(addr, SERVICES), want, CHANGE_TIMEOUT_S,
              log_path)

    procs = [start("scheduler", "--port", str(sched)),
             start("gateway", "--model", str(tiny_llama), "--port", str(gateway),
                   "--scheduler", addr, "--no-worker-wait", str(NO_WORKER_WAIT_S))]
    try:
        with httpx.Client(base_url=f"http://127.0.0.1:{gateway}", timeout=60) as http:
            # no worker: the API is up, nothing can be served
            scheduler_says("NOT_SERVING", "NOT_SERVING", "NOT_SERVING", "SERVING")
            _wait("gateway /ready", lambda: _ready(http), 503, START_TIMEOUT_S, log_path)
            assert http.get("/health").status_code == 200  # liveness: the process is up
            probe = subprocess.run([str(PDSERVE), "health", addr], capture_output=True,
                                   text=True, timeout=30)
            assert (probe.returncode, probe.stdout.strip()) == (1, "NOT_SERVING")
            assert http.get("/ready").json()["error"]["code"] == "no_workers"
            start_s = time.monotonic()
            refused = _complete(http)
            waited_s = time.monotonic() - start_s
            assert refused.status_code == 503, refused.text
            assert refused.headers["retry-after"] == "1"
            assert refused.json()["error"]["code"] == "no_workers"
            assert NO_WORKER_WAIT_S - 0.1 <= waited_s < NO_WORKER_WAIT_S + 5, waited_s

            # a prefill worker alone finishes nothing
            procs.append(worker("prefill"))
            _wait("prefill worker health", lambda: _statuses(f"127.0.0.1:{health['prefill']}"),
                  ("SERVING",), START_TIMEOUT_S, log_path)
            scheduler_says("NOT_SERVING", "NOT_SERVING", "NOT_SERVING", "SERVING")
            assert http.get("/ready").status_code == 503

            # with a decode worker the disaggregated path serves
            decode = worker("decode")
            procs.append(decode)
            _wait("decode worker health", lambda: _statuses(f"127.0.0.1:{health['decode']}"),
                  ("SERVING",), START_TIMEOUT_S, log_path)
            scheduler_says("SERVING", "SERVING", "SERVING", "SERVING")
            _wait("gateway /ready", lambda: _ready(http), 200, CHANGE_TIMEOUT_S, log_path)
            served = _complete(http)
            assert served.status_code == 200, served.text

            # the decode worker leaves: not ready again, and a request is refused in time
            decode.send_signal(signal.SIGKILL)
            decode.wait(30)
            scheduler_says("NOT_SERVING", "NOT_SERVING", "NOT_SERVING", "SERVING")
            _wait("gateway /ready", lambda: _ready(http), 503, CHANGE_TIMEOUT_S, log_path)
            assert _statuses(f"127.0.0.1:{health['prefill']}") == ("SERVING",)  # still attached
            refused = _complete(http)
            assert refused.status_code == 503 and refused.headers["retry-after"] == "1"

            # it comes back: new requests are served, the same tokens as before
            procs.append(worker("decode"))
            scheduler_says("SERVING", "SERVING", "SERVING", "SERVING")
            _wait("gateway /ready", lambda: _ready(http), 200, CHANGE_TIMEOUT_S, log_path)
            again = _complete(http)
            assert again.status_code == 200, again.text
            assert again.json()["choices"][0]["text"] == served.json()["choices"][0]["text"]
    finally:
        stop_all(procs)


def test_equal_client_request_ids_do_not_collide(stack):
    """While a stream with x-request-id "same-id" runs, a second request with the same id runs
    too, and each echoes the client's id (the scheduler refuses an id already in use: it never
    sees the client's). The first is still running after the second finished: they overlapped."""
    same = {"x-request-id": "same-id"}
    long = {"prompt": "one two three", "max_tokens": 3000, "ignore_eos": True, "stream": True}
    with grpc.insecure_channel(f"127.0.0.1:{stack.sched_port}") as channel, \
            httpx.Client(base_url=stack.url, timeout=120) as http:
        stats = scheduler_pb2_grpc.SchedulerStub(channel).Stats

        def in_flight() -> int:
            s = stats(scheduler_pb2.StatsRequest(), timeout=10)
            return s.num_running + s.num_waiting

        with http.stream("POST", "/v1/completions", json=long, headers=same) as first:
            assert first.status_code == 200 and first.headers["x-request-id"] == "same-id"
            lines = first.iter_lines()
            opening = next(line for line in lines if line.startswith("data: "))
            assert json.loads(opening.removeprefix("data: "))["id"] == "same-id"
            second = _complete(http, **same)
            assert in_flight() == 1  # the first, still generating
        # closing the stream early aborts the first
    assert second.status_code == 200, second.text
    assert second.headers["x-request-id"] == "same-id" == second.json()["id"]
    assert second.json()["choices"][0]["finish_reason"] == "length"
    assert stack.wait_idle()["num_running"] == 0
