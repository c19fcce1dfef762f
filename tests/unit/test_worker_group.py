"""A worker group's configuration and bookkeeping: what it refuses, how it splits its cores,
where its ranks meet, the digest its ranks compare after every step, the deadline on the
leader's pipes to its followers, and how it tells a frozen follower."""
import multiprocessing as mp
import os
import signal
import subprocess
import threading
import time
from datetime import timedelta

import pytest
import torch.distributed as dist

from common.plans import RequestError, SampledToken, StepResult, WorkerCounters
from common.ports import ephemeral_range
from common.worker.config import WorkerConfig
from common.worker.group import (PLAN, GroupBroken, bound_writes, digest, rank_cores,
                                 process_state, rendezvous, send, stopped)
from tests.waiting import until


def _cfg(**kw) -> WorkerConfig:
    return WorkerConfig(role="decode", model="m", dtype="float32", **kw)


def test_a_group_exchanges_kv_over_shm_and_tcp():
    assert _cfg(tensor_parallel_size=2).kv_transports == ("shm", "tcp")
    assert _cfg(pipeline_parallel_size=2, kv_transports=("tcp",)).kv_transports == ("tcp",)


@pytest.mark.parametrize("kw, message", [
    ({"pipeline_parallel_size": 0}, "must be >= 1"),
    ({"tensor_parallel_size": 0}, "must be >= 1"),
    ({"pipeline_parallel_size": 2, "kv_transports": ("shm", "nccl")}, "nccl between groups"),
    ({"pipeline_parallel_size": 2, "speculative_config": '{"method": "ngram", '
                                                         '"num_speculative_tokens": 2}'},
     "does not speculate"),
    ({"tensor_parallel_size": 2, "kv_transports": ("nccl",)}, "nccl between groups"),
    ({"tensor_parallel_size": 2, "device": "cuda"}, "CPU workers so far"),
    ({"tensor_parallel_size": 2, "kv_offloading_blocks": 8, "kv_offloading_backend": "host"},
     "use native"),
    ({"tensor_parallel_size": 2,
      "speculative_config": '{"method": "draft_model", "model": "d", '
                            '"num_speculative_tokens": 2}'}, "draft model"),
])
def test_what_a_group_does_not_do_yet_is_refused(kw, message):
    with pytest.raises(ValueError, match=message):
        _cfg(**kw)


def test_ranks_split_the_groups_cores():
    assert [rank_cores((0, 1, 2, 3), 2, r) for r in range(2)] == [(0, 1), (2, 3)]
    assert [rank_cores((0, 1, 2), 2, r) for r in range(2)] == [(0, 1), (2,)]
    assert [rank_cores((5,), 2, r) for r in range(2)] == [(5,), (5,)]  # fewer cores: shared
    assert rank_cores((), 2, 1) == ()


def test_the_ranks_meet_on_a_port_the_kernel_chose_as_it_bound_it():
    """The leader's store binds a port of the kernel's ephemeral range, which no port chosen
    for a service (below that range, common/ports.py) can be; a follower reaches it there."""
    store = rendezvous(_cfg(tensor_parallel_size=2))
    low, high = ephemeral_range()
    assert low <= store.port <= high
    follower = dist.TCPStore("127.0.0.1", store.port, is_master=False,
                             timeout=timedelta(seconds=10))
    follower.set("rank1", "here")
    assert store.get("rank1") == b"here"


def test_the_digest_tells_other_tokens_and_other_failures_apart():
    def result(*tokens, errors=()):
        return StepResult(7, tuple(SampledToken(r, t) for r, t in tokens),
                          tuple(RequestError(r, "x") for r in errors), WorkerCounters())
    a = digest(result(("a", 1), ("b", 2)))
    assert a == digest(result(("a", 1), ("b", 2)))
    assert a != digest(result(("a", 1), ("b", 3)))
    assert digest(result(("a1", 2))) != digest(result(("a", 12)))
    assert a != digest(result(("a", 1), ("b", 2), errors=("c",)))


def test_a_follower_reading_nothing_breaks_the_group_at_the_send_deadline():
    """The leader's pipe to a follower that is alive but reads nothing (frozen, hung): once
    the pipe's buffers are full a plan fails within the deadline, GroupBroken, where it waited
    for ever; to a follower that reads, as many messages go through as are sent."""
    ctx = mp.get_context("spawn")
    mine, theirs = ctx.Pipe()
    bound_writes(mine, 0.5)
    plan = PLAN + bytes(64 << 10)
    started = time.monotonic()
    with pytest.raises(GroupBroken, match="rank 1 took nothing of a message in time"):
        for _ in range(1000):  # 64 MiB: far past any socket buffer
            send(1, mine, plan)
    assert time.monotonic() - started < 10
    mine.close()
    theirs.close()

    mine, theirs = ctx.Pipe()
    bound_writes(mine, 0.5)
    got = []
    reader = threading.Thread(target=lambda: got.extend(theirs.recv_bytes() for _ in range(200)))
    reader.start()
    for _ in range(200):
        send(1, mine, plan)
    reader.join(30)
    assert got == [plan] * 200
    theirs.close()  # a follower that exited: its end closed
    with pytest.raises(GroupBroken, match="rank 1 is gone"):
        send(1, mine, plan)
    mine.close()


def test_a_stopped_process_is_told_from_a_running_one():
    """`stopped` reads the kernel's state of a real process: running or sleeping (D, the
    uninterruptible sleep, while a just-forked child still reads its executable in), then stopped
    by SIGSTOP, then going on after SIGCONT; a pid with no process has no state."""
    proc = subprocess.Popen(["sleep", "60"])
    try:
        assert process_state(proc.pid) in (b"R", b"S", b"D")
        assert not stopped(proc.pid)
        os.kill(proc.pid, signal.SIGSTOP)
        until(lambda: stopped(proc.pid), 10.0, "stopped after SIGSTOP")
        os.kill(proc.pid, signal.SIGCONT)
        until(lambda: not stopped(proc.pid), 10.0, "going on after SIGCONT")
    finally:
        proc.kill()
        proc.wait(10)
    assert process_state(proc.pid) is None and not stopped(proc.pid)
