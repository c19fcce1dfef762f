"""A worker group: T x P rank processes serving as one worker (T tensor-parallel ranks in each
of P pipeline stages; rank r is tensor-parallel rank r % T of stage r // T).

The process the worker command starts is rank 0, the leader: it alone talks to the scheduler
(one registration, the model's KV layout with T and P recorded, an shm endpoint naming every
rank's cache) and it starts ranks 1..T*P-1 itself. Every rank holds its share of the weights and
of the paged KV cache (its stage's layers, its KV heads, under the same block ids) and runs every
plan the same way:

    leader                                    each follower
    plan from the scheduler ------ pipe ----> the same plan
    KV sends ready before the step            its shard of them
    the step(s): forward with the group's collectives (gloo on CPU): one all-reduce per
                 attention block and one per MLP block; logits all-gathered, so every rank
                 of the last stage samples the same tokens from the same bits and the same
                 seeds; hidden states stage to stage; the last stage's tokens broadcast to
                 the earlier stages (pipeline.py)
    KV sends of the step                      its shard of them
    answers the scheduler    <----- pipe ---- what it sampled (a digest) and how its sends went

The leader answers a step only once every follower sampled the same tokens (a rank that drew
others would feed the next step's embedding other ids), and a transfer is done only once every
rank's shard landed. Plans travel as their protobuf bytes over a pipe, never as pickles.

A rank that dies, freezes or diverges takes the group out: the leader stops (exit status 1),
which breaks its Attach stream, so the scheduler re-queues the group's requests, which resume
elsewhere with the same tokens; `pdserve up` restarts the group. Followers end with their
leader: their pipe closes, and the kernel kills them if it dies first (PR_SET_PDEATHSIG).
"""
from __future__ import annotations

import asyncio
import ctypes
import hashlib
import json
import logging
import multiprocessing as mp
import os
import signal
import socket
import struct
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from datetime import timedelta
from multiprocessing.connection import Connection
from typing import NoReturn

import torch
import torch.distributed as dist

from common.heap import freeze_startup_heap
from common.models.parallel import PipelineParallel, TensorParallel
from common.plans import StepPlan, StepResult, TransferDone, TransfersDone
from common.worker.config import WorkerConfig
from common.worker.pipeline import LastStage
from common.worker.worker import Worker

log = logging.getLogger(__name__)

PLAN, RESET = b"p", b"r"  # leader -> follower
STEP, SENT = b"s", b"t"   # follower -> leader, one answer per call the plan makes
# a step's answer comes when its forward is done: as long as a step may take (long prompts on
# few cores), and the group's collectives notice a dead peer long before
STEP_TIMEOUT_S = 600.0
# a follower reads the next plan as soon as it has answered the last one: a write to its pipe
# that moves no byte for this long finds it alive but reading nothing (frozen, or hung)
SEND_TIMEOUT_S = 30.0
# a follower stopped this long (SIGSTOP, a debugger) is frozen: a plan small enough for its
# pipe goes out, and the leader would wait in the step's collectives until STEP_TIMEOUT_S
STOPPED_TIMEOUT_S = 5.0


class GroupBroken(Exception):
    """A rank died, did not answer in time, or sampled other tokens than the leader."""


@dataclass(frozen=True)
class RankPlace:
    """Where a rank sits in its group, and its model's parallel layers' collectives."""
    rank: int
    tp_rank: int
    stage: int
    tp: TensorParallel | None
    pp: PipelineParallel | None
    last_stage: LastStage | None  # P > 1: where the sampled tokens come from


def _timeout(cfg: WorkerConfig) -> timedelta:
    """How long the group's collectives, and its rendezvous, wait for a rank."""
    return timedelta(seconds=max(STEP_TIMEOUT_S, cfg.group_start_timeout_s))


def rendezvous(cfg: WorkerConfig) -> dist.TCPStore:
    """The leader's store the ranks meet at, on a port the kernel picks as it binds (from its
    ephemeral range): a port chosen free beforehand could be bound meanwhile by a service of
    the same stack that was given it too (`common/ports.py` chooses below that range)."""
    return dist.TCPStore("127.0.0.1", 0, cfg.group_size, is_master=True,
                         timeout=_timeout(cfg), wait_for_workers=False)


