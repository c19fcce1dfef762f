"""A worker process: load the model, allocate the KV cache, dial the scheduler, run its plans.

The Attach stream is re-dialed when it breaks (the scheduler restarted, the network blinked);
the worker then starts afresh, since the scheduler re-queued everything it had planned here.

Health (grpc.health.v1, common/health.py) gets a small gRPC server of its own on --health-port:
a worker serves no gRPC otherwise (it dials the scheduler, and its KV listeners speak raw frames
over tcp and shared memory), and a probe of the scheduler's port would say nothing of this
process. "" is SERVING while the worker is attached and runs plans, NOT_SERVING while it dials,
re-dials or stops. The port opens once the model is loaded and the KV cache allocated, since
loading blocks the event loop: until then a probe cannot connect (a Kubernetes startupProbe
covers the load).
"""
from __future__ import annotations

import asyncio
import logging
import os
import signal
import socket
import time
from collections.abc import Awaitable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace

import grpc
import torch

from common import tracing
from common.grpc_options import channel_options, written
from common.health import Health
from common.heap import freeze_startup_heap
from common.kv_cache import LocalTier, PagedKVCache, SharedTier, on_device
from common.kv_layout import KVLayout, KVShard
from common.kv_transfer.base import KVReceiver, TransferConfig
from common.kv_transfer.registry import create_listener, create_sender
from common.models.attention import cpu_kernels, create_attention_backend
from common.models.llama import load_model
from common.models.packed_linear import panel_kernels
from common.plans import Registration, StepResult, TransfersDone
from common.shm_segments import SEGMENT_PREFIX, sweep_stale_segments
from common.tls import grpc_channel_credentials, scheduler_channel_options, warn_if_exposed
from common.worker.config import WorkerConfig
from common.worker.core_board import CoreBoard
from common.worker.cuda_graphs import DecodeGraphs
from common.worker.draft import DraftModel
from common.worker.grammars import Grammars
from common.worker.group import GroupBroken, GroupLeader, RankPlace, connect, rank_cores
from common.worker.memory import GIB, num_kv_blocks, warm_up_kernels
from common.worker.model_runner import ModelRunner
from common.worker.sampler import Sampler
from common.worker.speculative import SpeculativeConfig
from common.worker.step_threads import StepThreads
from common.worker.telemetry import WorkerTelemetry, start_telemetry
from common.worker.worker import Worker
from protos import worker_pb2, worker_pb2_grpc
from protos.worker_codec import plan_from_pb, registration_to_pb, result_to_pb, transfers_done_to_pb

log = logging.getLogger(__name__)


class RegistrationRefused(Exception):
    pass


