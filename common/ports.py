"""Free TCP ports for a service that binds later, in another process.

A port that bind(0) reports free comes from the kernel's ephemeral range, the same range every
outgoing connection takes its local port from: between the choice and the service's own bind,
any connection on the host may take it. These ports come from below that range, where only an
explicit bind can claim one, and are checked free when chosen.
"""

from __future__ import annotations

import random
import socket
from collections.abc import Iterable
from pathlib import Path

EPHEMERAL_RANGE = Path("/proc/sys/net/ipv4/ip_local_port_range")
LOWEST = 10000  # below: well-known and registered services' usual ports


def ephemeral_range() -> tuple[int, int]:
    """The kernel's range for ports it assigns itself (Linux's default where it cannot be read)."""
    try:
        low, high = (int(v) for v in EPHEMERAL_RANGE.read_text().split())
        return low, high
    except (OSError, ValueError):
        return 32768, 60999


def free_ports(n: int, host: str = "127.0.0.1", rng: random.Random | None = None,
               exclude: Iterable[int] = ()) -> list[int]:
    """n distinct ports outside the ephemeral range, each free on `host` right now and none of
    `exclude` (ports chosen for services that have not bound them yet). Raises OSError when
    the range below it is too small or too busy to give n."""
    low, _ = ephemeral_range()
    candidates = list(range(LOWEST, low)) if low - LOWEST >= 4 * n else []
    (rng or random.Random()).shuffle(candidates)  # seeded from os.urandom
    chosen: list[int] = []
    excluded = set(exclude)
    for port in candidates:
        if len(chosen) == n:
            break
        if port in excluded:
            continue
        with socket.socket() as sock:
            try:
                sock.bind((host, port))
            except OSError:
                continue
        chosen.append(port)
    if len(chosen) < n:
        raise OSError(f"no {n} free ports between {LOWEST} and {low} (the ephemeral range "
                      f"starts at {low})")
    return chosen


def free_port(host: str = "127.0.0.1") -> int:
    return free_ports(1, host)[0]