def connect(cfg: WorkerConfig, rank: int, meet: dist.TCPStore | int) -> RankPlace:
    """Joins the group's collectives (every rank calls it at start, in any order): the world
    of T x P ranks, one tensor-parallel subgroup per stage where there are stages. They meet
    at the store `rendezvous` made: the process that made it passes the store, the others its
    port, where they join it as clients."""
    t, p = cfg.tensor_parallel_size, cfg.pipeline_parallel_size
    store = meet if isinstance(meet, dist.TCPStore) else dist.TCPStore(
        "127.0.0.1", meet, t * p, is_master=False, timeout=_timeout(cfg))
    dist.init_process_group("gloo", store=store, rank=rank, world_size=t * p,
                            timeout=_timeout(cfg))
    stage, tp_rank = divmod(rank, t)
    # every rank makes every subgroup, in the same order
    stages = [dist.new_group(list(range(s * t, (s + 1) * t))) for s in range(p)] \
        if t > 1 and p > 1 else None
    tp = TensorParallel(tp_rank, t, stages[stage] if stages else None) if t > 1 else None
    pp = PipelineParallel(stage, p, rank - t if stage else -1,
                          rank + t if stage < p - 1 else -1) if p > 1 else None
    return RankPlace(rank, tp_rank, stage, tp, pp, LastStage(rank, t, p) if p > 1 else None)


def rank_cores(cores: tuple[int, ...], size: int, rank: int) -> tuple[int, ...]:
    """Rank `rank`'s share of the group's cores: an even split, contiguous; all of them where
    there are fewer cores than ranks."""
    if len(cores) < size:
        return cores
    k, extra = divmod(len(cores), size)
    start = rank * k + min(rank, extra)
    return cores[start:start + k + (rank < extra)]


def digest(result: StepResult) -> bytes:
    """What a step sampled, in a few bytes: equal on every rank of a sound group."""
    h = hashlib.blake2b(digest_size=16)
    for s in result.sampled:
        h.update(f"{s.request_id}\0{s.token_id}\0".encode())
    for e in result.errors:
        h.update(f"{e.request_id}\0!\0".encode())
    return h.digest()