def build_worker(cfg: WorkerConfig, place: RankPlace | None = None
                 ) -> tuple[Worker, Registration]:
    """The worker, or in a worker group (--tensor-parallel-size, --pipeline-parallel-size) the
    part of the rank at `place`: its share of the weights, its layers' and KV heads' cache
    (group.py)."""
    stale = sweep_stale_segments()
    if stale:
        log.info("removed KV segments of dead workers: %s", ", ".join(stale))
    size = cfg.group_size
    rank = place.rank if place is not None else 0
    group_cores = cfg.cpu_cores or tuple(sorted(os.sched_getaffinity(0)))
    cores = rank_cores(cfg.cpu_cores, size, rank)
    if cores:
        os.sched_setaffinity(0, cores)
    if cfg.cpu_nice:
        lower_priority(cfg.cpu_nice)
    if size > 1:  # the group's threads split between its ranks
        share = cfg.cpu_threads // size if cfg.cpu_threads else \
            len(cores) if len(cfg.cpu_cores) >= size else len(group_cores) // size
        torch.set_num_threads(max(1, share))
    elif cfg.cpu_threads or cfg.cpu_cores:
        torch.set_num_threads(cfg.cpu_threads or len(cfg.cpu_cores))
    dtype = getattr(torch, cfg.dtype)
    device = torch.device(cfg.resolved_device())
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())  # "cuda": the current GPU
    if device.type == "cuda":
        torch.cuda.set_device(device)  # this thread's; step threads enter the device themselves
    start = time.monotonic()
    backend = create_attention_backend(cfg.attention_backend, device)  # builds or loads kernels
    log.info("%s attention backend ready in %.2f s", type(backend).__name__,
             time.monotonic() - start)
    model = load_model(cfg.model, backend, dtype, device, prepack=cfg.prepack_weights,
                       progress=cfg.use_tqdm_on_load and rank == 0,
                       tp=place.tp if place else None, pp=place.pp if place else None)
    # where the kernels' panel linears multiply, the kernels' own pool runs the steps
    threads = StepThreads(panel_kernels(model))
    if threads.pooled:
        log.info("steps run on the CPU kernels' thread pool (%d threads)", threads.get())
    mc = model.config
    group_layout = KVLayout(num_layers=mc.num_layers, num_kv_heads=mc.num_kv_heads,
                            head_dim=mc.head_dim, block_size=cfg.block_size, dtype=cfg.dtype,
                            tensor_parallel_size=cfg.tensor_parallel_size,
                            pipeline_parallel_size=cfg.pipeline_parallel_size)
    shard = group_layout.shard(place.tp_rank, place.stage) if place else group_layout.shard()
    layout = group_layout.shard_layout(shard)  # this rank's cache
    # every rank of a group as many blocks (the same block ids), as many as the rank holding
    # the most layers and heads can afford from the memory each rank is given
    largest = max((group_layout.shard_layout(group_layout.shard(t, p))
                   for t in range(cfg.tensor_parallel_size)
                   for p in range(cfg.pipeline_parallel_size)), key=lambda x: x.block_bytes)
    num_blocks = num_kv_blocks(cfg.num_kv_blocks, cfg.kv_cache_memory_mib,
                               cfg.gpu_memory_utilization, cfg.max_num_batched_tokens, model,
                               largest, device)
    # on a GPU the cache is device memory: peers reach it over tcp or nccl, not shm
    shm_name = f"{SEGMENT_PREFIX}{cfg.worker_id}{f'-rank{rank}' if rank else ''}" \
        if device.type == "cpu" else None
    cache = PagedKVCache(layout, num_blocks, shm_name=shm_name, device=device)
    host_id = cfg.host_id or default_host_id()
    tier = second_tier(cfg, layout, host_id, mc.fingerprint, device)
    # a group's ranks each listen: on consecutive ports from a fixed one
    tcfg = TransferConfig(timeout_s=cfg.kv_transfer_timeout_s, secret=cfg.kv_secret.encode(),
                          tcp_host=cfg.kv_host, tcp_port=cfg.kv_port + rank if cfg.kv_port else 0,
                          advertise_host=cfg.kv_advertise_host,
                          advertise_port=cfg.kv_advertise_port + rank
                          if cfg.kv_advertise_port else 0, tls=cfg.tls)
    if "tcp" in cfg.kv_transports:
        warn_if_exposed(cfg.kv_host, cfg.tls, "the tcp KV listener",
                        "read the KV it receives" + ("" if cfg.kv_secret else
                                                     ", or write into its cache"))
    if "nccl" in cfg.kv_transports and cfg.tls is not None:
        log.warning("the nccl KV transport moves KV outside TLS (NCCL does not encrypt); "
                    "--kv-secret still authenticates its frames")
    receiver = KVReceiver()
    max_len = min(cfg.max_model_len or mc.max_position_embeddings, mc.max_position_embeddings)
    if device.type == "cuda":
        start = time.monotonic()
        with on_device(device):
            warm_up_kernels(model, layout, device)
        torch.cuda.synchronize(device)
        log.info("attention kernels warmed up in %.1f s", time.monotonic() - start)
    graphs = None
    if device.type == "cuda" and not cfg.enforce_eager:
        graphs = DecodeGraphs(model, cache.layers, cfg.block_size, max_len,
                              cfg.max_cudagraph_capture_size)
        with on_device(device):
            graphs.capture()
    grammars = Grammars(cfg.model, mc.vocab_size)  # xgrammar loads at the first guided request
    speculative = cfg.speculative()
    sampler = Sampler(mc.vocab_size, cfg.seed, cpu_kernels=cpu_kernels(backend, device))
    draft = None
    if speculative is not None and speculative.method == "draft_model":
        draft = build_draft(speculative, model, backend, dtype, device, cfg, num_blocks,
                            sampler)
    runner = ModelRunner(model, cache, sampler, graphs, grammars, speculative, draft, threads)
    worker = Worker(runner, cache,
                    {t: create_sender(t, layout, tcfg, shard, KVShard.whole(group_layout))
                     for t in cfg.kv_transports},
                    receiver,
                    {t: create_listener(t, cache, receiver, tcfg, shard if size > 1 else None)
                     for t in cfg.kv_transports},
                    tier, group_size=size, pipeline=place.last_stage if place else None,
                    # workers sharing cores give lent ones back mid-step (core_board.py)
                    board=CoreBoard(cfg.worker_id, group_cores, f"{host_id}|{cfg.scheduler}")
                    if device.type == "cpu" and size == 1 else None)
    reg = Registration(
        worker_id=cfg.worker_id, role=cfg.role, model_fingerprint=mc.fingerprint,
        num_blocks=num_blocks, layout=group_layout, transports=cfg.kv_transports,
        kv_endpoints={}, host_id=host_id, max_model_len=max_len,
        cpu_cores=group_cores if device.type == "cpu" else (),
        num_speculative_tokens=speculative.num_speculative_tokens if speculative else 0,
        num_tier_blocks=tier.num_blocks if tier else 0, tier_id=tier.tier_id if tier else "")
    return worker, reg


