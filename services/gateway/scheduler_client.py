"""A thin async wrapper around the Scheduler gRPC stub; every call and request carries a
deadline.

Requests go over one Session stream (protos/scheduler.proto): the scheduler sends the outputs of
a step for all of this gateway's requests in one message, which the session's reader hands to
each request's queue. A scheduler without Session (an older one, during a rolling upgrade) gets
one Generate call per request instead.

It speaks protobuf; protos/scheduler_codec.py turns the messages into the dataclasses
(common/sampling_params.py) the rest of the gateway uses.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncGenerator, AsyncIterator

import grpc

from common import tracing
from common.grpc_options import channel_options
from common.tls import TLSFiles, grpc_channel_credentials, scheduler_channel_options
from protos import scheduler_pb2, scheduler_pb2_grpc
from services.gateway.readiness import SchedulerReadiness

logger = logging.getLogger(__name__)

ABORT_TIMEOUT_S = 10.0
RESUBMIT_PAUSE_S = 0.2  # between a lost stream and its resubmission, and between tries
SESSION_WRITE_TIMEOUT_S = 30.0  # a scheduler that takes no request in time: the session fails
SESSION_CLOSE_TIMEOUT_S = 5.0  # close(): how long the scheduler has to end the session
SESSION_METHOD = "Session"  # its name, as the tracing filters match it
_STATUS = {c.value[0]: c for c in grpc.StatusCode}


def rpc_error(code: grpc.StatusCode, details: str) -> grpc.aio.AioRpcError:
    """The error a Generate call would have ended with."""
    return grpc.aio.AioRpcError(code, grpc.aio.Metadata(), grpc.aio.Metadata(), details)


# how a call ends when its scheduler is gone: the connection failed, or a scheduler that stops
# (a rolling restart) cancelled the streams still running after its grace period
LOST = (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.CANCELLED)

# grpc.aio's own status for a call whose write failed as the call ended (the call's real status,
# on its way, is dropped: grpc/grpc issue 36066): the connection, or the peer's end of the call,
# went while a message was being written. Which of the two, and the peer's code, are lost.
WRITE_RACED_END = (grpc.StatusCode.INTERNAL, "Internal error from Core")


def ended_under_a_write(err: grpc.aio.AioRpcError) -> bool:
    """Whether err is gRPC's stand-in status for a call that ended while it was written to."""
    return (err.code(), err.details()) == WRITE_RACED_END


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
    `readiness` follows the scheduler's health once `connect` made the client.
    `recovery_s`: how long a stream whose scheduler was lost waits for one that serves again,
    to resubmit what it had not finished (SampleStreams); 0: it fails at once."""

    def __init__(
        self, channel: grpc.aio.Channel, request_timeout_s: float, connect_timeout_s: float,
        recovery_s: float = 0.0,
    ) -> None:
        self._channel = channel
        self._stub = scheduler_pb2_grpc.SchedulerStub(channel)
        self._request_timeout_s = request_timeout_s
        self._connect_timeout_s = connect_timeout_s
        self.recovery_s = recovery_s
        self._background: set[asyncio.Task] = set()
        self.readiness = SchedulerReadiness(channel)
        self._session: _Session | None = None
        self.sessions = True  # False once the scheduler answered Session UNIMPLEMENTED

    @classmethod
    def connect(
        cls, address: str, request_timeout_s: float = 600.0, connect_timeout_s: float = 5.0,
        recovery_s: float = 0.0, tls: TLSFiles | None = None,
    ) -> SchedulerClient:
        """Open a channel (lazily connected) in the running event loop; with `tls`, mutual TLS
        as the gateway role."""
        interceptors = tracing.aio_client_interceptors(untraced=(SESSION_METHOD,)) or None
        if tls is None:
            channel = grpc.aio.insecure_channel(address, options=channel_options(),
                                                interceptors=interceptors)
        else:
            channel = grpc.aio.secure_channel(
                address, grpc_channel_credentials(tls),
                options=channel_options() + scheduler_channel_options(tls),
                interceptors=interceptors)
        client = cls(channel, request_timeout_s, connect_timeout_s, recovery_s)
        client.readiness.start()
        return client

    async def generate(
        self, request: scheduler_pb2.GenerateRequest, span=None
    ) -> AsyncIterator[scheduler_pb2.GenerateResponse]:
        """The request's responses (its samples' interleaved) until each sample it runs has
        finished; raises the AioRpcError a Generate call would (a refusal, a lost scheduler,
        DEADLINE_EXCEEDED after request_timeout_s). Closed early, it aborts what still runs.
        `span`: the parent of the request's client span."""
        if self.sessions:
            got = False
            try:
                async for response in self._in_session(request, span):
                    got = True
                    yield response
                return
            except grpc.aio.AioRpcError as err:
                if got or err.code() is not grpc.StatusCode.UNIMPLEMENTED:
                    raise
                logger.warning("the scheduler has no Session: one Generate call per request")
                self.sessions = False
        async for response in self._call(request, span):
            yield response

    async def _in_session(
        self, request: scheduler_pb2.GenerateRequest, span
    ) -> AsyncIterator[scheduler_pb2.GenerateResponse]:
        if self._session is None or self._session.ended:
            self._session = _Session(self._stub)
        session = self._session
        ids = [request.request_id, *request.sample_ids]
        done = {s.sample for s in request.resumed if s.finished}
        running = {j for j in range(len(ids)) if j not in done}
        client_span = None
        if span is not None:
            client_span = tracing.start_span(tracing.REQUEST_SPAN, tracing.context_of(span),
                                             kind="client")
            tracing.inject(request.trace_context, tracing.context_of(client_span))
        queue = session.open(request)
        late = rpc_error(grpc.StatusCode.DEADLINE_EXCEEDED, "Deadline Exceeded")
        timer = asyncio.get_running_loop().call_later(self._request_timeout_s,
                                                      queue.put_nowait, late)
        try:
            while running:
                item = await queue.get()
                if isinstance(item, grpc.aio.AioRpcError):
                    if client_span is not None:
                        client_span.set_attribute("rpc.grpc.status_code", item.code().value[0])
                    if item is not late:
                        running.clear()  # refused, or the session is gone: nothing runs
                    raise item
                if item.finish_reason:
                    running.discard(item.sample)
                yield item
        finally:
            timer.cancel()
            session.close(request.request_id, [ids[j] for j in running])
            tracing.end_span(client_span)

    async def _call(
        self, request: scheduler_pb2.GenerateRequest, span
    ) -> AsyncIterator[scheduler_pb2.GenerateResponse]:
        """One Generate call (a scheduler without Session)."""
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
        """Ends the session (the scheduler aborts what still runs on it) and the readiness
        Watch, waits for the aborts sent in the background, then closes the channel."""
        if self._session is not None:
            await self._session.aclose(SESSION_CLOSE_TIMEOUT_S)
        await self.readiness.close()
        if self._background:
            await asyncio.wait(set(self._background), timeout=ABORT_TIMEOUT_S)
        await self._channel.close()


