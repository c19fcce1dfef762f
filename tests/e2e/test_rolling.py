"""Graceful leave and a rolling restart under load (`pdserve up`, one prefill and two decode
workers, two gateway processes): SIGTERM to a decode worker lets its streams finish there (none
is recomputed) before it leaves and comes back; SIGTERM to a service of each kind in turn, while
clients keep sending, loses no request and changes no token; so does SIGKILL (chaos)."""
import os
import signal
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import grpc
import pytest

from tests.e2e.conftest import Stack, stream_completion
from tests.e2e.test_gateways import gateway_children

MAX_TOKENS = 48


@pytest.fixture(scope="module")
def rolling(tiny_llama, tmp_path_factory):
    s = Stack(tiny_llama, tmp_path_factory.mktemp("rolling"), "--decode-workers", "2",
              "--gateways", "2", "--num-kv-blocks", "512")
    yield s
    s.stop()


def complete(url: str, i: int) -> list[int]:
    """Greedy when i is even, else seeded; streamed; raises on anything but a full answer (a
    connection refused before any response began is sent again, as OpenAI's client does)."""
    ids, _ = stream_completion(url, {
        "prompt": f"Client {i} asks through a rolling restart", "max_tokens": MAX_TOKENS,
        "ignore_eos": True, "temperature": 0.0 if i % 2 == 0 else 0.8, "seed": 7 * i},
        connection_retries=2)
    assert len(ids) == MAX_TOKENS
    return ids


def pid_of(stack: Stack, needle: str) -> int:
    found = [pid for pid, cmd in stack.children().items() if needle in cmd]
    assert len(found) >= 1, needle
    return sorted(found)[0]


def wait_for(predicate, timeout: float = 90.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.3)


def workers_up(stack: Stack, n: int) -> bool:
    try:
        return len(stack.stats()["workers"]) == n
    except grpc.RpcError:  # the scheduler restarting
        return False


def test_a_decode_worker_drains_before_it_leaves(rolling):
    want = {i: complete(rolling.url, i) for i in range(8)}
    before = rolling.log.read_text()
    with ThreadPoolExecutor(8) as pool:
        running = {i: pool.submit(complete, rolling.url, i) for i in range(8)}
        time.sleep(0.8)
        os.kill(pid_of(rolling, "decode-worker"), signal.SIGTERM)
        got = {i: f.result() for i, f in running.items()}
    assert got == want
    # the worker counted while it drains: wait for its restart, then for it to be back
    wait_for(lambda: "`decode-worker` exited" in rolling.log.read_text()[len(before):])
    wait_for(lambda: workers_up(rolling, 3))
    log = rolling.log.read_text()[len(before):]
    assert "drained: it leaves" in log
    assert "re-queued" not in log  # nothing it ran was recomputed elsewhere
    assert "`decode-worker` exited with 0; restarting it" in log


def test_a_rolling_restart_under_load_loses_no_request(rolling):
    want = {i: complete(rolling.url, i) for i in range(6)}
    stop = threading.Event()
    results: list[tuple[int, list[int]]] = []
    errors: list[BaseException] = []

    def client(i: int) -> None:
        while not stop.is_set():
            try:
                results.append((i, complete(rolling.url, i)))
            except BaseException as e:  # noqa: BLE001 - every failure is the test's finding
                errors.append(e)
                return

    threads = [threading.Thread(target=client, args=(i,)) for i in range(6)]
    for t in threads:
        t.start()
    try:
        for needle in ("prefill-worker", "decode-worker", " scheduler --host"):
            pid = pid_of(rolling, needle)
            os.kill(pid, signal.SIGTERM)
            wait_for(lambda pid=pid: pid not in rolling.children())
            wait_for(lambda: workers_up(rolling, 3))
            time.sleep(1.0)
        pid = gateway_children(rolling)[0]
        os.kill(pid, signal.SIGTERM)
        wait_for(lambda: pid not in gateway_children(rolling)
                 and len(gateway_children(rolling)) == 2)
        time.sleep(1.0)
    finally:
        stop.set()
        for t in threads:
            t.join(180)
    assert not errors, errors[:3]
    assert len(results) >= 12
    assert all(ids == want[i] for i, ids in results)
    stats = rolling.wait_idle()
    assert all(w["num_free_blocks"] == w["num_blocks"] for w in stats["workers"])


def test_sigkill_of_each_service_in_turn_under_load_loses_no_request(rolling):
    """Chaos: SIGKILL, no drain, to the prefill worker, a decode worker and the scheduler in
    turn while six clients keep streaming. `pdserve up` restarts each; a dead worker's requests
    are recomputed elsewhere, the gateways resubmit what a dead scheduler held: every request
    completes with the tokens of an undisturbed run, and every block is free after."""
    want = {i: complete(rolling.url, i) for i in range(6)}
    stop = threading.Event()
    results: list[tuple[int, list[int]]] = []
    errors: list[BaseException] = []

    def client(i: int) -> None:
        while not stop.is_set():
            try:
                results.append((i, complete(rolling.url, i)))
            except BaseException as e:  # noqa: BLE001 - every failure is the test's finding
                errors.append(e)
                return

    threads = [threading.Thread(target=client, args=(i,)) for i in range(6)]
    for t in threads:
        t.start()
    before = rolling.log.read_text()
    try:
        for needle in ("prefill-worker", "decode-worker", " scheduler --host"):
            time.sleep(1.5)  # streams in flight on the victim
            pid = pid_of(rolling, needle)
            os.kill(pid, signal.SIGKILL)
            wait_for(lambda pid=pid: pid not in rolling.children())
            wait_for(lambda: workers_up(rolling, 3))
    finally:
        stop.set()
        for t in threads:
            t.join(180)
    assert not errors, errors[:3]
    assert len(results) >= 12
    assert all(ids == want[i] for i, ids in results)
    log = rolling.log.read_text()[len(before):]
    assert log.count("exited with -9; restarting it") == 3
    stats = rolling.wait_idle()
    assert stats["num_running"] == 0 and stats["num_waiting"] == 0
    assert all(w["num_free_blocks"] == w["num_blocks"] for w in stats["workers"])
