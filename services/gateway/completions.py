"""POST /v1/completions: prompts (text or token ids) in, one choice per (prompt, sample) out."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator, Sequence
from contextlib import aclosing

from fastapi import Request
from starlette.responses import Response

from common import tracing
from protos import scheduler_pb2
from services.gateway.errors import bad_request, sse_error_event
from services.gateway.generation import Choice, GenerationError, SeqDelta
from services.gateway.logprobs import completion_logprobs
from services.gateway.protocol import CompletionRequest
from services.gateway.responses import (
    CompletionChoice,
    CompletionLogprobs,
    CompletionResponse,
    CompletionStreamChoice,
    CompletionStreamResponse,
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

MAX_CHOICES = 256


async def create_completion(
    ctx: ServingContext, body: CompletionRequest, raw: Request
) -> Response:
    model = ctx.check_model(body.model)
    request_id = ctx.request_id(raw, "cmpl")
    with tracing.span("gateway.tokenize"):
        prompts, texts = await _prompts(ctx, body)
    best_of = body.best_of or body.n
    if len(prompts) * best_of > MAX_CHOICES:
        raise bad_request(f"At most {MAX_CHOICES} choices (prompts x best_of) per request.", "n")
    num_logprobs = -1 if body.logprobs is None else body.logprobs
    if best_of > body.n:  # ranking needs every sampled token's logprob
        num_logprobs = max(num_logprobs, 0)
    streams = ctx.sequences(request_id, prompts, body, num_logprobs, samples=best_of)
    view = CompletionView(ctx, body, request_id, model, prompts, texts)
    if body.stream:
        return sse(view.stream, await prime(raw, streams), request_id)
    choices = await until_disconnected(raw, collect(streams))
    generated = sum(len(c.token_ids) for c in choices)
    if best_of > body.n:
        choices = best_choices(choices, best_of, body.n, keep_logprobs=body.logprobs is not None)
    response = view.response(choices)
    response.usage.completion_tokens = generated  # the discarded samples were computed too
    response.usage.total_tokens = response.usage.prompt_tokens + generated
    return json_response(response, request_id)


def best_choices(choices: list[Choice], best_of: int, n: int,
                 keep_logprobs: bool) -> list[Choice]:
    """Per prompt, the n of its best_of samples with the highest mean token logprob, best first,
    re-indexed prompt * n + rank."""
    out = []
    for prompt in range(len(choices) // best_of):
        group = choices[prompt * best_of:(prompt + 1) * best_of]
        ranked = sorted(group, key=lambda c: -sum(lp.logprob for lp in c.logprobs)
                        / max(1, len(c.logprobs)))
        for rank, choice in enumerate(ranked[:n]):
            choice.index = prompt * n + rank
            if not keep_logprobs:
                choice.logprobs = []
            out.append(choice)
    return out


async def _prompts(
    ctx: ServingContext, body: CompletionRequest
) -> tuple[list[list[int]], list[str]]:
    """Token ids of each prompt, and its text (for echo)."""
    prompt = body.prompt
    if isinstance(prompt, str):
        prompt = [prompt]
    elif isinstance(prompt[0], int):
        prompt = [prompt]
    if isinstance(prompt[0], str):
        texts = list(prompt)
        prompts = await ctx.tokenizer.aencode_batch(texts, body.add_special_tokens)
    else:
        prompts = [list(p) for p in prompt]
        for ids in prompts:
            ctx.tokenizer.check_token_ids(ids, "prompt")
        decode = ctx.tokenizer.decode
        texts = [decode(p, skip_special_tokens=False) if body.echo else "" for p in prompts]
    for ids in prompts:
        ctx.check_prompt(ids)
    return prompts, texts


class CompletionView:
    """Renders choices as a CompletionResponse or as text_completion SSE chunks."""

    def __init__(
        self,
        ctx: ServingContext,
        body: CompletionRequest,
        request_id: str,
        model: str,
        prompts: list[list[int]],
        texts: list[str],
    ) -> None:
        self.tokenizer = ctx.tokenizer
        self.body = body
        self.request_id = request_id
        self.model = model
        self.prompts = prompts
        self.texts = texts
        self._created = int(time.time())

    def _prompt_of(self, index: int) -> int:
        return index // self.body.n

    def _echo(self, index: int) -> str:
        return self.texts[self._prompt_of(index)] if self.body.echo else ""

    def response(self, choices: list[Choice]) -> CompletionResponse:
        usage = UsageCounter(self.prompts, self.body.n)
        out = []
        for choice in choices:
            usage.completion_tokens += len(choice.token_ids)
            if choice.index % self.body.n == 0:
                usage.cached_tokens += choice.num_cached_tokens
            out.append(
                CompletionChoice(
                    index=choice.index,
                    text=self._echo(choice.index) + choice.text,
                    logprobs=self._logprobs(choice.token_ids, choice.logprobs, choice.text_offsets),
                    finish_reason=choice.finish_reason,
                    stop_reason=choice.stop_reason,
                    prompt_token_ids=self._token_ids(self.prompts[self._prompt_of(choice.index)]),
                    token_ids=self._token_ids(choice.token_ids),
                )
            )
        return CompletionResponse(
            id=self.request_id, model=self.model, choices=out, usage=usage.usage()
        )

    async def stream(self, start: SSEStart) -> AsyncIterator[str]:
        usage = UsageCounter(self.prompts, self.body.n)
        started: set[int] = set()
        async with aclosing(start.deltas()) as deltas:
            try:
                async for delta in deltas:
                    usage.add(delta)
                    if delta.index not in started:
                        started.add(delta.index)
                        yield self._chunk(self._first_choice(delta))
                    elif self._worth_sending(delta):
                        yield self._chunk(self._stream_choice(delta))
                if self.body.include_usage():
                    yield event(self._response_chunk([], usage))
            except GenerationError as exc:
                yield sse_error_event(exc)
        yield DONE_EVENT

    def _worth_sending(self, delta: SeqDelta) -> bool:
        return bool(
            delta.text or delta.finish_reason is not None
            or self.body.return_token_ids or self.body.logprobs is not None
        )

    def _first_choice(self, delta: SeqDelta) -> CompletionStreamChoice:
        choice = self._stream_choice(delta)
        choice.text = self._echo(delta.index) + choice.text
        if self.body.return_token_ids:
            choice.prompt_token_ids = self.prompts[self._prompt_of(delta.index)]
        return choice

    def _stream_choice(self, delta: SeqDelta) -> CompletionStreamChoice:
        choice = CompletionStreamChoice(
            index=delta.index,
            text=delta.text,
            logprobs=self._logprobs(delta.token_ids, delta.logprobs, delta.text_offsets),
            finish_reason=delta.finish_reason,
        )
        if delta.finish_reason is not None:
            choice.stop_reason = delta.stop_reason
        if self.body.return_token_ids:
            choice.token_ids = delta.token_ids
        return choice

    def _chunk(self, choice: CompletionStreamChoice) -> str:
        return event(self._response_chunk([choice]))

    def _response_chunk(
        self, choices: list[CompletionStreamChoice], usage: UsageCounter | None = None
    ) -> CompletionStreamResponse:
        chunk = CompletionStreamResponse(
            id=self.request_id, object="text_completion", created=self._created,
            model=self.model, choices=choices,
        )
        if usage is not None:
            chunk.usage = usage.usage()
        return chunk

    def _logprobs(
        self,
        token_ids: Sequence[int],
        logprobs: Sequence[scheduler_pb2.TokenLogprobs],
        offsets: Sequence[int],
    ) -> CompletionLogprobs | None:
        if self.body.logprobs is None:
            return None
        return completion_logprobs(
            self.tokenizer, token_ids, logprobs, offsets, self.body.logprobs
        )

    def _token_ids(self, ids: list[int]) -> list[int] | None:
        return list(ids) if self.body.return_token_ids else None
