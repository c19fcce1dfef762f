"""The one flow both generation APIs share; an API plugs in only what differs (its prompts and
the shape of its choices and chunks):

    check model, request ids -> prompts() -> build, wait for a worker path (else 503),
    submit (one Generate per prompt)
        JSON: collect every choice -> response(choices)
        SSE:  prime (first delta) -> opening_chunks(), chunk(delta)..., usage_chunk(), [DONE]
"""

from __future__ import annotations

import time
from abc import ABC, abstractmethod
from collections.abc import AsyncGenerator, Sequence
from contextlib import aclosing
from typing import ClassVar

from fastapi import Request
from pydantic import BaseModel
from starlette.responses import Response

from common import tracing
from services.gateway.disconnect import until_disconnected
from services.gateway.generation import Choice, DeltaStream, GenerationError, SeqDelta, merge
from services.gateway.protocol import SamplingRequest
from services.gateway.request_builder import output_options
from services.gateway.responses import StreamChunk, Usage
from services.gateway.serving import ServingContext
from services.gateway.sse import (
    DONE_EVENT,
    SSEResponse,
    SSEStart,
    error_event,
    event,
    prime,
    sse,
)
from services.gateway.usage import UsageCounter


class Generation(ABC):
    """One request of a generation API. Subclasses render prompts and shape output; streams,
    disconnects, SSE framing and usage counting stay here. Invariant: `prompt_ids` is set
    before any shaping method is called."""

    ID_PREFIX: ClassVar[str]

    def __init__(self, ctx: ServingContext, body: SamplingRequest, raw: Request) -> None:
        self.ctx = ctx
        self.tokenizer = ctx.tokenizer
        self.body = body
        self.raw = raw
        self.model = ctx.check_model(body.model)
        # request_id: the response's id and x-request-id; the scheduler's is its own
        self.request_id, self.scheduler_id = ctx.request_ids(raw, self.ID_PREFIX)
        self.created = int(time.time())
        self.prompt_ids: list[list[int]] = []

    async def serve(self) -> Response:
        """The response; the request holds a slot of its API key's in-flight budget until the
        response is built or, streamed, until its stream ends."""
        release = self.ctx.in_flight.acquire(self.raw)
        try:
            response = await self._serve()
        except BaseException:
            release()
            raise
        if isinstance(response, SSEResponse):
            response.on_close(release)
        else:
            release()
        return response

    async def _serve(self) -> Response:
        self.tokenizer.check_token_ids([t for t, _ in self.body.logit_bias_pairs()], "logit_bias")
        with tracing.span("gateway.tokenize"):
            self.prompt_ids = await self.prompts()
        requests = self.ctx.builder.build(
            self.scheduler_id, self.prompt_ids, self.body, self.num_logprobs(),
            self.samples_per_prompt(), self.num_prompt_logprobs(),
        )
        await self.ctx.wait_for_workers()
        streams = [self._shaped(s) for s in self.ctx.sequences(requests,
                                                             output_options(self.body))]
        if self.body.stream:
            return sse(self._stream, await prime(self.raw, streams), self.request_id)
        choices = await until_disconnected(self.raw, collect(streams))
        return Response(
            self.response(choices).model_dump_json(), media_type="application/json",
            headers={"x-request-id": self.request_id},
        )

    async def _stream(self, start: SSEStart) -> AsyncGenerator[str, None]:
        usage = self.usage_counter()
        continuous = self.body.continuous_usage()
        async with aclosing(start.deltas()) as deltas:
            try:
                for index, opening in enumerate(self.opening_chunks()):
                    if continuous:
                        opening.usage = usage.of_choice(index)
                    yield event(opening)
                async for delta in deltas:
                    usage.add(delta)
                    chunk = self.chunk(delta)
                    if chunk is not None:
                        if continuous:
                            chunk.usage = usage.of_choice(delta.index)
                        yield event(chunk)
                if self.body.include_usage():
                    yield event(self.usage_chunk(usage.usage()))
            except GenerationError as exc:
                yield error_event(exc)
        yield DONE_EVENT

    async def _shaped(self, stream: DeltaStream) -> DeltaStream:
        async with aclosing(stream) as deltas:
            async for delta in deltas:
                yield self.shape(delta)

    def shape(self, delta: SeqDelta) -> SeqDelta:
        """What of a delta the API reports, before usage is counted; all of it by default."""
        return delta

    def usage_counter(self, choices: Sequence[Choice] = ()) -> UsageCounter:
        usage = UsageCounter(self.prompt_ids, self.body.n)
        for choice in choices:
            usage.add(choice)
        return usage

    def samples_per_prompt(self) -> int:
        return self.body.n

    def opening_chunks(self) -> Sequence[StreamChunk]:
        """Chunks sent before any delta: the i-th one is choice i's."""
        return ()

    def num_prompt_logprobs(self) -> int:
        """-1: none; otherwise the top-k the workers report per prompt token."""
        return -1

    @abstractmethod
    async def prompts(self) -> list[list[int]]:
        """Token ids of each prompt, each one checked against the context length."""

    @abstractmethod
    def num_logprobs(self) -> int:
        """-1: none; otherwise the top-k the scheduler reports per token."""

    @abstractmethod
    def response(self, choices: list[Choice]) -> BaseModel:
        """The JSON body; choices are in index order, prompt i's samples at i*samples + j."""

    @abstractmethod
    def chunk(self, delta: SeqDelta) -> StreamChunk | None:
        """The SSE chunk for a delta; None when it carries nothing the client asked for."""

    @abstractmethod
    def usage_chunk(self, usage: Usage) -> BaseModel:
        """The last chunk before [DONE] when stream_options.include_usage is set."""


async def collect(streams: list[DeltaStream]) -> list[Choice]:
    choices = [Choice(index) for index in range(len(streams))]
    async with aclosing(merge(streams)) as merged:
        async for delta in merged:
            choices[delta.index].add(delta)
    return choices