class GroupLeader:
    """Rank 0's side of the group: starts the followers and mirrors every plan to them."""

    def __init__(self, cfg: WorkerConfig):
        self.cfg = cfg
        self.size = cfg.group_size
        self.store = rendezvous(cfg)
        port = self.store.port
        self._conns: list[Connection] = []
        self._procs: list = []
        self._stopped_since: dict[int, float] = {}  # rank -> when it was first seen stopped
        ctx = mp.get_context("spawn")  # a fresh interpreter: no forked threads or OpenMP team
        for rank in range(1, self.size):
            mine, theirs = ctx.Pipe()
            bound_writes(mine, SEND_TIMEOUT_S)
            proc = ctx.Process(target=follower_main, args=(cfg, rank, port, theirs),
                               name=f"{cfg.worker_id}-rank{rank}")
            proc.start()
            theirs.close()
            self._conns.append(mine)
            self._procs.append(proc)

    def join(self, num_blocks: int, endpoints: dict[str, str]) -> dict[str, str]:
        """Waits for every follower's build; the group's endpoints (every rank's, in rank
        order). Runs on the step thread, after connect and the leader's own build."""
        group = {name: [ep] for name, ep in endpoints.items()}
        for rank, conn in enumerate(self._conns, 1):
            hello = json.loads(self._recv(rank, conn, self.cfg.group_start_timeout_s))
            if hello["num_blocks"] != num_blocks:
                raise GroupBroken(f"rank {rank} has {hello['num_blocks']} KV blocks, rank 0 "
                                  f"{num_blocks}")
            for name, ep in hello["endpoints"].items():
                group[name].append(ep)
        log.info("worker group of %d ranks ready", self.size)
        return {name: ",".join(eps) for name, eps in group.items()}

    def plan(self, plan_pb: bytes) -> None:
        for rank, conn in enumerate(self._conns, 1):
            send(rank, conn, PLAN + plan_pb)

    def reset(self) -> None:
        for rank, conn in enumerate(self._conns, 1):
            send(rank, conn, RESET)

    def stepped(self, result: StepResult) -> StepResult:
        """The leader's step result, once every follower sampled the same."""
        mine = digest(result)
        for rank, conn in enumerate(self._conns, 1):
            answer = self._recv(rank, conn, STEP_TIMEOUT_S, STEP)
            if answer != mine:
                raise GroupBroken(f"rank {rank} sampled other tokens than rank 0 in step "
                                  f"{result.step_id}")
        return result

    def sent(self, done: TransfersDone, worker: Worker) -> TransfersDone:
        """The leader's sends merged with every follower's: a transfer failed where any rank's
        shard did; the counters carry every rank's bytes sent."""
        errors = {d.transfer_id: d.error for d in done.done}
        bytes_sent = []
        for rank, conn in enumerate(self._conns, 1):
            # one after another, each within the transfer timeout
            theirs = json.loads(self._recv(
                rank, conn, (self.cfg.kv_transfer_timeout_s + 30) * max(1, len(done.done)),
                SENT))
            for tid, error in theirs["done"].items():
                if error and not errors.get(tid):
                    errors[tid] = f"rank {rank}: {error}"
            bytes_sent.append(theirs["bytes_sent"])
        worker.followers_sent(bytes_sent)
        return TransfersDone(tuple(TransferDone(d.transfer_id, errors[d.transfer_id])
                                   for d in done.done), worker.counters)

    def _recv(self, rank: int, conn: Connection, timeout_s: float,
              kind: bytes | None = None) -> bytes:
        deadline = time.monotonic() + timeout_s
        while not conn.poll(min(1.0, max(0.0, deadline - time.monotonic()))):
            if (gone := self._gone(rank)) is not None:
                raise GroupBroken(gone)
            if time.monotonic() >= deadline:
                raise GroupBroken(f"rank {rank} did not answer within {timeout_s:.0f} s")
        try:
            msg = conn.recv_bytes()
        except (EOFError, OSError):
            raise GroupBroken(f"rank {rank} is gone") from None
        if kind is not None and msg[:1] != kind:
            raise GroupBroken(f"rank {rank} answered {msg[:1]!r} where {kind!r} was due")
        return msg[1:] if kind is not None else msg

    def close(self, timeout_s: float = 10.0) -> None:
        """Ends the followers: their pipes close, they leave; those that do not are killed."""
        for conn in self._conns:
            conn.close()
        deadline = time.monotonic() + timeout_s
        for proc in self._procs:
            if stopped(proc.pid):  # it cannot leave before it is let go on
                proc.kill()
            proc.join(max(0.0, deadline - time.monotonic()))
            if proc.is_alive():
                proc.kill()
                proc.join(5)

    def lost(self) -> str | None:
        """Which follower exited or froze, if one did."""
        for rank in range(1, self.size):
            if (gone := self._gone(rank)) is not None:
                return gone
        return None

    def _gone(self, rank: int) -> str | None:
        """Why follower `rank` is out of the group (it exited, or has been stopped for
        STOPPED_TIMEOUT_S), or None."""
        proc = self._procs[rank - 1]
        if proc.exitcode is not None:
            return f"rank {rank} exited with status {proc.exitcode}"
        if not stopped(proc.pid):
            self._stopped_since.pop(rank, None)
            return None
        since = self._stopped_since.setdefault(rank, time.monotonic())
        if time.monotonic() - since < STOPPED_TIMEOUT_S:
            return None
        return f"rank {rank} has been stopped for {STOPPED_TIMEOUT_S:.0f} s (frozen)"


