"""The paged KV cache: the one tensor for all layers (in shared memory on CPU), its
/dev/shm segments, and block copies. It sits below both the worker and the KV transports
(common/kv_transfer), which read and write the same tensor and import nothing from the worker.

Shape `[num_layers, 2, num_blocks, block_size, num_kv_heads, head_dim]`; layer l is a view
`[2, num_blocks, block_size, num_kv_heads, head_dim]`. Living in a /dev/shm file lets a peer on the
same host map it and write blocks straight into it (the shm transport).
"""
from __future__ import annotations

import contextlib
import ctypes
import errno
import fcntl
import hashlib
import os
import secrets
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch

from common.kv_layout import KVLayout
from common.shm_segments import SEGMENT_PREFIX, SHM_DIR, create_segment, remove_if_unheld


def map_shared(path: Path, shape: tuple[int, ...], dtype: torch.dtype,
               create: bool) -> torch.Tensor:
    """A tensor backed by a shared file; `create` needs the file made by create_segment."""
    numel = 1
    for s in shape:
        numel *= s
    nbytes = numel * torch.empty((), dtype=dtype).element_size()
    if not create and path.stat().st_size != nbytes:
        raise ValueError(f"{path} holds {path.stat().st_size} bytes, expected {nbytes}")
    return torch.from_file(str(path), shared=True, size=numel, dtype=dtype).view(shape)


MADV_POPULATE_WRITE = 23  # Linux 5.14+: back and map every page of a range now


