"""The paged KV cache: the one tensor for all layers (in shared memory on CPU), its
/dev/shm segments, and block copies. It sits below both the worker and the KV transports
(common/kv_transfer), which read and write the same tensor and import nothing from the worker.

Shape `[num_layers, 2, num_blocks, block_size, num_kv_heads, head_dim]`; layer l is a view
`[2, num_blocks, block_size, num_kv_heads, head_dim]`. Living in a /dev/shm file lets a peer on the
same host map it and write blocks straight into it (the shm transport).
"""
from __future__ import annotations

import contextlib
import fcntl
import os
from collections.abc import Sequence
from pathlib import Path

import torch

from common.kv_layout import KVLayout

SHM_DIR = Path("/dev/shm")


SEGMENT_PREFIX = "pdserve-kv-"


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
    """Removes the KV segments of workers that died without cleaning up (a crash, SIGKILL);
    works across containers sharing /dev/shm, where process ids mean nothing."""
    removed = []
    for path in shm_dir.glob(f"{SEGMENT_PREFIX}*"):
        try:
            fd = os.open(path, os.O_RDWR)
        except OSError:
            continue
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            continue  # its owner is alive
        finally:
            os.close(fd)  # also drops the lock if we took it
        path.unlink(missing_ok=True)
        removed.append(path.name)
    return removed


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


def copy_blocks(dst: torch.Tensor, dst_ids: Sequence[int], src: torch.Tensor,
                src_ids: Sequence[int]) -> None:
    """dst[:, :, dst_ids] = src[:, :, src_ids] for caches `[layers, 2, blocks, ...]`, one slice
    copy per run of consecutive ids: no gathered temporary (fresh memory costs more than the
    copy itself)."""
    assert len(dst_ids) == len(src_ids), "as many source as destination blocks"
    for s, d, n in block_runs(src_ids, dst_ids):
        dst[:, :, d:d + n].copy_(src[:, :, s:s + n])
