"""Which CPU workers of this host step now: a step planned on more threads than a worker's share
of its cores (the scheduler lends a free peer's cores, services/scheduler/cores.py) gives the
lent ones back after its next layer while a peer sharing them runs a step, and takes them again
after the layer in which that step ends (a decode step of a small model may be over long
before the prefill step beside it). A step planned on its share while a peer stepped takes the
peer's cores too after a layer that ends with every peer quiet for QUIET_S (no step since): the
last prompts of a burst no longer finish on one core beside an idle one.

The scheduler plans each step's threads from what it knows when it plans: a prefill step given
both cores of an idle decode worker keeps them when a request reaches that decode worker a
moment later, and a decode step planned ahead on both keeps them when a prompt reaches the
prefill worker. Both then run a thread on one core: the worker at the lower priority
(`--cpu-nice`) waits there for the core, and its other threads wait for that one at every
parallel region; on two cores a prefill step so overlapped ran at 566 prompt tokens/s against
849 on its one core alone.

Each worker publishes a small segment in /dev/shm (`pdserve-cores-<its scheduler and host>-
<worker id>`): the cores it runs on (a bit mask), whether a step of it runs now and when its
last one ended (CLOCK_MONOTONIC, one clock for every process of the host); it holds a
lock on its segment for as long as it lives, so a dead worker's segment is swept and never
counts as stepping. Each worker maps its peers' segments (found again at most once a second,
at a step's start) and reads them at the start and after each layer of its steps.
"""
from __future__ import annotations

import hashlib
import logging
import mmap
import os
import time
from collections.abc import Callable, Iterable
from pathlib import Path

import numpy as np

from common.shm_segments import BOARD_PREFIX, SHM_DIR, create_segment, remove_if_unheld

log = logging.getLogger(__name__)

RESCAN_S = 1.0  # peers that start or die are seen within this (at the next step's start)
# A peer quiet this long has nothing queued: a decode worker's steps follow each other within a
# few ms (async scheduling plans the next while one runs); a prefill layer of 2048 tokens takes
# ~30-60 ms on one core, so taking cores a peer then wants costs at most about that much.
QUIET_S = 0.05
# a segment: int64 words, 1 while a step runs, then the clock's ns when the last step ended
# (0: none yet); then the core mask, little-endian, in as many 64-bit words as the highest core
# needs (peers' masks may differ in length)
_HEADER_BYTES = 16


def core_mask(cores: Iterable[int]) -> int:
    mask = 0
    for c in cores:
        if c < 0:
            raise ValueError(f"core {c}: core ids are not negative")
        mask |= 1 << c
    return mask


class _Segment:
    def __init__(self, path: Path, fd: int, writable: bool = True):
        self.path = path
        self.fd = fd
        self.map = mmap.mmap(fd, os.fstat(fd).st_size,
                             prot=mmap.PROT_READ | (mmap.PROT_WRITE if writable else 0))
        self.header = np.frombuffer(self.map, dtype=np.int64, count=2)  # [stepping, ended]
        self._mask = 0

    @staticmethod
    def size(mask: int) -> int:
        return _HEADER_BYTES + 8 * (mask.bit_length() // 64 + 1)

    def write_mask(self, mask: int) -> None:
        self.map[_HEADER_BYTES:] = mask.to_bytes(len(self.map) - _HEADER_BYTES, "little")

    def mask(self) -> int:
        """The owner's cores; read until found (its owner writes them just after the segment
        appears) and then kept: they do not change while it lives."""
        if not self._mask:
            self._mask = int.from_bytes(self.map[_HEADER_BYTES:], "little")
        return self._mask

    def close(self) -> None:
        del self.header  # the buffer's export, before the map closes
        self.map.close()
        os.close(self.fd)


class CoreBoard:
    """This worker's segment and its peers'; `share()`: the threads its step should run on
    while they step."""

    def __init__(self, worker_id: str, cores: Iterable[int], group: str,
                 shm_dir: Path = SHM_DIR, clock: Callable[[], float] = time.monotonic):
        self.cores = tuple(sorted(set(cores)))
        self.mask = core_mask(self.cores)
        self._dir = shm_dir
        self._clock = clock
        # the workers of one scheduler on this host: those whose cores it splits (cores.py)
        self._prefix = f"{BOARD_PREFIX}{hashlib.sha256(group.encode()).hexdigest()[:12]}-"
        path = shm_dir / f"{self._prefix}{worker_id}"
        self._own = _Segment(path, create_segment(path, _Segment.size(self.mask)))
        self._own.write_mask(self.mask)
        self._peers: dict[Path, _Segment] = {}
        self._scanned = float("-inf")

    def stepping(self, on: bool) -> None:
        """Marks a step of this worker as running (on) or ended; at a step's start, finds the
        peers again when the last look is older than RESCAN_S."""
        if not on:  # the end first: a peer that reads "not stepping" finds it too
            self._own.header[1] = int(self._clock() * 1e9)
        self._own.header[0] = int(on)
        if on and self._clock() - self._scanned >= RESCAN_S:
            self._rescan()

    def peers_stepping(self, quiet_s: float = 0.0) -> int:
        """Peers sharing a core with this worker that run a step now, or (quiet_s) ended one
        less than quiet_s ago."""
        since = int((self._clock() - quiet_s) * 1e9)
        return sum(1 for p in self._peers.values() if p.mask() & self.mask
                   and (p.header[0] or (quiet_s and p.header[1] > since)))

    def share(self, quiet_s: float = 0.0) -> int:
        """This worker's threads while its stepping peers (and, with quiet_s, those that stepped
        less than quiet_s ago) run theirs: its cores split among them and it (at least one)."""
        return max(1, len(self.cores) // (1 + self.peers_stepping(quiet_s)))

    def _rescan(self) -> None:
        self._scanned = self._clock()
        live = set()
        for path in self._dir.glob(f"{self._prefix}*"):
            if path == self._own.path:
                continue
            if remove_if_unheld(path):  # its worker is gone
                log.info("removed the core board segment of a dead worker: %s", path.name)
                continue
            live.add(path)
            if path not in self._peers:
                try:
                    fd = os.open(path, os.O_RDONLY)
                except OSError:
                    continue  # gone meanwhile
                self._peers[path] = _Segment(path, fd, writable=False)
        for path in set(self._peers) - live:
            self._peers.pop(path).close()

    def close(self) -> None:
        """Takes this worker off the board (its mappings go with the process: a step may still
        read them)."""
        self._own.header[0] = 0
        self._own.path.unlink(missing_ok=True)
