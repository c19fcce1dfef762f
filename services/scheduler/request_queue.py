"""Waiting queues: the order in which requests are admitted."""
from __future__ import annotations

import heapq
from abc import ABC, abstractmethod
from collections import deque

from services.scheduler.request import Request


class RequestQueue(ABC):
    @abstractmethod
    def push(self, req: Request) -> None: ...

    @abstractmethod
    def push_front(self, req: Request) -> None:
        """Re-queues a preempted or recovered request ahead of its peers."""

    @abstractmethod
    def peek(self) -> Request: ...

    @abstractmethod
    def pop(self) -> Request: ...

    @abstractmethod
    def remove(self, req: Request) -> bool: ...

    @abstractmethod
    def __len__(self) -> int: ...

    @abstractmethod
    def __iter__(self):
        """Requests in admission order."""


class FCFSQueue(RequestQueue):
    def __init__(self):
        self._q: deque[Request] = deque()

    def push(self, req):
        self._q.append(req)

    def push_front(self, req):
        self._q.appendleft(req)

    def peek(self):
        return self._q[0]

    def pop(self):
        return self._q.popleft()

    def remove(self, req):
        try:
            self._q.remove(req)
        except ValueError:
            return False
        return True

    def __len__(self):
        return len(self._q)

    def __iter__(self):
        return iter(self._q)


class PriorityQueue(RequestQueue):
    """Lower `priority` first (vLLM's convention), then earlier arrival. Removal is lazy: a
    heap entry is live only while it is its request's latest entry."""

    def __init__(self):
        self._heap: list[tuple[int, float, int, Request]] = []
        self._live: dict[str, int] = {}  # request id -> seq of its live entry
        self._seq = 0

    def _push(self, req: Request, front: bool) -> None:
        self._seq += 1
        self._live[req.request_id] = self._seq
        heapq.heappush(self._heap, (req.priority, -1.0 if front else req.arrival_time,
                                    self._seq, req))

    def push(self, req):
        self._push(req, front=False)

    def push_front(self, req):
        self._push(req, front=True)

    def _is_live(self, entry) -> bool:
        return self._live.get(entry[3].request_id) == entry[2]

    def _skip_dead(self):
        while self._heap and not self._is_live(self._heap[0]):
            heapq.heappop(self._heap)

    def peek(self):
        self._skip_dead()
        return self._heap[0][3]

    def pop(self):
        self._skip_dead()
        entry = heapq.heappop(self._heap)
        del self._live[entry[3].request_id]
        return entry[3]

    def remove(self, req):
        found = self._live.pop(req.request_id, None) is not None
        if len(self._heap) > 2 * len(self._live) + 64:  # mostly dead entries: compact
            self._heap = [e for e in self._heap if self._is_live(e)]
            heapq.heapify(self._heap)
        return found

    def __len__(self):
        return len(self._live)

    def __iter__(self):
        """Lazily, in order: the scheduler looks at the first few only (O(n + k log n))."""
        heap = list(self._heap)
        while heap:
            entry = heapq.heappop(heap)
            if self._is_live(entry):
                yield entry[3]


_QUEUES = {"fcfs": FCFSQueue, "priority": PriorityQueue}


def create_request_queue(policy: str) -> RequestQueue:
    if policy not in _QUEUES:
        raise ValueError(f"unknown scheduling policy {policy!r}; known: {', '.join(_QUEUES)}")
    return _QUEUES[policy]()
