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
import logging
import multiprocessing
import os
import shutil
import signal
import socket
import tempfile
import time
from multiprocessing.process import BaseProcess

from services.gateway.config import GatewayConfig

logger = logging.getLogger(__name__)

MULTIPROC_ENV = "PROMETHEUS_MULTIPROC_DIR"
RESTART_BACKOFF_S = 1.0
STOP_TIMEOUT_S = 30.0


def bind(host: str, port: int) -> socket.socket:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, port))
    sock.listen(2048)
    sock.set_inheritable(True)
    return sock


def _child(config: GatewayConfig, log_level: str, sock: socket.socket,
           otlp_endpoint: str | None) -> None:
    from common import tracing
    from services.gateway.main import serve

    logging.basicConfig(level=logging.INFO,
                        format="%(asctime)s %(levelname)s %(name)s[%(process)d]: %(message)s")
    tracing.setup_tracing("pdserve-gateway", otlp_endpoint)
    try:
        raise SystemExit(asyncio.run(serve(config, log_level, sock)))
    except KeyboardInterrupt:
        raise SystemExit(130) from None


def run_processes(config: GatewayConfig, workers: int, log_level: str,
                  otlp_endpoint: str | None) -> int:
    """Serves until SIGINT/SIGTERM; 0 once every child ended cleanly."""
    sock = bind(config.host, config.port)
    own_dir = None
    if not os.environ.get(MULTIPROC_ENV):
        own_dir = tempfile.mkdtemp(prefix="pdserve-gateway-metrics-")
        os.environ[MULTIPROC_ENV] = own_dir  # the spawned children inherit it
    ctx = multiprocessing.get_context("spawn")
    stopping = False

    def start() -> BaseProcess:
        p = ctx.Process(target=_child, args=(config, log_level, sock, otlp_endpoint),
                        name="pdserve-gateway")
        p.start()
        return p

    def stop(signum: int, _frame: object) -> None:
        nonlocal stopping
        stopping = True
        for p in children:
            if p.pid is not None and p.is_alive():
                os.kill(p.pid, signum)

    children = [start() for _ in range(workers)]
    print(f"pdserve gateway: {workers} processes on {config.host}:{config.port} "
          f"(pids {' '.join(str(p.pid) for p in children)})", flush=True)
    previous = {s: signal.signal(s, stop) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        while not stopping:
            for i, p in enumerate(children):
                if not p.is_alive() and not stopping:
                    _mark_dead(p)
                    logger.warning("gateway process %s exited with %s; starting another",
                                   p.pid, p.exitcode)
                    time.sleep(RESTART_BACKOFF_S)
                    children[i] = start()
            time.sleep(0.2)
        deadline = time.monotonic() + STOP_TIMEOUT_S
        for p in children:
            p.join(max(0.0, deadline - time.monotonic()))
            if p.is_alive():
                p.kill()
                p.join()
        return 0 if all(p.exitcode in (0, -signal.SIGINT, -signal.SIGTERM, 130)
                        for p in children) else 1
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)
        sock.close()
        if own_dir is not None:
            shutil.rmtree(own_dir, ignore_errors=True)


def _mark_dead(p: BaseProcess) -> None:
    """Its live gauges leave the sum (counters and histograms stay, as they should)."""
    from prometheus_client import multiprocess

    if p.pid is not None:
        multiprocess.mark_process_dead(p.pid)
