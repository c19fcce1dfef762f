"""SSE framing of a generation stream: `data: <json>` events, the closing [DONE], an error
after the 200 went out, and a response that closes its generators however the stream ends.

A reader that takes nothing for --stream-write-timeout seconds (stalled, or too slow to take one
event in that long; BodyGuard times every write) ends its stream: its requests are aborted on the
scheduler, their blocks freed; other streams never wait on it (each writes on its own).

    prime(streams) -> SSEStart (first delta, rest) -> render(start) -> SSEResponse
"""

from __future__ import annotations

import json
from collections.abc import AsyncGenerator, Callable
from contextlib import aclosing

import grpc
from fastapi import Request
from pydantic import BaseModel
from starlette.responses import StreamingResponse
from starlette.types import Receive, Scope, Send

from services.gateway.disconnect import until_disconnected
from services.gateway.errors import GatewayError, to_gateway_error
from services.gateway.generation import DeltaStream, SeqDelta, merge

DONE_EVENT = "data: [DONE]\n\n"


def event(chunk: BaseModel) -> str:
    """One SSE event; chunks leave out fields the code did not set (see responses.py)."""
    return f"data: {chunk.model_dump_json(exclude_unset=True)}\n\n"


def error_event(exc: GatewayError | grpc.aio.AioRpcError) -> str:
    """The error's usual body as an event, for a stream whose HTTP status is already sent."""
    return f"data: {json.dumps(to_gateway_error(exc).body())}\n\n"


async def prime(raw: Request, streams: list[DeltaStream]) -> SSEStart:
    """Wait for the first delta before committing to a 200 stream, so that errors the scheduler
    reports up front (429, 503, 400) keep their HTTP status."""
    merged = merge(streams)

    async def first() -> SeqDelta | None:
        return await anext(merged, None)

    try:
        delta = await until_disconnected(raw, first())
    except BaseException:
        await merged.aclose()
        raise
    return SSEStart(delta, merged)


class SSEStart:
    """The first delta of a primed stream and the rest of it."""

    def __init__(self, first: SeqDelta | None, rest: DeltaStream) -> None:
        self.first = first
        self.rest = rest

    async def deltas(self) -> DeltaStream:
        async with aclosing(self.rest):
            if self.first is not None:
                yield self.first
            async for delta in self.rest:
                yield delta


class SSEResponse(StreamingResponse):
    """A text/event-stream that always closes its generators when done, so an interrupted
    stream (client gone: Starlette cancels the send loop, maybe before the body even started)
    aborts its scheduler requests now rather than whenever the garbage collector runs."""

    media_type = "text/event-stream"

    def __init__(
        self, body: AsyncGenerator[str, None], start: SSEStart, headers: dict[str, str],
    ) -> None:
        super().__init__(body, headers={"Cache-Control": "no-cache", **headers})
        self._closers = (body, start.rest)
        self._on_close: list[Callable[[], None]] = []

    def on_close(self, callback: Callable[[], None]) -> None:
        """Called once the stream has ended, however it ended."""
        self._on_close.append(callback)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            for generator in self._closers:
                await generator.aclose()
            for callback in self._on_close:
                callback()


def sse(
    render: Callable[[SSEStart], AsyncGenerator[str, None]], start: SSEStart, request_id: str,
) -> SSEResponse:
    return SSEResponse(render(start), start, headers={"x-request-id": request_id})
