"""The one place where failures become OpenAI-style error bodies and HTTP status codes.

    {"error": {"message": str, "type": str, "param": str | null, "code": str | int | null}}

Validation (pydantic, invalid JSON) is 400, never FastAPI's default 422. Scheduler gRPC statuses
map to 503 / 429 (both with Retry-After), 400, 504; a stream that has already started reports the
same body as an SSE `data:` event instead (sse.py frames it).
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from typing import Any

import grpc
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException

logger = logging.getLogger(__name__)

RETRY_AFTER_S = 1


class GatewayError(Exception):
    """An error with its HTTP status and OpenAI error fields."""

    def __init__(
        self,
        status: int,
        message: str,
        type: str = "invalid_request_error",
        param: str | None = None,
        code: str | None = None,
        retry_after: int | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type
        self.param = param
        self.code = code
        self.retry_after = retry_after

    def body(self) -> dict:
        return {
            "error": {
                "message": self.message,
                "type": self.type,
                "param": self.param,
                "code": self.code,
            }
        }

    def headers(self) -> dict[str, str]:
        return {"Retry-After": str(self.retry_after)} if self.retry_after is not None else {}


def bad_request(message: str, param: str | None = None) -> GatewayError:
    return GatewayError(400, message, param=param)


def model_not_found(name: str) -> GatewayError:
    return GatewayError(
        404, f"The model `{name}` does not exist.", param="model", code="model_not_found"
    )


def unauthorized() -> GatewayError:
    return GatewayError(401, "Invalid or missing API key.", code="invalid_api_key")


def from_grpc(err: grpc.aio.AioRpcError) -> GatewayError:
    """Map a failed scheduler call; anything unexpected is the server's fault (500)."""
    code, details = err.code(), err.details() or ""
    if code == grpc.StatusCode.UNAVAILABLE:
        return GatewayError(
            503, f"The scheduler is unavailable: {details}", "service_unavailable",
            code="scheduler_unavailable", retry_after=RETRY_AFTER_S,
        )
    if code == grpc.StatusCode.RESOURCE_EXHAUSTED:
        return GatewayError(
            429, f"The server is overloaded: {details}", "rate_limit_error",
            code="rate_limit_exceeded", retry_after=RETRY_AFTER_S,
        )
    if code in (grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.ALREADY_EXISTS,
                grpc.StatusCode.OUT_OF_RANGE, grpc.StatusCode.FAILED_PRECONDITION):
        return GatewayError(400, details or "invalid request")
    if code == grpc.StatusCode.DEADLINE_EXCEEDED:
        return GatewayError(
            504, "The request timed out.", "timeout_error", code="deadline_exceeded"
        )
    logger.warning("scheduler call failed: %s %s", code, details)
    return GatewayError(500, f"Scheduler error ({code.name}): {details}", "server_error")


def to_gateway_error(exc: GatewayError | grpc.aio.AioRpcError) -> GatewayError:
    return exc if isinstance(exc, GatewayError) else from_grpc(exc)


def error_response(err: GatewayError, request: Request | None = None) -> JSONResponse:
    headers = err.headers()
    request_id = getattr(request.state, "request_id", None) if request is not None else None
    if request_id:
        headers["x-request-id"] = request_id
    return JSONResponse(err.body(), status_code=err.status, headers=headers)


def validation_error(errors: Sequence[Mapping[str, Any]]) -> GatewayError:
    """One 400 for a list of pydantic errors; param names the first offending field."""
    parts, param = [], None
    for error in errors:
        loc = [str(p) for p in error.get("loc", ()) if p != "body"]
        if error.get("type") == "json_invalid":
            loc = []
        msg = str(error.get("msg", "invalid value")).removeprefix("Value error, ")
        parts.append(f"{'.'.join(loc)}: {msg}" if loc else msg)
        if param is None and loc:
            param = loc[0]
    return bad_request("; ".join(parts) or "invalid request", param)


def install_error_handlers(app: FastAPI) -> None:
    # Starlette types every handler as taking Exception; each gets only its own class
    async def on_gateway_error(request: Request, exc: Exception) -> JSONResponse:
        assert isinstance(exc, GatewayError)
        return error_response(exc, request)

    async def on_request_validation(request: Request, exc: Exception) -> JSONResponse:
        assert isinstance(exc, RequestValidationError)
        return error_response(validation_error(list(exc.errors())), request)

    async def on_pydantic_validation(request: Request, exc: Exception) -> JSONResponse:
        assert isinstance(exc, ValidationError)
        return error_response(validation_error(exc.errors(include_url=False)), request)

    async def on_grpc_error(request: Request, exc: Exception) -> JSONResponse:
        assert isinstance(exc, grpc.aio.AioRpcError)
        return error_response(from_grpc(exc), request)

    async def on_http_error(request: Request, exc: Exception) -> JSONResponse:
        assert isinstance(exc, StarletteHTTPException)
        kind = "invalid_request_error" if exc.status_code < 500 else "server_error"
        err = GatewayError(exc.status_code, str(exc.detail), kind)
        response = error_response(err, request)
        if exc.headers:
            response.headers.update(exc.headers)
        return response

    app.add_exception_handler(GatewayError, on_gateway_error)
    app.add_exception_handler(RequestValidationError, on_request_validation)
    app.add_exception_handler(ValidationError, on_pydantic_validation)
    app.add_exception_handler(grpc.aio.AioRpcError, on_grpc_error)
    app.add_exception_handler(StarletteHTTPException, on_http_error)
