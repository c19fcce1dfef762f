"""The threads a worker's steps compute on: OpenMP's team (torch's thread count), or, where the
CPU kernels compute nearly the whole step, the kernels' own pool (kernels/csrc/pool.h).

The kernels compute nearly the whole step where the model's linears are their panel linears
(float32 on an AVX2 CPU, common/models/packed_linear.py): then the pool runs them, and torch's
own ops in the forward (a few small gathers) run on the step's thread alone, so that no OpenMP
team spins beside the pool's threads; the sampler's ops over the vocabulary (a softmax, top-k, a
sort, prompt logprobs) take the step's threads again, OpenMP's team (`for_torch`). Where
oneDNN's linears take most of a step (bfloat16, AVX-512), OpenMP runs everything as before.

Why a pool of their own: an OpenMP region ends when every thread of its team has run its fixed
share, so a team thread that the OS hands to another process for a few milliseconds (the
gateway, the scheduler and load clients share the server's cores) holds the region back that
long. The pool's threads claim small chunks, and a helper that is off its core holds back only
the chunk it holds, if any (docs/performance.md, "The kernels' own threads").

The scheduler's plans and the core board (core_board.py) set the count per step, through
`set`; `get` reads it back.
"""
from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch


class StepThreads:
    """`pool`: the kernels' op library whose pool runs the steps (it takes the thread count
    torch has on the calling thread, and torch keeps one), or None: OpenMP's team. Made on the
    thread that runs the steps: torch's thread count is the calling thread's."""

    def __init__(self, pool=None):
        self._pool = pool
        if pool is not None:
            pool.set_pool_threads(torch.get_num_threads())
            torch.set_num_threads(1)

    @property
    def pooled(self) -> bool:
        return self._pool is not None

    def get(self) -> int:
        return int(self._pool.pool_threads()) if self._pool is not None \
            else torch.get_num_threads()

    def set(self, n: int) -> None:
        if self._pool is not None:
            self._pool.set_pool_threads(n)
        else:
            torch.set_num_threads(n)

    @contextlib.contextmanager
    def for_torch(self) -> Iterator[None]:
        """torch's own ops inside run on the step's threads (OpenMP's team) where the pool runs
        the steps; elsewhere they do already."""
        if self._pool is None:
            yield
            return
        torch.set_num_threads(max(1, self.get()))
        try:
            yield
        finally:
            torch.set_num_threads(1)

    def close(self) -> None:
        """Hands the steps back to OpenMP, on as many threads as the pool had (the pool is the
        process's: a worker built after this one in the same process starts from torch's)."""
        if self._pool is not None:
            torch.set_num_threads(max(1, self.get()))
            self._pool.set_pool_threads(0)
            self._pool = None
