"""The /dev/shm segments behind KV caches and tiers: made locked by their owner, removed once
nobody holds them. Without torch, so that the launcher can sweep a crashed worker's segments
without importing it."""
from __future__ import annotations

import fcntl
import os
from pathlib import Path

SHM_DIR = Path("/dev/shm")
SEGMENT_PREFIX = "pdserve-kv-"
BOARD_PREFIX = "pdserve-cores-"  # a CPU worker's steps, for the peers sharing its cores


def create_segment(path: Path, nbytes: int) -> int:
    """Creates a shared segment and returns an fd holding a shared flock on it for as long as
    the owner lives: a segment nobody holds locked belongs to a dead worker (see
    sweep_stale_segments). The file gets its final name only once locked."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}")
    fd = os.open(tmp, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_SH)
        os.ftruncate(fd, nbytes)
        if path.exists():
            raise FileExistsError(f"{path} exists: another worker uses this id")
        os.rename(tmp, path)
    except BaseException:
        os.close(fd)
        tmp.unlink(missing_ok=True)
        raise
    return fd


def sweep_stale_segments(shm_dir: Path = SHM_DIR) -> list[str]:
    """Removes the KV segments and core board segments (core_board.py) of workers that died
    without cleaning up (a crash, SIGKILL); works across containers sharing /dev/shm, where
    process ids mean nothing."""
    return [path.name for prefix in (SEGMENT_PREFIX, BOARD_PREFIX)
            for path in shm_dir.glob(f"{prefix}*") if remove_if_unheld(path)]


def remove_if_unheld(path: Path) -> bool:
    """Removes a segment nobody holds a lock on (its owners are gone); whether it did."""
    try:
        fd = os.open(path, os.O_RDWR)
    except OSError:
        return False  # gone already
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        path.unlink(missing_ok=True)  # under the lock: nobody maps it in between
        return True
    except BlockingIOError:
        return False  # an owner is alive
    finally:
        os.close(fd)  # also drops the lock if we took it