def second_tier(cfg: WorkerConfig, layout: KVLayout, host_id: str, fingerprint: str,
                device: torch.device) -> LocalTier | SharedTier | None:
    """The worker's second KV tier, if --kv-offloading-size (or -blocks) asks for one: its own
    (native) or its host's (host)."""
    blocks = cfg.kv_offloading_blocks or int(cfg.kv_offloading_size_gib * GIB) // \
        layout.block_bytes
    if not blocks:
        return None
    if cfg.kv_offloading_backend == "host":
        if device.type != "cpu":
            raise ValueError("--kv-offloading-backend host shares a tier in /dev/shm between "
                             "CPU workers; beside a GPU use native")
        # one per host, model and scheduler: the scheduler's index is the only one it has
        tier: LocalTier | SharedTier = SharedTier(layout, blocks,
                                                  f"{host_id}|{cfg.scheduler}|{fingerprint}")
    else:
        tier = LocalTier(layout, blocks, pin=device.type == "cuda")
    log.info("second KV tier (%s): %d blocks, %.2f GiB of host memory%s",
             cfg.kv_offloading_backend, tier.num_blocks, tier.num_blocks * layout.block_bytes / GIB,
             f", shared as {tier.tier_id}" if tier.tier_id else "")
    return tier


def build_draft(spec: SpeculativeConfig, target, backend, dtype: torch.dtype,
                device: torch.device, cfg: WorkerConfig, num_blocks: int,
                sampler: Sampler) -> DraftModel:
    """The draft model of --speculative-config and its own KV cache, as many blocks as the
    target's (the same block ids). Raises ValueError for a draft whose vocabulary differs."""
    path = spec.model
    model = load_model(path, backend, dtype, device, prepack=cfg.prepack_weights,
                       progress=cfg.use_tqdm_on_load)
    dc = model.config
    if dc.vocab_size != target.config.vocab_size:
        raise ValueError(f"the draft model {path} has {dc.vocab_size} tokens, the target "
                         f"{target.config.vocab_size}: they must share the vocabulary")
    layout = KVLayout(num_layers=dc.num_layers, num_kv_heads=dc.num_kv_heads,
                      head_dim=dc.head_dim, block_size=cfg.block_size, dtype=cfg.dtype)
    log.info("draft model %s: %d layers, its KV cache %d blocks", path, dc.num_layers,
             num_blocks)
    return DraftModel(model, PagedKVCache(layout, num_blocks, device=device), sampler,
                      coupled=spec.acceptance_method == "coupled")


def lower_priority(nice: int) -> None:
    """Every thread of this process, and those it starts later (they inherit it), runs at
    `nice`: on Linux a nice value belongs to a thread, not to the process."""
    for tid in os.listdir("/proc/self/task"):
        try:
            os.setpriority(os.PRIO_PROCESS, int(tid), nice)
        except (ProcessLookupError, PermissionError):
            pass  # a thread that ended meanwhile, or a value this process may not set


