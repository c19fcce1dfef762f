"""gRPC options every pdserve service uses: message size caps and keepalive.

Keepalive: a side pings a link that has been quiet for `time_s` and closes it when the ping is
not answered within `timeout_s`. A frozen peer (SIGSTOP, a host that is gone, a cut network) is
found in seconds instead of at the next step's or request's deadline: the scheduler drops such
a worker and re-queues its requests, a worker or gateway reconnects. Pings are answered by
gRPC's own threads, so a long step or a busy event loop never looks frozen. The scheduler
accepts its clients' pings as often as once a second.

For the same reason a peer whose process answers pings but whose event loop reads nothing looks
alive: once the link's flow-control window is full, a write to it waits for ever. `written`
gives such a write a deadline.
"""
from __future__ import annotations

import asyncio

MAX_MESSAGE_BYTES = 64 << 20
KEEPALIVE_TIME_S = 5.0     # the default: a quiet link is pinged after this long
KEEPALIVE_TIMEOUT_S = 5.0  # ... and closed when the ping is not answered in this long
MIN_CLIENT_PING_INTERVAL_MS = 1000

Options = list[tuple[str, int]]


def keepalive(time_s: float = KEEPALIVE_TIME_S,
              timeout_s: float = KEEPALIVE_TIMEOUT_S) -> Options:
    return [("grpc.keepalive_time_ms", int(time_s * 1000)),
            ("grpc.keepalive_timeout_ms", int(timeout_s * 1000)),
            ("grpc.http2.ping_timeout_ms", int(timeout_s * 1000)),  # keepalive pings too
            ("grpc.keepalive_permit_without_calls", 1),
            ("grpc.http2.max_pings_without_data", 0)]


def message_limits() -> Options:
    return [("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
            ("grpc.max_send_message_length", MAX_MESSAGE_BYTES)]


def server_options(time_s: float = KEEPALIVE_TIME_S,
                   timeout_s: float = KEEPALIVE_TIMEOUT_S) -> Options:
    return [*message_limits(), *keepalive(time_s, timeout_s),
            ("grpc.http2.min_recv_ping_interval_without_data_ms", MIN_CLIENT_PING_INTERVAL_MS),
            ("grpc.http2.max_ping_strikes", 0)]


def channel_options(time_s: float = KEEPALIVE_TIME_S,
                    timeout_s: float = KEEPALIVE_TIMEOUT_S) -> Options:
    return [*message_limits(), *keepalive(time_s, timeout_s)]


async def written(stream, message, timeout_s: float) -> bool:
    """Writes message on a stream (a server's context or a client's call); False when the peer
    took none of it within timeout_s (the write is cancelled, the stream is of no further use)."""
    try:
        await asyncio.wait_for(stream.write(message), timeout_s)
    except TimeoutError:
        return False
    return True
