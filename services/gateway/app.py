"""The gateway's HTTP surface: an OpenAI-compatible API plus vLLM's /tokenize and /detokenize.

    /v1/completions, /v1/chat/completions   -> completions.py, chat.py through flow.py
    /v1/models, /v1/models/{id}             served model names
    /tokenize, /detokenize                  like vLLM's
    /health                                 liveness: 200 while the process serves HTTP
    /ready                                  readiness: 200 while the scheduler reports a worker
                                            that can serve a request, else 503 (readiness.py)
    /metrics                                Prometheus text format (no auth, like vLLM's)

With an api_key, /v1/*, /tokenize and /detokenize require `Authorization: Bearer <key>`.
"""

from __future__ import annotations

import hmac
import os
from collections.abc import Awaitable
from typing import Annotated, Any

from fastapi import APIRouter, Body, Depends, FastAPI, Request
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest, multiprocess
from starlette.responses import Response
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from common import tracing
from services.gateway.body_guard import BodyGuard
from services.gateway.chat import ChatCompletion
from services.gateway.completions import Completion
from services.gateway.config import GatewayConfig
from services.gateway.disconnect import CLIENT_CLOSED_STATUS, ClientDisconnected
from services.gateway.errors import install_error_handlers, unauthorized
from services.gateway.processes import MULTIPROC_ENV
from services.gateway.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    TokenizeChatRequest,
    TokenizeCompletionRequest,
)
from services.gateway.responses import (
    ChatCompletionResponse,
    CompletionResponse,
    DetokenizeResponse,
    ErrorResponse,
    ModelCard,
    ModelList,
    TokenizeResponse,
)
from services.gateway.scheduler_client import SchedulerClient
from services.gateway.serving import ServingContext
from services.gateway.tokenizer import Tokenizer

ERROR_RESPONSES: dict[int | str, dict[str, Any]] = {
    status: {"model": ErrorResponse} for status in (400, 401, 404, 429, 503, 504)
}
SSE_DOC: dict[str, dict[str, Any]] = {"text/event-stream": {}}


def create_app(
    config: GatewayConfig, scheduler_client: SchedulerClient, tokenizer: Tokenizer | None = None
) -> FastAPI:
    """The FastAPI app; the caller owns `scheduler_client` (and closes it)."""
    ctx = ServingContext(config, scheduler_client, tokenizer or Tokenizer(config.model))
    app = FastAPI(title="pdserve gateway", summary="OpenAI-compatible API of pdserve")
    app.state.ctx = ctx
    install_error_handlers(app)
    app.add_middleware(BodyGuard, limit=config.max_request_body_bytes,
                       read_timeout_s=config.request_body_timeout_s,
                       write_timeout_s=config.stream_write_timeout_s)
    app.add_middleware(RequestIdMiddleware)
    auth = [Depends(_api_key_check(config.api_key))] if config.api_key else []
    api = APIRouter(dependencies=auth, responses=ERROR_RESPONSES)
    _add_generation_routes(api, ctx)
    _add_model_routes(api, ctx)
    _add_tokenizer_routes(api, ctx)
    app.include_router(api)

    @app.get("/health")
    async def health() -> Response:
        return Response(status_code=200)

    @app.get("/ready", responses={503: {"model": ErrorResponse}})
    async def ready() -> Response:
        if ctx.client.readiness.serving:
            return Response(status_code=200)
        raise ctx.client.readiness.unavailable()

    @app.get("/metrics", include_in_schema=False)
    async def metrics() -> Response:
        registry = ctx.metrics.registry
        if os.environ.get(MULTIPROC_ENV):  # one of several gateway processes: all of them
            registry = CollectorRegistry()
            multiprocess.MultiProcessCollector(registry)
        return Response(generate_latest(registry), media_type=CONTENT_TYPE_LATEST)

    tracing.instrument_fastapi(app)
    return app


def _add_generation_routes(api: APIRouter, ctx: ServingContext) -> None:
    @api.post(
        "/v1/completions", response_model=CompletionResponse,
        responses={200: {"content": SSE_DOC}},
    )
    async def completions(body: CompletionRequest, raw: Request) -> Response:
        return await _unless_gone(Completion(ctx, body, raw).serve())

    @api.post(
        "/v1/chat/completions", response_model=ChatCompletionResponse,
        responses={200: {"content": SSE_DOC}},
    )
    async def chat_completions(body: ChatCompletionRequest, raw: Request) -> Response:
        return await _unless_gone(ChatCompletion(ctx, body, raw).serve())


def _add_model_routes(api: APIRouter, ctx: ServingContext) -> None:
    def card(name: str) -> ModelCard:
        return ModelCard(id=name, root=ctx.config.model, max_model_len=ctx.max_model_len)

    @api.get("/v1/models")
    async def list_models() -> ModelList:
        return ModelList(data=[card(name) for name in ctx.config.served_model_name])

    @api.get("/v1/models/{model_id:path}")
    async def get_model(model_id: str) -> ModelCard:
        return card(ctx.check_model(model_id))


def _add_tokenizer_routes(api: APIRouter, ctx: ServingContext) -> None:
    @api.post("/tokenize")
    async def tokenize(
        body: Annotated[TokenizeCompletionRequest | TokenizeChatRequest, Body()],
    ) -> TokenizeResponse:
        ctx.check_model(body.model)
        if isinstance(body, TokenizeChatRequest):
            tokens = await ctx.encode_chat(body)
        else:
            tokens = (await ctx.tokenizer.aencode_batch([body.prompt], body.add_special_tokens))[0]
        return TokenizeResponse(
            count=len(tokens),
            max_model_len=ctx.max_model_len,
            tokens=tokens,
            token_strs=ctx.tokenizer.token_strs(tokens) if body.return_token_strs else None,
        )

    @api.post("/detokenize")
    async def detokenize(body: DetokenizeRequest) -> DetokenizeResponse:
        ctx.check_model(body.model)
        ctx.tokenizer.check_token_ids(body.tokens, "tokens", decode_only=True)
        return DetokenizeResponse(
            prompt=ctx.tokenizer.decode(body.tokens, skip_special_tokens=False)
        )


async def _unless_gone(work: Awaitable[Response]) -> Response:
    try:
        return await work
    except ClientDisconnected:
        return Response(status_code=CLIENT_CLOSED_STATUS)


def _api_key_check(api_key: str):  # noqa: ANN202 - a FastAPI dependency
    expected = f"Bearer {api_key}".encode()

    async def check(request: Request) -> None:
        given = request.headers.get("authorization", "").encode()
        if not hmac.compare_digest(given, expected):
            raise unauthorized()

    return check


class RequestIdMiddleware:
    """Echo the client's x-request-id on every response (handlers set it when they assign one)."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        request_id = None
        if scope["type"] == "http":
            request_id = next((v for k, v in scope["headers"] if k == b"x-request-id"), None)
        if request_id is None:
            await self.app(scope, receive, send)
            return

        async def send_with_id(message: Message) -> None:
            if message["type"] == "http.response.start":
                headers = [(k, v) for k, v in message.get("headers", []) if k != b"x-request-id"]
                message = {**message, "headers": [*headers, (b"x-request-id", request_id)]}
            await send(message)

        await self.app(scope, receive, send_with_id)
