"""Whether the scheduler can serve a request now, followed from its grpc.health.v1 status.

One Watch stream on the scheduler's "" (SERVING while a decode worker is attached, see
common/health.py) keeps `serving` current as workers come and go. The stream is opened again
when it breaks (the scheduler restarted) and, so that no wait is unbounded, when its deadline
ends it. /ready reads `serving`; a request that arrives while it is false waits for it up to
--no-worker-wait, then gets `unavailable()`: a 503 with Retry-After.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from services.gateway.errors import RETRY_AFTER_S, GatewayError

logger = logging.getLogger(__name__)

WATCH_DEADLINE_S = 60.0  # a Watch stream is opened again this often, keeping the status
RETRY_S = 1.0  # after a failed Watch
NO_WORKERS = "No worker can serve requests: the scheduler has no decode worker attached."


class SchedulerReadiness:
    """Invariant: `serving` is what the scheduler said last, and false from the moment a Watch
    stream fails (not when one merely reaches its deadline) until one says SERVING again."""

    def __init__(self, channel: grpc.aio.Channel) -> None:
        self._stub = health_pb2_grpc.HealthStub(channel)
        self._serving = asyncio.Event()
        self._reason, self._code = "The scheduler's health is not known yet.", "not_ready"
        self._task: asyncio.Task | None = None
        self._watch: grpc.aio.UnaryStreamCall | None = None

    def start(self) -> None:
        """Follows the scheduler from now on, in the running event loop."""
        self._task = asyncio.get_running_loop().create_task(self._follow())

    @property
    def serving(self) -> bool:
        return self._serving.is_set()

    async def wait_serving(self, timeout_s: float) -> bool:
        """Whether the scheduler can serve now or does within timeout_s."""
        if self._serving.is_set():
            return True
        try:
            await asyncio.wait_for(self._serving.wait(), timeout_s)
        except TimeoutError:
            return False
        return True

    def unavailable(self) -> GatewayError:
        """The 503 of a request (or /ready) while the scheduler cannot serve."""
        return GatewayError(
            503, self._reason, "service_unavailable", code=self._code, retry_after=RETRY_AFTER_S
        )

    async def close(self) -> None:
        """Stops following. An open Watch call is cancelled rather than the task reading it, so
        that the task ends once gRPC has completed the call's read in this event loop (a read
        left behind completes later, from gRPC's poller thread, into a loop that may be gone)."""
        if self._task is None:
            return
        if self._watch is not None and not self._watch.done():
            self._watch.cancel()
        else:
            self._task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await self._task

    async def _follow(self) -> None:
        request = health_pb2.HealthCheckRequest(service="")
        while True:
            try:
                self._watch = self._stub.Watch(request, timeout=WATCH_DEADLINE_S)
                async for response in self._watch:
                    self._set(response.status == health_pb2.HealthCheckResponse.SERVING,
                              NO_WORKERS, "no_workers")
            except grpc.aio.AioRpcError as err:
                if err.code() == grpc.StatusCode.DEADLINE_EXCEEDED:
                    continue  # the stream's own deadline: watch again, the status stands
                self._set(False, f"The scheduler is unavailable: {err.details()}",
                          "scheduler_unavailable")
            else:
                self._set(False, "The scheduler ended its health stream.", "scheduler_unavailable")
            await asyncio.sleep(RETRY_S)

    def _set(self, serving: bool, reason: str, code: str) -> None:
        if serving != self._serving.is_set():
            logger.info("scheduler %s", "serving" if serving else f"not serving: {reason}")
        if serving:
            self._serving.set()
        else:
            self._serving.clear()
            self._reason, self._code = reason, code