async def start_listeners(worker: Worker, reg: Registration) -> None:
    """Starts every transport's listener and advertises where it listens."""
    for name, listener in worker.listeners.items():
        await listener.start()
        reg.kv_endpoints[name] = listener.endpoint()


def default_host_id() -> str:
    """Same host id = same memory: shared memory works between the two."""
    try:
        machine = open("/etc/machine-id").read().strip()
    except OSError:
        machine = ""
    return f"{socket.gethostname()}/{machine}"


async def attach_once(cfg: WorkerConfig, worker: Worker, reg: Registration,
                      telemetry: WorkerTelemetry | None = None,
                      health: Health | None = None,
                      leaving: asyncio.Event | None = None,
                      steps: ThreadPoolExecutor | None = None,
                      group: GroupLeader | None = None) -> None:
    """Registers and runs plans until the stream ends; health SERVING meanwhile. Once
    `leaving` is set, tells the scheduler, which ends the stream when the worker is drained.
    `steps`: the one thread that runs steps (see serve); None: a thread of its own. `group`:
    the followers of a worker group's leader, which run every plan beside it."""
    traced = telemetry if telemetry is not None and tracing.enabled() else None
    if cfg.tls is None:
        channel = grpc.aio.insecure_channel(cfg.scheduler, options=channel_options())
    else:
        channel = grpc.aio.secure_channel(cfg.scheduler, grpc_channel_credentials(cfg.tls),
                                          options=channel_options()
                                          + scheduler_channel_options(cfg.tls))
    async with channel:
        await asyncio.wait_for(channel.channel_ready(), cfg.connect_timeout_s)
        stream = _Stream(worker_pb2_grpc.WorkerControlStub(channel).Attach(),
                         cfg.write_timeout_s)
        now = replace(reg, cached_blocks=tuple(worker.block_hashes.items()))
        await stream.send(worker_pb2.WorkerMessage(register=registration_to_pb(now)))
        ack = await asyncio.wait_for(stream.read(), cfg.connect_timeout_s)
        if ack is grpc.aio.EOF:
            return
        if ack.ack.error:
            raise RegistrationRefused(ack.ack.error)
        log.info("worker %s registered with %s (%d KV blocks)", cfg.worker_id, cfg.scheduler,
                 reg.num_blocks)
        print(f"pdserve {cfg.role}-worker {cfg.worker_id} attached to {cfg.scheduler}", flush=True)
        if health is not None:
            await health.set("", True)
        leave = asyncio.create_task(_leave_when(leaving, stream, health))
        own = steps is None
        runner = ThreadPoolExecutor(1, thread_name_prefix="step") if steps is None else steps
        try:
            await _run_plans(stream, worker, runner, traced, group)
        finally:
            if own:
                runner.shutdown()
            leave.cancel()
            if health is not None:
                await health.set("", False)


class _Stream:
    """The worker's side of its Attach stream. It sends one message at a time, each taken by
    the scheduler within timeout_s or TimeoutError (a scheduler whose process answers
    keepalive's pings but whose event loop reads nothing would hold the write for ever); the
    stream is then dropped and the worker attaches again."""

    def __init__(self, call, timeout_s: float):
        self.call, self.timeout_s = call, timeout_s
        self._one = asyncio.Lock()

    async def read(self):
        """The next message, or grpc.aio.EOF."""
        return await self.call.read()

    async def send(self, message: worker_pb2.WorkerMessage) -> None:
        async with self._one:
            if not await written(self.call, message, self.timeout_s):
                raise TimeoutError(f"the scheduler took no message in {self.timeout_s:g} s")


async def _leave_when(leaving: asyncio.Event | None, stream: _Stream,
                      health: Health | None) -> None:
    if leaving is None:
        return
    await leaving.wait()
    if health is not None:
        await health.set("", False)
    try:
        await stream.send(worker_pb2.WorkerMessage(leave=worker_pb2.Leave()))
    except TimeoutError as e:  # the drain's deadline ends the stream
        log.warning("leaving: %s", e)


