"""`pdserve gateway --workers N`: N gateway processes serving one port.

The parent binds the port once and starts N children (spawned, as uvicorn's --workers does);
each child runs the whole gateway (tokenizer, scheduler client, HTTP server) on the shared
socket, and the kernel hands each new connection to one of them. Request ids stay unique: each
process mints its own scheduler ids (uuid4), and a client's x-request-id is only echoed.

    parent   binds host:port, starts the children, restarts one that dies, forwards SIGINT /
             SIGTERM and waits for all of them (each drains its streams)
    child i  serve(config, sock): the gateway of a single process

Metrics: the children share prometheus_client's multiprocess directory, and each child's
/metrics sums every child's counters and histograms (a directory of the parent's, removed when
it ends, unless PROMETHEUS_MULTIPROC_DIR names one).
"""
from __future__ import annotations

import asyncio
import ctypes
import logging
import multiprocessing
import os
import shutil
import signal
import socket
import sys
import tempfile
import time
from multiprocessing.process import BaseProcess

from services.gateway.config import GatewayConfig

logger = logging.getLogger(__name__)

MULTIPROC_ENV = "PROMETHEUS_MULTIPROC_DIR"
PR_SET_PDEATHSIG = 1  # prctl(2)
RESTART_BACKOFF_S = 0.5  # doubled for each child in a row that died as it started
QUICK_DEATH_S = 10.0  # a child that dies sooner than this after its start died as it started
MAX_QUICK_DEATHS = 5
STOP_GRACE_S = 5.0  # past the children's own drain deadline


def bind(host: str, port: int) -> socket.socket:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, port))
    sock.listen(2048)
    sock.set_inheritable(True)
    return sock


def _child(config: GatewayConfig, log_level: str, sock: socket.socket,
           otlp_endpoint: str | None, parent: int) -> None:
    from common import torch_free
    torch_free.keep_out(config.model)  # before the serving modules' imports
    from common import tracing
    from services.gateway.main import serve

    _die_with_parent(parent)

    logging.basicConfig(level=logging.INFO,
                        format="%(asctime)s %(levelname)s %(name)s[%(process)d]: %(message)s")
    tracing.setup_tracing("pdserve-gateway", otlp_endpoint)
    try:
        raise SystemExit(asyncio.run(serve(config, log_level, sock)))
    except KeyboardInterrupt:
        raise SystemExit(130) from None


def run_processes(config: GatewayConfig, workers: int, log_level: str,
                  otlp_endpoint: str | None) -> int:
    """Serves until SIGINT/SIGTERM; 0 once every child ended cleanly, 1 when children keep
    dying as they start (MAX_QUICK_DEATHS in a row)."""
    sock = bind(config.host, config.port)
    own_dir = None
    if not os.environ.get(MULTIPROC_ENV):
        own_dir = tempfile.mkdtemp(prefix="pdserve-gateway-metrics-")
        os.environ[MULTIPROC_ENV] = own_dir  # the spawned children inherit it
    ctx = multiprocessing.get_context("spawn")
    stopping = False
    children: list[BaseProcess] = []
    started: dict[int, float] = {}

    def start() -> BaseProcess:
        p = ctx.Process(target=_child, args=(config, log_level, sock, otlp_endpoint, os.getpid()),
                        name="pdserve-gateway")
        p.start()
        started[id(p)] = time.monotonic()
        return p

    def stop(_signum: int, _frame: object) -> None:
        # SIGTERM to each: a terminal's SIGINT reached them already, and uvicorn takes a
        # second SIGINT as "exit now", cutting the streams it drains
        nonlocal stopping
        stopping = True
        for p in children:
            if p.pid is not None and p.is_alive():
                os.kill(p.pid, signal.SIGTERM)

    previous = {s: signal.signal(s, stop) for s in (signal.SIGINT, signal.SIGTERM)}
    quick_deaths = 0
    try:
        children.extend(start() for _ in range(workers))
        print(f"pdserve gateway: {workers} processes on {config.host}:{config.port} "
              f"(pids {' '.join(str(p.pid) for p in children)})", flush=True)
        while not stopping:
            for i, p in enumerate(children):
                if p.is_alive() or stopping:
                    continue
                _mark_dead(p)
                quick = time.monotonic() - started.pop(id(p)) < QUICK_DEATH_S
                quick_deaths = quick_deaths + 1 if quick else 0
                if quick_deaths >= MAX_QUICK_DEATHS:
                    logger.error("gateway processes die as they start; stopping")
                    stop(signal.SIGTERM, None)
                    break
                logger.warning("gateway process %s exited with %s; starting another",
                               p.pid, p.exitcode)
                time.sleep(RESTART_BACKOFF_S * 2 ** quick_deaths)
                if not stopping:  # a signal during the pause: no new child to miss it
                    children[i] = start()
            time.sleep(0.2)
        deadline = time.monotonic() + config.drain_timeout_s + STOP_GRACE_S
        for p in children:
            p.join(max(0.0, deadline - time.monotonic()))
            if p.is_alive():
                p.kill()
                p.join()
        clean = all(p.exitcode in (0, -signal.SIGINT, -signal.SIGTERM, 130) for p in children)
        return 0 if clean and quick_deaths < MAX_QUICK_DEATHS else 1
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)
        sock.close()
        if own_dir is not None:
            shutil.rmtree(own_dir, ignore_errors=True)


def _die_with_parent(parent: int) -> None:
    """SIGTERM (a drain) to this child when the parent dies, whoever kills the parent."""
    if sys.platform.startswith("linux"):
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGTERM)
    if os.getppid() != parent:  # it died before the line above
        os.kill(os.getpid(), signal.SIGTERM)


def _mark_dead(p: BaseProcess) -> None:
    """Its live gauges leave the sum (counters and histograms stay, as they should)."""
    from prometheus_client import multiprocess

    if p.pid is not None:
        multiprocess.mark_process_dead(p.pid)