class _Session:
    """The gateway's Session stream: requests go up through one writer task (a stream takes
    one write at a time), responses come down to one reader task that hands each output to its
    request's queue. When the stream fails every open request gets the error (lost: they are
    resubmitted on the next session); `ended` then, and the client opens a new one.
    Invariant: once `aclose` returns neither task runs, and, unless the scheduler had to be
    cancelled, no operation of the call is left in gRPC (a cancelled call's operations complete
    later, from gRPC's poller thread: into a closed event loop if the gateway's is gone)."""

    def __init__(self, stub: scheduler_pb2_grpc.SchedulerStub) -> None:
        self._call = stub.Session()
        self._routes: dict[str, asyncio.Queue] = {}
        # None: the gateway is leaving; the writer half-closes the stream after what is queued
        self._outbox: asyncio.Queue[scheduler_pb2.SessionRequest | None] = asyncio.Queue()
        self.ended = False
        loop = asyncio.get_running_loop()
        self._reader = loop.create_task(self._read())
        self._writer = loop.create_task(self._write())

    def open(self, request: scheduler_pb2.GenerateRequest) -> asyncio.Queue:
        """Sends the request; its responses, or the error that ends it, come to the queue."""
        queue: asyncio.Queue = asyncio.Queue()
        self._routes[request.request_id] = queue
        self._outbox.put_nowait(scheduler_pb2.SessionRequest(generate=request))
        return queue

    def close(self, request_id: str, unfinished: list[str]) -> None:
        """The request's reader is done; the samples in `unfinished` are aborted."""
        self._routes.pop(request_id, None)
        if not self.ended:
            for i in unfinished:
                self._outbox.put_nowait(scheduler_pb2.SessionRequest(abort=i))

    async def aclose(self, timeout_s: float) -> None:
        """Ends the session: what is queued (aborts) is sent, the stream half-closed, and the
        scheduler ends it (aborting what still runs), read to its status; cancelled if that
        takes longer than `timeout_s`. Returns once the reader and the writer are done."""
        self._outbox.put_nowait(None)
        _, late = await asyncio.wait({self._reader}, timeout=timeout_s)
        if late:
            logger.warning("the scheduler did not end the session in %.0f s: cancelled",
                           timeout_s)
            self._call.cancel()
        await asyncio.wait({self._reader, self._writer})

    async def _write(self) -> None:
        while True:
            message = await self._outbox.get()
            try:
                if message is None:
                    await asyncio.wait_for(self._call.done_writing(), SESSION_WRITE_TIMEOUT_S)
                    return
                await asyncio.wait_for(self._call.write(message), SESSION_WRITE_TIMEOUT_S)
            except TimeoutError:
                logger.error("the scheduler took no request in %.0f s: the session fails",
                             SESSION_WRITE_TIMEOUT_S)
                self._call.cancel()
                return
            except (grpc.aio.AioRpcError, grpc.aio.InternalError, asyncio.InvalidStateError):
                return  # the call ended (a half-close then fails in gRPC): the reader says how

    async def _read(self) -> None:
        err = rpc_error(grpc.StatusCode.UNAVAILABLE, "the scheduler ended the session")
        try:
            async for message in self._call:
                for out in message.outputs:
                    queue = self._routes.get(out.request_id)
                    if queue is not None:
                        queue.put_nowait(out)
                for refusal in message.refused:
                    queue = self._routes.get(refusal.request_id)
                    if queue is not None:
                        queue.put_nowait(rpc_error(
                            _STATUS.get(refusal.code, grpc.StatusCode.UNKNOWN), refusal.message))
        except grpc.aio.AioRpcError as e:
            # a write racing the session's end hides its status: the scheduler, or the link, went
            err = rpc_error(grpc.StatusCode.UNAVAILABLE, "the session ended under a write") \
                if ended_under_a_write(e) else e
        finally:
            self.ended = True
            self._writer.cancel()
            for queue in self._routes.values():
                queue.put_nowait(err)


