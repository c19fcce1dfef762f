"""`pdserve scheduler`."""
from __future__ import annotations

import argparse
import asyncio
import logging
import os
import signal

from services.scheduler.config import SchedulerConfig
from services.scheduler.server import create_server

log = logging.getLogger("pdserve.scheduler")


def add_arguments(p: argparse.ArgumentParser) -> None:
    d = SchedulerConfig()
    p.add_argument("--host", default=os.environ.get("PDSERVE_SCHEDULER_HOST", d.host),
                   help="address to listen on (env PDSERVE_SCHEDULER_HOST)")
    p.add_argument("--port", type=int, default=int(os.environ.get("PDSERVE_SCHEDULER_PORT", d.port)),
                   help="gRPC port for gateways and workers; 0 picks a free one "
                        "(env PDSERVE_SCHEDULER_PORT)")
    p.add_argument("--max-num-seqs", type=int, default=d.max_num_seqs,
                   help="most requests holding KV blocks on one worker at once")
    p.add_argument("--max-num-batched-tokens", type=int, default=d.max_num_batched_tokens,
                   help="token budget of one worker step (longer prompts are chunked)")
    p.add_argument("--max-model-len", type=int, default=d.max_model_len,
                   help="longest prompt + output in tokens; 0 takes the workers' limit")
    p.add_argument("--scheduling-policy", choices=["fcfs", "priority"], default=d.scheduling_policy,
                   help="order of admission from the waiting queue")
    p.add_argument("--placement", default=d.placement,
                   help="how a decode worker is chosen for a prefilled request")
    p.add_argument("--step-timeout", type=float, default=d.step_timeout_s,
                   help="seconds a worker may take for one step before it is dropped")


def config_from_args(args) -> SchedulerConfig:
    return SchedulerConfig(host=args.host, port=args.port, max_num_seqs=args.max_num_seqs,
                           max_num_batched_tokens=args.max_num_batched_tokens,
                           max_model_len=args.max_model_len,
                           scheduling_policy=args.scheduling_policy, placement=args.placement,
                           step_timeout_s=args.step_timeout)


async def serve(config: SchedulerConfig) -> None:
    server, port, _ = await create_server(config)
    log.info("scheduler listening on %s:%d", config.host, port)
    print(f"pdserve scheduler listening on {config.host}:{port}", flush=True)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()
    await server.stop(grace=2.0)


def run(args) -> int:
    asyncio.run(serve(config_from_args(args)))
    return 0