def stat_fields(pid: int) -> list[bytes]:
    """The fields of /proc/PID/stat after the process's name (state, parent pid, ...), or none
    where there is no such process."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            return f.read().rpartition(b")")[2].split()  # past the name, which may hold any byte
    except OSError:
        return []


def process_state(pid: int) -> bytes | None:
    """Process `pid`'s state as Linux's /proc has it (R, S, D, T stopped by a signal, t by a
    tracer, Z...), or None where there is no such process."""
    fields = stat_fields(pid)
    return fields[0] if fields else None


def stopped(pid: int) -> bool:
    """Whether process `pid` is stopped, by a signal or by a tracer (False where it is gone:
    its exitcode tells)."""
    return process_state(pid) in (b"T", b"t")


def bound_writes(conn: Connection, timeout_s: float) -> None:
    """A write to conn (a duplex pipe: a socket pair) that moves no byte for timeout_s fails
    instead of waiting for a reader that stopped reading."""
    sec = int(timeout_s)
    with socket.fromfd(conn.fileno(), socket.AF_UNIX, socket.SOCK_STREAM) as sock:  # a dup
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDTIMEO,
                        struct.pack("ll", sec, int((timeout_s - sec) * 1e6)))


def send(rank: int, conn: Connection, msg: bytes) -> None:
    """msg to follower `rank`; GroupBroken if it is gone or takes nothing in time (the pipe's
    stream is broken then: a message may have gone out in part)."""
    try:
        conn.send_bytes(msg)
    except BlockingIOError:  # the deadline bound_writes set passed
        raise GroupBroken(f"rank {rank} took nothing of a message in time: alive but not "
                          f"reading") from None
    except OSError as e:
        raise GroupBroken(f"rank {rank} is gone ({e})") from None


def leave(status: int) -> NoReturn:
    """Ends a rank's process (the leader's too) without the interpreter's teardown: gloo's
    threads may still release a finished collective's tensors, which takes the GIL, and a thread
    asking for it while the interpreter finalizes aborts the process. Spans still batched are
    exported first."""
    from opentelemetry import trace
    shutdown = getattr(trace.get_tracer_provider(), "shutdown", None)
    if shutdown is not None:
        shutdown()
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(status)


def _die_with_parent() -> None:
    """SIGKILL when the leader dies, however it dies (Linux)."""
    try:
        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        libc.prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except OSError:
        pass
    if os.getppid() == 1:  # it died before the call
        os._exit(1)


def follower_main(cfg: WorkerConfig, rank: int, port: int, conn: Connection) -> None:
    """A follower rank: builds its share, then runs what the leader sends until the pipe
    closes."""
    from common.worker.service import build_worker
    from protos import worker_pb2
    from protos.worker_codec import plan_from_pb
    _die_with_parent()
    for sig in (signal.SIGINT, signal.SIGTERM):  # the leader decides when the group stops
        signal.signal(sig, signal.SIG_IGN)
    logging.basicConfig(level=logging.INFO,
                        format=f"%(asctime)s rank{rank} %(levelname)s %(name)s: %(message)s")
    status = 1
    worker = None
    try:
        worker, reg = build_worker(cfg, connect(cfg, rank, port))
        freeze_startup_heap()
        # its tcp listener takes frames on an event loop of its own (the leader's run on its
        # service's loop)
        listening = asyncio.new_event_loop()
        # (frames land on threads of its own, one torch thread each: no second OpenMP team)
        listening.set_default_executor(ThreadPoolExecutor(
            initializer=torch.set_num_threads, initargs=(1,), thread_name_prefix="kv-land"))
        threading.Thread(target=listening.run_forever, name="kv-listeners", daemon=True).start()
        for listener in worker.listeners.values():
            asyncio.run_coroutine_threadsafe(listener.start(), listening).result(
                cfg.connect_timeout_s)
        endpoints = {name: listener.endpoint() for name, listener in worker.listeners.items()}
        conn.send_bytes(json.dumps({"num_blocks": reg.num_blocks,
                                    "endpoints": endpoints}).encode())
        while True:
            try:
                msg = conn.recv_bytes()
            except (EOFError, OSError):
                status = 0  # the leader closed the group
                break
            if msg[:1] == RESET:
                worker.reset()
                continue
            plan = plan_from_pb(worker_pb2.StepPlan.FromString(msg[1:]))
            _follow(worker, plan, conn)
    except Exception:  # noqa: BLE001 - the process's last frame: whatever ends the rank (a
        # failed collective, a bad plan, its build) is logged here, since leave() below exits
        # without the interpreter's traceback; the leader sees the exit and breaks the group
        log.exception("rank %d failed", rank)
    finally:
        if worker is not None:
            worker.close()
        leave(status)


def _follow(worker: Worker, plan: StepPlan, conn: Connection) -> None:
    """The calls the leader's loop (service._run_plans) makes for one plan, in its order."""
    ready = worker.ready_sends(plan)
    if ready:
        _sent(worker.send_kv(ready), conn)
    sub_step, more = 0, True
    while more:
        result = worker.execute(plan, sub_step)
        conn.send_bytes(STEP + digest(result))
        sub_step, more = sub_step + 1, result.more
    if plan.sends:
        _sent(worker.send_kv(plan.sends), conn)


def _sent(done: TransfersDone, conn: Connection) -> None:
    conn.send_bytes(SENT + json.dumps({
        "done": {d.transfer_id: d.error for d in done.done},
        "bytes_sent": done.counters.kv_bytes_sent_per_rank[0]}).encode())