async def _run_plans(stream: _Stream, worker: Worker, steps: ThreadPoolExecutor,
                     traced: WorkerTelemetry | None, group: GroupLeader | None = None) -> None:
    """Every step and send on one thread: torch's thread count and OpenMP's thread team belong
    to the thread that runs them, and a second team would spin beside the first. A group's
    followers make the same calls on the same plan (group._follow); the leader answers each
    once they agree. Once a group's followers have a plan, the leader makes every call of it
    even if the stream breaks on the way (answering nothing more), so that the group is at the
    same point when it re-attaches; the break is raised after the plan."""
    loop = asyncio.get_running_loop()
    broken: list[BaseException] = []  # the first answer that failed to go out, this plan

    async def answer(msg: worker_pb2.WorkerMessage) -> None:
        if broken:
            return
        try:
            await stream.send(msg)
        except (grpc.aio.AioRpcError, asyncio.InvalidStateError, OSError, TimeoutError) as e:
            if group is None:
                raise
            broken.append(e)

    def execute(plan, sub_step: int) -> StepResult:
        if group is None:
            return worker.execute(plan, sub_step)
        try:
            result = worker.execute(plan, sub_step)
        except RuntimeError as e:  # a collective whose peer died or timed out
            lost = group.lost()
            raise GroupBroken(f"{lost + ': ' if lost else ''}step {plan.step_id} failed: "
                              f"{e}") from e
        return group.stepped(result)

    def send_kv(sends) -> TransfersDone:
        done = worker.send_kv(sends)
        return done if group is None else group.sent(done, worker)

    while True:
        msg = await stream.read()
        if msg is grpc.aio.EOF:
            return
        plan = plan_from_pb(msg.plan)
        if group is not None:  # from the step thread: the pipe may hold the loop up
            await loop.run_in_executor(steps, group.plan, msg.plan.SerializeToString())
        ready = worker.ready_sends(plan)
        if ready:  # KV computed by earlier steps leaves now, not after this step's forward
            done = await loop.run_in_executor(steps, send_kv, ready)
            await answer(worker_pb2.WorkerMessage(transfers=transfers_done_to_pb(done)))
        sub_step, more = 0, True
        while more:  # a plan of several decode steps answers after each
            if traced is not None:
                traced.before_step(plan)
            result = await loop.run_in_executor(steps, execute, plan, sub_step)
            if traced is not None:
                traced.after_step(plan, result)
            await answer(worker_pb2.WorkerMessage(result=result_to_pb(result)))
            sub_step, more = sub_step + 1, result.more
        if plan.sends:
            done = await loop.run_in_executor(steps, send_kv, plan.sends)
            await answer(worker_pb2.WorkerMessage(transfers=transfers_done_to_pb(done)))
        if broken:
            raise broken[0]


async def _first(task: asyncio.Task, other: Awaitable, timeout: float | None = None) -> None:
    """Until task or other ends (or timeout passes); other is cancelled."""
    waiter = asyncio.ensure_future(other)
    try:
        await asyncio.wait([task, waiter], timeout=timeout,
                           return_when=asyncio.FIRST_COMPLETED)
    finally:
        waiter.cancel()


async def start_health(cfg: WorkerConfig) -> Health | None:
    """The health server on --health-port, NOT_SERVING until attached; None when 0."""
    if not cfg.health_port:
        return None
    health, port = await Health.serve(cfg.health_host, cfg.health_port)
    log.info("grpc.health.v1 on %s:%d", cfg.health_host, port)
    return health


async def serve(cfg: WorkerConfig) -> int:
    tracing.setup_tracing(f"pdserve-{cfg.role}-worker", cfg.otlp_traces_endpoint)
    # one thread loads the model and runs every step: oneDNN's prepacked linears and torch's
    # thread team belong to the thread that made them (built on another thread, a decode step
    # of one sequence took 18-25 ms with 2 threads, as slow as with 1; 15-18 ms on its own)
    steps = ThreadPoolExecutor(1, thread_name_prefix="step")
    # a group's followers load their shares while this process loads its own
    group = GroupLeader(cfg) if cfg.group_size > 1 else None
    try:
        status = await _serve(cfg, steps, group)
        if group is not None and (lost := group.lost()) is not None:
            raise GroupBroken(lost)
        return status
    except GroupBroken as e:
        log.error("worker group broken: %s", e)
        print(f"pdserve {cfg.role}-worker {cfg.worker_id}: worker group broken: {e}",
              flush=True)
        return 1
    finally:
        if group is not None:
            group.close()


