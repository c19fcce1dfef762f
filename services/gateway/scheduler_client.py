"""A thin async wrapper around the Scheduler gRPC stub; every call carries a deadline.

It speaks protobuf; protos/scheduler_codec.py turns the messages into the dataclasses
(common/sampling_params.py) the rest of the gateway uses.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncGenerator, AsyncIterator

import grpc

from common import tracing
from protos import scheduler_pb2, scheduler_pb2_grpc
from services.gateway.readiness import SchedulerReadiness

logger = logging.getLogger(__name__)

ABORT_TIMEOUT_S = 10.0


DRAIN_TIMEOUT_S = 1.0


async def _drain(responses: AsyncIterator) -> None:
    """Reads a finished stream's end (the scheduler closes it right after the finish), so that
    its traced call and span complete now rather than when the garbage collector closes them."""
    try:
        async with asyncio.timeout(DRAIN_TIMEOUT_S):
            async for _ in responses:
                pass
    except (TimeoutError, grpc.aio.AioRpcError):
        pass


class SchedulerClient:
    """Invariant: a `generate` stream that is closed early (aclose, cancellation) cancels its
    gRPC call; freeing the request's blocks is the caller's job, via `abort` / `abort_soon`.
    `readiness` follows the scheduler's health once `connect` made the client."""

    def __init__(
        self, channel: grpc.aio.Channel, request_timeout_s: float, connect_timeout_s: float
    ) -> None:
        self._channel = channel
        self._stub = scheduler_pb2_grpc.SchedulerStub(channel)
        self._request_timeout_s = request_timeout_s
        self._connect_timeout_s = connect_timeout_s
        self._background: set[asyncio.Task] = set()
        self.readiness = SchedulerReadiness(channel)

    @classmethod
    def connect(
        cls, address: str, request_timeout_s: float = 600.0, connect_timeout_s: float = 5.0
    ) -> SchedulerClient:
        """Open a channel (lazily connected) in the running event loop."""
        options = [("grpc.keepalive_time_ms", 30_000), ("grpc.keepalive_timeout_ms", 10_000)]
        channel = grpc.aio.insecure_channel(
            address, options=options, interceptors=tracing.aio_client_interceptors() or None
        )
        client = cls(channel, request_timeout_s, connect_timeout_s)
        client.readiness.start()
        return client

    async def generate(
        self, request: scheduler_pb2.GenerateRequest, span=None
    ) -> AsyncIterator[scheduler_pb2.GenerateResponse]:
        """`span`: made current while the call starts, so that it parents the call's span."""
        with tracing.use_span(span):
            call = self._stub.Generate(request, timeout=self._request_timeout_s)
        responses = call.__aiter__()
        running = 1 + len(request.sample_ids)
        try:
            async for response in responses:
                running -= bool(response.finish_reason)
                if span is not None and running == 0:
                    await _drain(responses)
                yield response
        finally:
            call.cancel()  # a no-op once the call has finished

    async def abort(self, request_id: str) -> bool:
        timeout = min(self._request_timeout_s, ABORT_TIMEOUT_S)
        response = await self._stub.Abort(
            scheduler_pb2.AbortRequest(request_id=request_id), timeout=timeout
        )
        return response.found

    def abort_soon(self, request_id: str) -> None:
        """Abort in the background: callable from a `finally` that is being cancelled."""
        task = asyncio.get_running_loop().create_task(self._abort_logged(request_id))
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    async def _abort_logged(self, request_id: str) -> None:
        try:
            await self.abort(request_id)
        except grpc.aio.AioRpcError as err:
            logger.warning("abort of %s failed: %s %s", request_id, err.code(), err.details())

    async def ready(self, timeout_s: float | None = None) -> bool:
        """Whether the channel is (or within the connect deadline becomes) READY."""
        if self._channel.get_state(try_to_connect=True) == grpc.ChannelConnectivity.READY:
            return True
        try:
            await asyncio.wait_for(
                self._channel.channel_ready(), timeout_s or self._connect_timeout_s
            )
        except TimeoutError:
            return False
        return True

    async def close(self) -> None:
        await self.readiness.close()
        if self._background:
            await asyncio.wait(set(self._background), timeout=ABORT_TIMEOUT_S)
        await self._channel.close()


class SampleStreams:
    """One Generate call for a prompt's samples (n > 1; n = 1 is one sample), split into one
    response stream per sample. The call starts with the first stream iterated (whose span
    parents it) and is cancelled once every stream was closed, which aborts what still runs."""

    def __init__(self, client: SchedulerClient, request: scheduler_pb2.GenerateRequest) -> None:
        self.client = client
        self.request = request
        self.request_ids = [request.request_id, *request.sample_ids]
        self._queues: list[asyncio.Queue] = [asyncio.Queue() for _ in self.request_ids]
        self._open = len(self.request_ids)
        self._pump_task: asyncio.Task | None = None

    async def stream(
        self, sample: int, span=None
    ) -> AsyncGenerator[scheduler_pb2.GenerateResponse, None]:
        """Sample's responses; ends after its finish, or when the call ends without one."""
        if self._pump_task is None:
            self._pump_task = asyncio.get_running_loop().create_task(self._pump(span))
        queue = self._queues[sample]
        try:
            while True:
                item = await queue.get()
                if isinstance(item, BaseException):
                    raise item
                if item is None:
                    return
                yield item
                if item.finish_reason:
                    return
        finally:
            self._open -= 1
            if self._open == 0:
                self._pump_task.cancel()

    async def _pump(self, span) -> None:
        try:
            async for response in self.client.generate(self.request, span):
                if 0 <= response.sample < len(self._queues):
                    self._queues[response.sample].put_nowait(response)
        except Exception as err:  # every sample's stream raises it
            for queue in self._queues:
                queue.put_nowait(err)
        finally:
            for queue in self._queues:
                queue.put_nowait(None)
