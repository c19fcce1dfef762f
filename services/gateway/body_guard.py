"""What the gateway guards around every handler. Before a handler sees a request body: more than
--max-request-body-mib (413, without reading past the limit), a body that has not arrived within
--request-body-timeout (408), and JSON whose strings hold an unpaired UTF-16 surrogate (400):
JSON's syntax allows `"\\ud800"`, but no UTF-8 text, tokenizer or error message can carry it.
After it: a client that takes nothing of its response (streamed or not) for
--stream-write-timeout is cut off, so a stalled reader holds neither a connection nor a stream's
requests for long."""

from __future__ import annotations

import asyncio
import json
import logging
import re

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from services.gateway.errors import GatewayError, bad_request, error_response

log = logging.getLogger(__name__)

# a surrogate escape, paired or not: only bodies holding one are parsed here
_SURROGATE_ESCAPE = re.compile(rb"\\u[dD][89a-fA-F][0-9a-fA-F]{2}")
_WITH_BODY = frozenset({"POST", "PUT", "PATCH"})
PIECE_BYTES = 64 << 10  # the server's write buffer high-water mark


def too_large(limit: int) -> GatewayError:
    return GatewayError(413, f"the request body exceeds {limit} bytes (--max-request-body-mib)",
                        "invalid_request_error")


def too_slow(timeout_s: float) -> GatewayError:
    return GatewayError(408, f"the request body did not arrive within {timeout_s:g} s "
                        "(--request-body-timeout)", "invalid_request_error")


def pieces(message: Message) -> list[Message]:
    """A response body of more than PIECE_BYTES as several messages: the server hands the socket
    one message whole, so only between pieces does a write wait for the reader (and time out)."""
    body = message.get("body", b"")
    if message["type"] != "http.response.body" or len(body) <= PIECE_BYTES:
        return [message]
    view = memoryview(body)
    starts = range(0, len(body), PIECE_BYTES)
    return [{"type": "http.response.body", "body": bytes(view[i:i + PIECE_BYTES]),
             "more_body": i + PIECE_BYTES < len(body) or message.get("more_body", False)}
            for i in starts]


class StalledReader(Exception):
    """The client took nothing of its response within the write timeout."""


def lone_surrogate(body: bytes) -> bool:
    """Whether a JSON body's strings (keys or values) hold an unpaired UTF-16 surrogate."""
    if not _SURROGATE_ESCAPE.search(body):
        return False
    try:
        parsed = json.loads(body)
    except ValueError:
        return False  # not JSON: the handler's own 400
    try:
        json.dumps(parsed, ensure_ascii=False).encode("utf-8")
    except UnicodeEncodeError:
        return True
    return False


class BodyGuard:
    """ASGI middleware: reads a request's body up to `limit` bytes within `read_timeout_s`,
    checks it, and hands it on (later receives, a client's disconnect among them, pass through);
    every piece of the response must be taken within `write_timeout_s` (StalledReader is raised
    in the handler otherwise, and the connection dropped)."""

    def __init__(self, app: ASGIApp, limit: int, read_timeout_s: float,
                 write_timeout_s: float) -> None:
        self.app = app
        self.limit = limit
        self.read_timeout_s = read_timeout_s
        self.write_timeout_s = write_timeout_s

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return

        async def send_in_time(message: Message) -> None:
            for part in pieces(message):
                try:
                    await asyncio.wait_for(send(part), self.write_timeout_s)
                except TimeoutError:
                    raise StalledReader from None

        try:
            await self._guarded(scope, receive, send_in_time)
        except StalledReader:  # the response never completes: the server drops the connection
            log.warning("%s %s: the client took nothing for %.0f s; its response is cut off",
                        scope["method"], scope["path"], self.write_timeout_s)

    async def _guarded(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["method"] not in _WITH_BODY:
            await self.app(scope, receive, send)
            return
        declared = next((v for k, v in scope["headers"] if k == b"content-length"), None)
        if declared is not None and declared.isdigit() and int(declared) > self.limit:
            await error_response(too_large(self.limit))(scope, receive, send)
            return
        try:
            async with asyncio.timeout(self.read_timeout_s):
                body = await self._read(receive)
        except TimeoutError:
            await error_response(too_slow(self.read_timeout_s))(scope, receive, send)
            return
        except GatewayError as refused:
            await error_response(refused)(scope, receive, send)
            return
        if body is None:  # gone before its body arrived
            return
        if lone_surrogate(body):
            err = bad_request("the body holds a string with an unpaired UTF-16 surrogate "
                              "(a \\ud800-\\udfff escape without its pair): not valid Unicode")
            await error_response(err)(scope, receive, send)
            return
        replayed = False

        async def replay() -> Message:
            nonlocal replayed
            if replayed:
                return await receive()
            replayed = True
            return {"type": "http.request", "body": body, "more_body": False}

        await self.app(scope, replay, send)

    async def _read(self, receive: Receive) -> bytes | None:
        """The whole body (413 past the limit), or None if the client left first."""
        chunks, size = [], 0
        while True:
            message = await receive()
            if message["type"] != "http.request":
                return None
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > self.limit:
                raise too_large(self.limit)
            chunks.append(chunk)
            if not message.get("more_body", False):
                return b"".join(chunks)
