"""Cores that CPU workers of one host share: how many threads each worker's next step uses.

A CPU worker registers the cores it may run on. Workers with the same host id whose cores
overlap share them, and no core idles while one of them has work: each plan says how many
threads its step uses,

    no peer busy            all the worker's cores (a lone long prompt gets every core; the
                            decode batch gets them once prompts stop arriving)
    k workers busy          the cores split k ways, decode workers taking the remainder first

A busy peer runs a step or has work waiting. A step planned with more threads may still run
when a peer starts one; the prefill worker runs at a lower CPU priority (`--cpu-nice`), so the
decode step wins the core and the prefill step slows, never the other way round.
"""
from __future__ import annotations

from collections.abc import Callable, Iterable

from services.scheduler.worker_state import WorkerState


def shares_cores(a: WorkerState, b: WorkerState) -> bool:
    """Whether CPU workers a and b run on some of the same cores of one host."""
    return a is not b and a.host_id == b.host_id and bool(set(a.cpu_cores) & set(b.cpu_cores))


def threads_for(w: WorkerState, workers: Iterable[WorkerState],
                busy: Callable[[WorkerState], bool]) -> int:
    """Threads for w's next step; 0 (leave them as they are) for a worker sharing no cores."""
    if not w.cpu_cores:
        return 0
    mine = set(w.cpu_cores)
    peers = [x for x in workers if shares_cores(w, x)]
    if not peers:
        return 0
    sharing = [w] + [x for x in peers if busy(x)]
    share, extra = divmod(len(mine), len(sharing))
    # decode workers first, then in registration order (the order `workers` gives)
    order = sorted(sharing, key=lambda x: x.role != "decode")
    return max(1, share + (1 if order.index(w) < extra else 0))