class SampleStreams:
    """One request to the scheduler for a prompt's samples (n > 1; n = 1 is one sample), split
    into one response stream per sample. It starts with the first stream iterated (whose span
    parents it) and is closed once every stream was closed, which aborts what still runs."""

    def __init__(self, client: SchedulerClient, request: scheduler_pb2.GenerateRequest) -> None:
        self.client = client
        self.request = request
        self.request_ids = [request.request_id, *request.sample_ids]
        self._queues: list[asyncio.Queue] = [asyncio.Queue() for _ in self.request_ids]
        self._open = len(self.request_ids)
        self._closed = [False] * len(self.request_ids)  # by its reader: never resubmitted
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
            self._closed[sample] = True
            if self._open == 0:
                self._pump_task.cancel()

    async def _pump(self, span) -> None:
        """Forwards the call's responses; when the scheduler is lost (the call fails LOST),
        waits until the client's recovery_s has passed since the loss for one that serves, and
        resubmits what had not finished (nor been closed by its reader), each sample with the
        tokens it had streamed, and goes on."""
        tokens: list[list[int]] = [[] for _ in self._queues]
        finished = [False] * len(self._queues)
        request, deadline = self.request, None
        try:
            while True:
                try:
                    async for response in self.client.generate(request, span):
                        if 0 <= response.sample < len(self._queues):
                            tokens[response.sample] += response.token_ids
                            finished[response.sample] |= bool(response.finish_reason)
                            self._queues[response.sample].put_nowait(response)
                            if deadline is not None:
                                logger.info("request %s goes on %.2f s after its scheduler "
                                            "was lost", self.request.request_id,
                                            time.monotonic() - deadline + self.client.recovery_s)
                                deadline = None
                    return
                except grpc.aio.AioRpcError as err:
                    if deadline is None and err.code() in LOST:
                        deadline = time.monotonic() + self.client.recovery_s
                        logger.warning("request %s: scheduler lost (%s); resubmitting once one "
                                       "serves (up to %.0f s)", self.request.request_id,
                                       err.details(), self.client.recovery_s)
                    if deadline is None or all(self._done(finished)) or \
                            not await self._wait_to_resubmit(err, deadline, finished):
                        raise
                    # what readers closed while it waited does not run again either
                    request = resubmission(self.request, tokens, self._done(finished))
        except Exception as err:  # every sample's stream raises it
            for queue in self._queues:
                queue.put_nowait(err)
        finally:
            for queue in self._queues:
                queue.put_nowait(None)

    def _done(self, finished: list[bool]) -> list[bool]:
        return [f or c for f, c in zip(finished, self._closed)]

    async def _wait_to_resubmit(self, err: grpc.aio.AioRpcError, deadline: float,
                                finished: list[bool]) -> bool:
        """Waits (until `deadline`) for a scheduler that serves; whether to resubmit. A
        scheduler that still holds the request's ids (it has not noticed the lost stream, or it
        never died: the connection did) is told to abort the samples first, so that they run
        once, from the tokens this side saw."""
        if err.code() not in (*LOST, grpc.StatusCode.ALREADY_EXISTS):
            return False
        left = deadline - time.monotonic()
        if left <= 0:
            return False
        await asyncio.sleep(min(left, RESUBMIT_PAUSE_S))
        if not await self.client.readiness.wait_serving(deadline - time.monotonic()):
            return False
        if err.code() is grpc.StatusCode.ALREADY_EXISTS:
            for rid, was_done in zip(self.request_ids, self._done(finished)):
                if not was_done:
                    try:
                        await self.client.abort(rid)
                    except grpc.aio.AioRpcError as e:
                        logger.warning("abort of %s before its resubmission failed: %s", rid,
                                       e.details())
        return True


def resubmission(request: scheduler_pb2.GenerateRequest, tokens: list[list[int]],
                 finished: list[bool]) -> scheduler_pb2.GenerateRequest:
    """The request again, each sample's streamed tokens (and whether it finished) in it."""
    again = scheduler_pb2.GenerateRequest()
    again.CopyFrom(request)
    del again.resumed[:]
    for j, (ids, done) in enumerate(zip(tokens, finished)):
        if ids or done:
            again.resumed.add(sample=j, output_token_ids=ids, finished=done)
    return again
