"""Prometheus metrics: names like vLLM's under a `pdserve:` prefix, and a tiny /metrics server.

The gateway serves /metrics on its HTTP port. The scheduler and the workers serve it on
`--metrics-port` (0: off), from their own event loop, so a scrape reads their state between
two steps and never races it.
"""
from __future__ import annotations

import argparse
import asyncio
import logging
import os

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST

PREFIX = "pdserve:"
IO_TIMEOUT_S = 5.0

# vLLM's buckets, so that dashboards built for it read the same
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0,
                7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5,
               10.0, 20.0, 40.0, 80.0)
LATENCY_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0,
                   60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)
TRANSFER_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5,
                    5.0, 10.0, 30.0)

log = logging.getLogger(__name__)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--metrics-port", type=int,
                   default=int(os.environ.get("PDSERVE_METRICS_PORT", "0")),
                   help="serve Prometheus /metrics on this port; 0: off "
                        "(env PDSERVE_METRICS_PORT)")
    p.add_argument("--metrics-host", default=os.environ.get("PDSERVE_METRICS_HOST", "127.0.0.1"),
                   help="address /metrics binds (env PDSERVE_METRICS_HOST)")


async def start_metrics_server(registry: CollectorRegistry, host: str,
                               port: int) -> tuple[asyncio.Server, int]:
    """Answers GET /metrics with the registry's text format; returns the server and its port."""

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), IO_TIMEOUT_S)
            parts = head.split(b" ", 2)
            path = parts[1].split(b"?")[0] if len(parts) > 1 else b""
            if parts[0] == b"GET" and path in (b"/metrics", b"/"):
                status, ctype, body = b"200 OK", CONTENT_TYPE_LATEST.encode(), \
                    generate_latest(registry)
            else:
                status, ctype, body = b"404 Not Found", b"text/plain", b"try GET /metrics\n"
            writer.write(b"HTTP/1.1 " + status + b"\r\nContent-Type: " + ctype +
                         b"\r\nContent-Length: " + str(len(body)).encode() +
                         b"\r\nConnection: close\r\n\r\n" + body)
            await asyncio.wait_for(writer.drain(), IO_TIMEOUT_S)
        except (TimeoutError, asyncio.IncompleteReadError, asyncio.LimitOverrunError,
                ConnectionError):
            pass
        finally:
            writer.close()

    server = await asyncio.start_server(handle, host, port)
    bound = server.sockets[0].getsockname()[1]
    log.info("metrics on http://%s:%d/metrics", host, bound)
    return server, bound
