"""What the gateway refuses before a handler sees a request body: more than
--max-request-body-mib (413, without reading past the limit), and JSON whose strings hold an
unpaired UTF-16 surrogate (400): JSON's syntax allows `"\\ud800"`, but no UTF-8 text, tokenizer
or error message can carry it."""

from __future__ import annotations

import json
import re

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from services.gateway.errors import GatewayError, bad_request, error_response

# a surrogate escape, paired or not: only bodies holding one are parsed here
_SURROGATE_ESCAPE = re.compile(rb"\\u[dD][89a-fA-F][0-9a-fA-F]{2}")
_WITH_BODY = frozenset({"POST", "PUT", "PATCH"})


def too_large(limit: int) -> GatewayError:
    return GatewayError(413, f"the request body exceeds {limit} bytes (--max-request-body-mib)",
                        "invalid_request_error")


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
    """ASGI middleware: reads a request's body up to `limit` bytes, checks it, and hands it on
    (later receives, a client's disconnect among them, pass through)."""

    def __init__(self, app: ASGIApp, limit: int) -> None:
        self.app = app
        self.limit = limit

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["method"] not in _WITH_BODY:
            await self.app(scope, receive, send)
            return
        declared = next((v for k, v in scope["headers"] if k == b"content-length"), None)
        if declared is not None and declared.isdigit() and int(declared) > self.limit:
            await error_response(too_large(self.limit))(scope, receive, send)
            return
        chunks, size = [], 0
        while True:
            message = await receive()
            if message["type"] != "http.request":  # gone before its body arrived
                return
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > self.limit:
                await error_response(too_large(self.limit))(scope, receive, send)
                return
            chunks.append(chunk)
            if not message.get("more_body", False):
                break
        body = b"".join(chunks)
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