async def _unless_lost(group: GroupLeader, future: Awaitable):
    """future's result, or GroupBroken as soon as a follower exits or freezes first (a rank
    that cannot start would leave the others waiting for it until the collectives' deadline)."""
    task = asyncio.ensure_future(future)
    while not task.done():
        if (lost := group.lost()) is not None:
            raise GroupBroken(lost)
        await asyncio.wait([task], timeout=0.5)
    return task.result()


async def _watch(group: GroupLeader, stop: asyncio.Event, now: asyncio.Event) -> None:
    """A follower that exits or freezes (GroupLeader.lost) takes the group out at once, not
    at the next plan: the Attach stream ends, and the scheduler re-queues the group's
    requests."""
    while group.lost() is None:
        await asyncio.sleep(0.5)
    stop.set()
    now.set()


async def _serve(cfg: WorkerConfig, steps: ThreadPoolExecutor,
                 group: GroupLeader | None) -> int:
    loop = asyncio.get_running_loop()
    place = None
    if group is not None:  # the group's collectives first: the model's layers hold them
        place = await _unless_lost(group, loop.run_in_executor(steps, connect, cfg, 0,
                                                               group.store))
    worker, reg = await loop.run_in_executor(steps, build_worker, cfg, place)
    # ... and only that thread runs an OpenMP team: this one (KV frames landing in the cache)
    # copies on its own. A second team would take cores from the step's threads mid-step and,
    # with more of libgomp's threads than cores, make every team sleep between its parallel
    # regions instead of spinning (layer_streamer.py). Only after the build: a thread's first
    # torch op takes the thread count last set on any thread, and the step thread has had its
    # own by now.
    torch.set_num_threads(1)
    log.info("%d objects of start-up frozen out of garbage collection", freeze_startup_heap())
    await start_listeners(worker, reg)
    if group is not None:  # every rank's cache in the endpoints, once all are built
        reg.kv_endpoints.update(await asyncio.get_running_loop().run_in_executor(
            steps, group.join, reg.num_blocks, dict(reg.kv_endpoints)))
    telemetry = await start_telemetry(cfg, worker)
    health = await start_health(cfg)
    stop, now = asyncio.Event(), asyncio.Event()  # the first signal drains, a second ends it
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, lambda: now.set() if stop.is_set() else stop.set())
    watch = asyncio.create_task(_watch(group, stop, now)) if group is not None else None
    try:
        while not stop.is_set():
            task = asyncio.create_task(attach_once(cfg, worker, reg, telemetry, health, stop,
                                                   steps, group))
            await _first(task, stop.wait())
            if not task.done():  # leaving: the scheduler ends the stream once drained
                log.info("leaving: draining for up to %.0f s", cfg.drain_timeout_s)
                await _first(task, now.wait(), timeout=cfg.drain_timeout_s)
            if not task.done():
                task.cancel()
                break
            try:
                task.result()
            except RegistrationRefused as e:
                log.error("the scheduler refused this worker: %s", e)
                print(f"pdserve {cfg.role}-worker refused: {e}", flush=True)
                return 1
            # InvalidStateError: a write to a stream the scheduler's end already closed
            except (TimeoutError, grpc.aio.AioRpcError, OSError, asyncio.InvalidStateError) as e:
                detail = e.details() if isinstance(e, grpc.aio.AioRpcError) else repr(e)
                log.warning("scheduler %s unreachable or stream broken: %s", cfg.scheduler, detail)
            worker.reset()
            if group is not None:
                group.reset()
            if telemetry is not None:
                telemetry.reset()
            try:
                await asyncio.wait_for(stop.wait(), cfg.reconnect_s)
            except TimeoutError:
                pass
    finally:
        if watch is not None:
            watch.cancel()
        if health is not None:
            await health.stop()
        worker.close()
        for listener in worker.listeners.values():
            await listener.close()
        steps.shutdown(wait=False)
    return 0
