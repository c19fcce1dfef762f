"""POST /v1/chat/completions: messages -> chat template -> one prompt, n choices."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator, Sequence
from contextlib import aclosing

from fastapi import Request
from starlette.responses import Response

from common import tracing
from protos import scheduler_pb2
from services.gateway.errors import sse_error_event
from services.gateway.generation import Choice, GenerationError, SeqDelta
from services.gateway.logprobs import chat_logprobs
from services.gateway.protocol import ChatCompletionRequest
from services.gateway.responses import (
    ChatChoice,
    ChatCompletionResponse,
    ChatCompletionStreamResponse,
    ChatDelta,
    ChatLogprobs,
    ChatMessageOut,
    ChatStreamChoice,
)
from services.gateway.serving import (
    DONE_EVENT,
    ServingContext,
    SSEStart,
    UsageCounter,
    collect,
    event,
    json_response,
    prime,
    sse,
    until_disconnected,
)


async def create_chat_completion(
    ctx: ServingContext, body: ChatCompletionRequest, raw: Request
) -> Response:
    model = ctx.check_model(body.model)
    request_id = ctx.request_id(raw, "chatcmpl")
    with tracing.span("gateway.tokenize"):
        prompt_ids = await ctx.encode_chat(body)
    ctx.check_prompt(prompt_ids, "messages")
    streams = ctx.sequences(request_id, [prompt_ids], body, body.num_logprobs())
    view = ChatView(ctx, body, request_id, model, prompt_ids)
    if body.stream:
        return sse(view.stream, await prime(raw, streams), request_id)
    choices = await until_disconnected(raw, collect(streams))
    return json_response(view.response(choices), request_id)


class ChatView:
    """Renders choices as a ChatCompletionResponse or as chat.completion.chunk SSE events."""

    def __init__(
        self,
        ctx: ServingContext,
        body: ChatCompletionRequest,
        request_id: str,
        model: str,
        prompt_ids: list[int],
    ) -> None:
        self.tokenizer = ctx.tokenizer
        self.body = body
        self.request_id = request_id
        self.model = model
        self.prompt_ids = prompt_ids
        self._created = int(time.time())

    def response(self, choices: list[Choice]) -> ChatCompletionResponse:
        usage = UsageCounter([self.prompt_ids], self.body.n)
        out = []
        for choice in choices:
            usage.completion_tokens += len(choice.token_ids)
            if choice.index == 0:
                usage.cached_tokens = choice.num_cached_tokens
            out.append(
                ChatChoice(
                    index=choice.index,
                    message=ChatMessageOut(content=choice.text),
                    logprobs=self._logprobs(choice.token_ids, choice.logprobs),
                    finish_reason=choice.finish_reason,
                    stop_reason=choice.stop_reason,
                    token_ids=list(choice.token_ids) if self.body.return_token_ids else None,
                )
            )
        return ChatCompletionResponse(
            id=self.request_id,
            model=self.model,
            choices=out,
            usage=usage.usage(),
            prompt_token_ids=self.prompt_ids if self.body.return_token_ids else None,
        )

    async def stream(self, start: SSEStart) -> AsyncIterator[str]:
        usage = UsageCounter([self.prompt_ids], self.body.n)
        async with aclosing(start.deltas()) as deltas:
            try:
                for index in range(self.body.n):
                    yield event(self._role_chunk(index))
                async for delta in deltas:
                    usage.add(delta)
                    if self._worth_sending(delta):
                        yield event(self._chunk([self._stream_choice(delta)]))
                if self.body.include_usage():
                    chunk = self._chunk([])
                    chunk.usage = usage.usage()
                    yield event(chunk)
            except GenerationError as exc:
                yield sse_error_event(exc)
        yield DONE_EVENT

    def _role_chunk(self, index: int) -> ChatCompletionStreamResponse:
        choice = ChatStreamChoice(
            index=index,
            delta=ChatDelta(role="assistant", content=""),
            logprobs=None,
            finish_reason=None,
        )
        chunk = self._chunk([choice])
        if index == 0 and self.body.return_token_ids:
            chunk.prompt_token_ids = self.prompt_ids
        return chunk

    def _worth_sending(self, delta: SeqDelta) -> bool:
        return bool(
            delta.text or delta.finish_reason is not None
            or self.body.return_token_ids or self.body.logprobs
        )

    def _stream_choice(self, delta: SeqDelta) -> ChatStreamChoice:
        choice = ChatStreamChoice(
            index=delta.index,
            delta=ChatDelta(content=delta.text) if delta.text else ChatDelta(),
            logprobs=self._logprobs(delta.token_ids, delta.logprobs),
            finish_reason=delta.finish_reason,
        )
        if delta.finish_reason is not None:
            choice.stop_reason = delta.stop_reason
        if self.body.return_token_ids:
            choice.token_ids = delta.token_ids
        return choice

    def _chunk(self, choices: list[ChatStreamChoice]) -> ChatCompletionStreamResponse:
        return ChatCompletionStreamResponse(
            id=self.request_id, object="chat.completion.chunk", created=self._created,
            model=self.model, choices=choices,
        )

    def _logprobs(
        self, token_ids: Sequence[int], logprobs: Sequence[scheduler_pb2.TokenLogprobs]
    ) -> ChatLogprobs | None:
        if not self.body.logprobs:
            return None
        return chat_logprobs(self.tokenizer, token_ids, logprobs, self.body.top_logprobs or 0)