def populate(tensor: torch.Tensor, path: Path, threads: int | None = None,
             min_slice: int = 64 << 20) -> None:
    """Backs every page of a shared cache before it serves: a page of /dev/shm is allocated
    and zeroed at its first write, which made a fresh cache's KV writes 13x slower (8 layers
    x 2048 float32 tokens: 30 ms against 2.3) on the first requests to reach each block; up
    front it costs ~0.6 s per GiB on one core, as a cache in torch.zeros would. The cache is
    backed in slices of at least `min_slice` bytes, one per thread (default: one per CPU the
    worker may run on; 2 GiB took 1.21-1.42 s on one core, 0.61-0.81 s on two), so a large
    cache on a large host starts in seconds, not minutes (unpinned, on a host of several
    sockets, the pages then land on the nodes of the threads that backed them). A /dev/shm too
    small for the cache then fails here (EFAULT), not with a SIGBUS mid-request; a memory limit
    the pages exceed still gets the worker OOM-killed, now at its start. Kernels older than
    5.14 (EINVAL) keep the pages lazy."""
    nbytes = tensor.numel() * tensor.element_size()
    if nbytes == 0:
        return
    if threads is None:
        threads = len(os.sched_getaffinity(0))
    unit = 2 << 20  # slices start on whole huge pages (and so on whole pages)
    count = max(1, min(threads, nbytes // max(min_slice, unit)))
    step = -(-nbytes // count // unit) * unit
    slices = [(offset, min(step, nbytes - offset)) for offset in range(0, nbytes, step)]
    libc = ctypes.CDLL(None, use_errno=True)

    def back(piece: tuple[int, int]) -> int:  # ctypes lets go of the GIL for the call
        offset, size = piece
        done = libc.madvise(ctypes.c_void_p(tensor.data_ptr() + offset), ctypes.c_size_t(size),
                            MADV_POPULATE_WRITE)
        return 0 if done == 0 else ctypes.get_errno()  # this thread's errno

    if len(slices) == 1:
        errors = [back(slices[0])]
    else:
        with ThreadPoolExecutor(len(slices), thread_name_prefix="kv-populate") as pool:
            errors = list(pool.map(back, slices))
    err = next((e for e in errors if e not in (0, errno.EINVAL)), 0)
    if err == 0:
        return
    where = ("is /dev/shm large enough? Lower --kv-cache-memory-mib or --num-kv-blocks, or "
             "give the container more shared memory" if err == errno.EFAULT else
             "lower --kv-cache-memory-mib or --num-kv-blocks")
    raise OSError(err, f"cannot back the KV cache's {nbytes} bytes in {path} "
                       f"({os.strerror(err)}): {where}")


class PagedKVCache:
    def __init__(self, layout: KVLayout, num_blocks: int, shm_name: str | None = None,
                 device: torch.device | str = "cpu"):
        assert num_blocks > 0, "a KV cache needs at least one block"
        self.layout = layout
        self.num_blocks = num_blocks
        shape = layout.cache_shape(num_blocks)
        device = torch.device(device)
        assert not (shm_name and device.type != "cpu"), "shared memory holds host tensors only"
        self.shm_path = SHM_DIR / shm_name if shm_name else None
        self._lock_fd: int | None = None
        if self.shm_path is not None:
            nbytes = layout.block_bytes * num_blocks
            self._lock_fd = create_segment(self.shm_path, nbytes)
            self.tensor = map_shared(self.shm_path, shape, layout.torch_dtype, create=True)
            try:
                populate(self.tensor, self.shm_path)
            except BaseException:  # OSError, or a thread that could not start: no segment left
                self.close()
                raise
        else:
            self.tensor = torch.zeros(shape, dtype=layout.torch_dtype, device=device)
        self.layers = list(self.tensor.unbind(0))

    def close(self) -> None:
        """Removes the shared segment; peers that mapped it keep the mapping until they drop it."""
        if self.shm_path is not None:
            self.shm_path.unlink(missing_ok=True)
            self.shm_path = None
        if self._lock_fd is not None:
            os.close(self._lock_fd)
            self._lock_fd = None


TIER_PREFIX = f"{SEGMENT_PREFIX}tier-"


class LocalTier:
    """A worker's own second KV tier (--kv-offloading-backend native): blocks laid out as the
    cache's, in host memory (pinned beside a GPU) whose pages are touched only where blocks are
    stored."""

    tier_id = ""  # its own: the scheduler keeps an index for this worker alone

    def __init__(self, layout: KVLayout, num_blocks: int, pin: bool = False):
        self.num_blocks = num_blocks
        self.tensor = torch.empty(layout.cache_shape(num_blocks), dtype=layout.torch_dtype,
                                  pin_memory=pin)

    def close(self) -> None:
        pass


class SharedTier:
    """A second KV tier in one /dev/shm segment that every worker of a host serving the same
    model with the same KV layout for the same scheduler maps (--kv-offloading-backend host):
    blocks one worker stores another can load (the scheduler keeps the one index; another
    deployment on the host gets a segment of its own). The first worker creates it at its
    --kv-offloading-size, later ones map it at the size it has. Every worker holds a shared
    lock on it while it lives, so it outlives any one of them and is swept
    (sweep_stale_segments) once none is left; its name, random per creation, is the tier's id
    for the scheduler."""

    def __init__(self, layout: KVLayout, num_blocks: int, key: str,
                 shm_dir: Path = SHM_DIR):
        digest = hashlib.sha256(f"{key}|{layout}".encode()).hexdigest()[:16]
        self.layout = layout
        self._fd: int | None = None
        for path in sorted(shm_dir.glob(f"{TIER_PREFIX}{digest}-*")):
            fd = _lock_shared(path)
            if fd is not None and os.fstat(fd).st_size >= layout.block_bytes:
                self._fd, self.path = fd, path
                num_blocks = os.fstat(fd).st_size // layout.block_bytes
                break
            if fd is not None:
                os.close(fd)
        else:
            self.path = shm_dir / f"{TIER_PREFIX}{digest}-{secrets.token_hex(8)}"
            self._fd = create_segment(self.path, layout.block_bytes * num_blocks)
        self.num_blocks = num_blocks
        self.tensor = map_shared(self.path, layout.cache_shape(num_blocks), layout.torch_dtype,
                                 create=False)

    @property
    def tier_id(self) -> str:
        return self.path.name

    def close(self) -> None:
        """Lets go of the segment; the last worker to let go removes it."""
        if self._fd is None:
            return
        os.close(self._fd)
        self._fd = None
        remove_if_unheld(self.path)


def _lock_shared(path: Path) -> int | None:
    """An fd holding a shared lock on the segment at path, or None if it is gone (swept between
    the listing and the lock)."""
    try:
        fd = os.open(path, os.O_RDWR)
    except OSError:
        return None
    fcntl.flock(fd, fcntl.LOCK_SH)
    if not path.exists() or os.fstat(fd).st_nlink == 0:
        os.close(fd)
        return None
    return fd


def on_device(device: torch.device):
    """Makes a GPU the current device of the calling thread (Triton launches and CUDA events go
    to the current device, and worker threads start on GPU 0); a no-op on CPU."""
    return torch.cuda.device(device) if device.type == "cuda" else contextlib.nullcontext()


def block_runs(src_ids: Sequence[int], dst_ids: Sequence[int]) -> list[tuple[int, int, int]]:
    """(src start, dst start, length) of the runs where both id lists advance by one."""
    runs: list[tuple[int, int, int]] = []
    for s, d in zip(src_ids, dst_ids):
        if runs and runs[-1][0] + runs[-1][2] == s and runs[-1][1] + runs[-1][2] == d:
            runs[-1] = (runs[-1][0], runs[-1][1], runs[-1][2] + 1)
        else:
            runs.append((s, d, 1))
    return runs


GATHER_BYTES = 32 << 20  # a GPU's scattered copy gathers at most this much at a time


def copy_blocks(dst: torch.Tensor, dst_ids: Sequence[int], src: torch.Tensor,
                src_ids: Sequence[int]) -> None:
    """dst[:, :, dst_ids] = src[:, :, src_ids] for caches `[layers, 2, blocks, ...]`, one slice
    copy per run of consecutive ids: no gathered temporary (fresh memory costs more than the
    copy itself). Within one GPU, ids scattered into many runs are gathered instead: a copy per
    run is a kernel launch per block there, and launches, not bytes, bound it (cuda_ipc moved
    27-43 GB/s of scattered 512 KiB blocks on an H200, 725 GB/s of one run)."""
    assert len(dst_ids) == len(src_ids), "as many source as destination blocks"
    runs = block_runs(src_ids, dst_ids)
    if dst.is_cuda and dst.device == src.device and len(runs) > 2:
        gather_blocks(dst, dst_ids, src, src_ids)
        return
    for s, d, n in runs:
        dst[:, :, d:d + n].copy_(src[:, :, s:s + n])


def gather_blocks(dst: torch.Tensor, dst_ids: Sequence[int], src: torch.Tensor,
                  src_ids: Sequence[int], max_bytes: int = GATHER_BYTES) -> None:
    """copy_blocks as an index_select into a temporary and an index_copy_ out of it, two launches
    per at most `max_bytes` of blocks (the temporary stays small beside a full cache)."""
    block_bytes = src[:, :, 0].numel() * src.element_size()
    per = max(1, max_bytes // max(1, block_bytes))
    for k in range(0, len(src_ids), per):
        s = torch.tensor(list(src_ids[k:k + per]), dtype=torch.long, device=src.device)
        d = torch.tensor(list(dst_ids[k:k + per]), dtype=torch.long, device=dst.device)
        dst.index_copy_(2, d, src.index_select(2, s))
