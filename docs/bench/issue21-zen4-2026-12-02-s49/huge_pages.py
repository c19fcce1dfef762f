"""Decode attention over a shared KV cache on 4 KiB pages against the same cache on 2 MiB pages,
calls in turn: what transparent huge pages under the cache's /dev/shm segment buy the decode.

    # a tmpfs that hands out huge pages, in a private mount namespace (root):
    unshare -m sh -c 'mount -t tmpfs -o huge=always,size=4g none /mnt &&
        .venv/bin/python docs/bench/issue21-zen4-2026-12-02-s49/huge_pages.py --huge-dir /mnt'

The worker's cache is one file in /dev/shm (common/kv_cache.py, so that a peer on the host can
map it). A tmpfs gives such a file huge pages only where it is mounted with `huge=always` (or
`within_size`, or `advise` with the worker's madvise), or where the host's
/sys/kernel/mm/transparent_hugepage/shmem_enabled says so for the internal mount; most hosts
mount /dev/shm without. Scattered blocks then cost a TLB miss a page: 8 layers of 64 x 2000
positions are about 1 GiB of cache, far beyond what the TLB maps on 4 KiB pages.

For each of attention.py's decode batches, in both dtypes, on one and two threads: the caches
of up to 8 layers in a segment under --small-dir (default /dev/shm) and the same in one under
--huge-dir, made and backed as the worker makes its own (create_segment, map_shared, populate),
each call of the step's attention (KV write included) on the next layer, the two in turn.
Prints each one's GB/s of K/V and the median [quartiles] of huge over small call pair by pair,
and checks from /proc/self/smaps that the huge segment is mapped by 2 MiB pages and the small
one is not (else it stops: the comparison would be of nothing).
"""
from __future__ import annotations

import argparse
import itertools
import os
import re
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[3]))
from benchmarks import attention  # noqa: E402
from common.kv_cache import map_shared, populate  # noqa: E402
from common.models.attention import CpuAttentionBackend  # noqa: E402
from common.shm_segments import create_segment  # noqa: E402


def pmd_mapped_kib(path: Path) -> int:
    """KiB of this process's mappings of `path` that are mapped by huge (PMD) pages."""
    total, inside = 0, False
    for line in Path("/proc/self/smaps").read_text().splitlines():
        if re.match(r"^[0-9a-f]+-[0-9a-f]+ ", line):
            inside = line.endswith(str(path))
        elif inside and line.startswith(("ShmemPmdMapped:", "FilePmdMapped:")):
            total += int(line.split()[1])
    return total


class SharedCaches:
    """A case's layers' caches in one shared segment under `directory`, as a worker's."""

    def __init__(self, directory: Path, shape: tuple[int, ...], layers: int,
                 dtype: torch.dtype, gen: torch.Generator):
        self.path = directory / f"pdserve-bench-huge-pages-{os.getpid()}-{id(self)}"
        full = (layers, *shape)
        self.fd = create_segment(self.path, torch.Size(full).numel() * dtype.itemsize)
        try:
            tensor = map_shared(self.path, full, dtype, create=True)
            populate(tensor, self.path)
            for layer in tensor.unbind(0):
                layer.copy_(torch.randn(shape, generator=gen).to(dtype))
        except BaseException:
            self.close()
            raise
        self.layers = list(tensor.unbind(0))

    def close(self) -> None:
        self.path.unlink(missing_ok=True)
        os.close(self.fd)


def step_call(backend: CpuAttentionBackend, caches: SharedCaches, qkv: tuple, meta):
    """call(): the step's attention on the next of the caches' layers."""
    turn, scale = itertools.count(), attention.HEAD_DIM ** -0.5
    return lambda: backend.forward(*qkv, caches.layers[next(turn) % len(caches.layers)], meta,
                                   scale)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--huge-dir", type=Path, required=True,
                    help="a tmpfs mounted with huge=always (or within_size)")
    ap.add_argument("--small-dir", type=Path, default=Path("/dev/shm"),
                    help="a tmpfs without huge pages (default /dev/shm)")
    ap.add_argument("--reps", type=int, default=21, help="pairs of calls per case")
    ap.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"])
    args = ap.parse_args()
    gen = torch.Generator().manual_seed(0)
    print(f"CPU flags: {attention.cpu_flags()}; blocks of {attention.BLOCK}; {args.reps} pairs; "
          f"4 KiB pages in {args.small_dir}, 2 MiB pages in {args.huge_dir}", flush=True)
    for name, lengths in attention.DECODES.items():
        for dtype_name in args.dtypes:
            dtype = getattr(torch, dtype_name)
            case = attention.decode_case(lengths, dtype, gen)
            meta, num_blocks, rows, kv_bytes = case[0], case[1], case[2], case[3]
            shape = (2, num_blocks, attention.BLOCK, attention.KV_HEADS, attention.HEAD_DIM)
            layers = attention.layer_count(torch.Size(shape).numel() * dtype.itemsize)
            q = torch.randn((rows, attention.HEADS, attention.HEAD_DIM), generator=gen).to(dtype)
            k = torch.randn((rows, attention.KV_HEADS, attention.HEAD_DIM), generator=gen).to(dtype)
            v = torch.randn((rows, attention.KV_HEADS, attention.HEAD_DIM), generator=gen).to(dtype)
            small = SharedCaches(args.small_dir, shape, layers, dtype, gen)
            huge = SharedCaches(args.huge_dir, shape, layers, dtype, gen)
            try:
                huge_kib, small_kib = pmd_mapped_kib(huge.path), pmd_mapped_kib(small.path)
                if huge_kib == 0 or small_kib != 0:
                    print(f"huge pages: {huge_kib} KiB under {args.huge_dir}, {small_kib} KiB "
                          f"under {args.small_dir}: mount --huge-dir with huge=always, and "
                          "--small-dir without", file=sys.stderr)
                    return 2
                backend = CpuAttentionBackend()
                for threads in args.threads:
                    torch.set_num_threads(threads)
                    calls = {name: (step_call(backend, caches, (q, k, v), meta), kv_bytes)
                             for name, caches in (("small", small), ("huge", huge))}
                    rates = attention.in_turn(calls, args.reps)
                    gain = [h / s for h, s in zip(rates["huge"], rates["small"])]
                    print(f"{name:22s} {dtype_name:8s} {threads} thr  4 KiB pages "
                          f"{attention.quartiles(rates['small'])['median']:5.1f} GB/s  2 MiB pages "
                          f"{attention.quartiles(rates['huge'])['median']:5.1f} GB/s  huge / small "
                          f"{attention.median_quartiles(gain)}  ({huge_kib >> 10} MiB on huge "
                          f"pages)", flush=True)
            finally:
                small.close()
                huge.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
