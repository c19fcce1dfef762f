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
    """Lower `priority` first (vLLM's convention), then earlier arrival."""

    def __init__(self):
        self._heap: list[tuple[int, float, int, Request]] = []
        self._seq = 0
        self._removed: set[str] = set()

    def _key(self, req: Request, front: bool):
        self._seq += 1
        return (req.priority, -1.0 if front else req.arrival_time, self._seq, req)

    def push(self, req):
        self._removed.discard(req.request_id)
        heapq.heappush(self._heap, self._key(req, front=False))

    def push_front(self, req):
        self._removed.discard(req.request_id)
        heapq.heappush(self._heap, self._key(req, front=True))

    def _skip_removed(self):
        while self._heap and self._heap[0][3].request_id in self._removed:
            self._removed.discard(heapq.heappop(self._heap)[3].request_id)

    def peek(self):
        self._skip_removed()
        return self._heap[0][3]

    def pop(self):
        self._skip_removed()
        return heapq.heappop(self._heap)[3]

    def remove(self, req):
        if any(e[3] is req for e in self._heap) and req.request_id not in self._removed:
            self._removed.add(req.request_id)
            return True
        return False

    def __len__(self):
        return len(self._heap) - len(self._removed)

    def __iter__(self):
        live = (e for e in sorted(self._heap, key=lambda e: e[:3])
                if e[3].request_id not in self._removed)
        return (e[3] for e in live)


_QUEUES = {"fcfs": FCFSQueue, "priority": PriorityQueue}


def create_request_queue(policy: str) -> RequestQueue:
    if policy not in _QUEUES:
        raise ValueError(f"unknown scheduling policy {policy!r}; known: {', '.join(_QUEUES)}")
    return _QUEUES[policy]()
