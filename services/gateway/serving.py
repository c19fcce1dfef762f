"""What both generation APIs share: model and length checks, GenerateRequest building, fan-out,
and running a request so that a client that goes away aborts it.

    handler -> ServingContext.sequences() -> merge() -> collect (JSON) | prime + SSEResponse
"""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable
from contextlib import aclosing
from typing import TypeVar

from fastapi import Request
from pydantic import BaseModel
from starlette.responses import Response, StreamingResponse
from starlette.types import Receive, Scope, Send

from protos import scheduler_pb2
from services.gateway.config import GatewayConfig
from services.gateway.errors import bad_request, model_not_found
from services.gateway.generation import Choice, OutputOptions, SeqDelta, merge, run_sequence
from services.gateway.protocol import SamplingRequest
from services.gateway.responses import Usage, make_usage
from services.gateway.scheduler_client import SampleStreams, SchedulerClient
from services.gateway.telemetry import GatewayMetrics
from services.gateway.tokenizer import Tokenizer

T = TypeVar("T")
CLIENT_CLOSED_STATUS = 499  # nginx's "client closed request"; nobody reads it


class ClientDisconnected(Exception):
    pass


class ServingContext:
    """The gateway's shared state: config, scheduler client, tokenizer. No per-request state."""

    def __init__(
        self, config: GatewayConfig, client: SchedulerClient, tokenizer: Tokenizer
    ) -> None:
        self.config = config
        self.client = client
        self.tokenizer = tokenizer
        self.max_model_len: int = config.max_model_len
        self.metrics = GatewayMetrics(config.served_model_name[0])

    async def encode_chat(self, body) -> list[int]:
        """Token ids of a chat request's messages through the model's chat template (the
        chat completions and /tokenize bodies carry the same template fields)."""
        return await self.tokenizer.aencode_chat(
            [message.for_template() for message in body.messages],
            add_generation_prompt=body.add_generation_prompt,
            continue_final_message=body.continue_final_message,
            template_kwargs=body.chat_template_kwargs,
            add_special_tokens=body.add_special_tokens,
        )

    def check_model(self, name: str | None) -> str:
        """The served name to report; an unknown name is a 404, like OpenAI."""
        if name is None:
            return self.config.served_model_name[0]
        if name not in self.config.served_model_name:
            raise model_not_found(name)
        return name

    @staticmethod
    def request_id(raw: Request, prefix: str) -> str:
        """The client's x-request-id if given, else a fresh "<prefix>-<uuid hex>"."""
        request_id = raw.headers.get("x-request-id") or f"{prefix}-{uuid.uuid4().hex}"
        raw.state.request_id = request_id
        return request_id

    def check_prompt(self, prompt_ids: list[int], param: str = "prompt") -> None:
        if not prompt_ids:
            raise bad_request("The prompt is empty.", param)
        if len(prompt_ids) >= self.max_model_len:
            raise bad_request(
                f"This model's maximum context length is {self.max_model_len} tokens. "
                f"However, your prompt has {len(prompt_ids)} tokens, which leaves no room "
                "for a completion. Please reduce the length of the prompt.",
                param,
            )

    def max_tokens(self, requested: int | None, prompt_len: int) -> int:
        """Default: all the room left in the context, like vLLM."""
        room = self.max_model_len - prompt_len
        if requested is None:
            return room
        if requested > room:
            raise bad_request(
                f"This model's maximum context length is {self.max_model_len} tokens. "
                f"However, you requested {prompt_len + requested} tokens ({prompt_len} in the "
                f"prompt, {requested} for the completion). Please reduce the length of the "
                "prompt or max_tokens.",
                "max_tokens",
            )
        return requested

    def sampling_params(
        self, req: SamplingRequest, max_tokens: int, num_logprobs: int, seed: int | None
    ) -> scheduler_pb2.SamplingParams:
        defaults = self.tokenizer.sampling_defaults

        def pick(value: float | None, key: str, fallback: float) -> float:
            return value if value is not None else defaults.get(key, fallback)

        params = scheduler_pb2.SamplingParams(
            temperature=pick(req.temperature, "temperature", 1.0),
            top_p=pick(req.top_p, "top_p", 1.0),
            top_k=int(pick(req.top_k, "top_k", 0)),
            min_p=pick(req.min_p, "min_p", 0.0),
            presence_penalty=req.presence_penalty,
            frequency_penalty=req.frequency_penalty,
            repetition_penalty=pick(req.repetition_penalty, "repetition_penalty", 1.0),
            max_tokens=max_tokens,
            min_tokens=req.min_tokens,
            stop_token_ids=req.stop_token_ids or [],
            ignore_eos=req.ignore_eos,
            logprobs=num_logprobs,
        )
        if seed is not None:
            params.seed = seed % 2**64  # the API takes signed 64-bit seeds
        return params

    def sequences(
        self,
        base_id: str,
        prompts: list[list[int]],
        req: SamplingRequest,
        num_logprobs: int,
        samples: int | None = None,
    ) -> list[AsyncIterator[SeqDelta]]:
        """One Generate per prompt i carrying its samples j < samples (default n): choice index
        i*samples + j, request id "<base_id>-<index>" (just base_id for a single choice),
        seed + j (the scheduler derives it). Validates every prompt before any request
        starts."""
        options = OutputOptions(
            stop=tuple(req.stop_strings()),
            include_stop_str_in_output=req.include_stop_str_in_output,
            min_tokens=req.min_tokens,
            skip_special_tokens=req.skip_special_tokens,
        )
        samples = samples or req.n
        total = len(prompts) * samples
        streams = []
        for i, prompt_ids in enumerate(prompts):
            max_tokens = self.max_tokens(req.requested_max_tokens(), len(prompt_ids))
            ids = [base_id if total == 1 else f"{base_id}-{i * samples + j}"
                   for j in range(samples)]
            request = scheduler_pb2.GenerateRequest(
                request_id=ids[0],
                sample_ids=ids[1:],
                prompt_token_ids=prompt_ids,
                sampling=self.sampling_params(req, max_tokens, num_logprobs, req.seed),
                eos_token_ids=self.tokenizer.eos_token_ids,
                priority=req.priority,
                cache_salt=req.cache_salt or "",
            )
            source = SampleStreams(self.client, request)
            streams.extend(
                run_sequence(source, j, self.tokenizer, i * samples + j, options, self.metrics)
                for j in range(samples)
            )
        return streams


async def collect(streams: list[AsyncIterator[SeqDelta]]) -> list[Choice]:
    choices = [Choice(index) for index in range(len(streams))]
    async with aclosing(merge(streams)) as merged:
        async for delta in merged:
            choices[delta.index].add(delta)
    return choices


async def until_disconnected(raw: Request, work: Awaitable[T]) -> T:
    """`work`'s result, unless the client disconnects first: then `work` is cancelled (which
    aborts its scheduler requests) and ClientDisconnected is raised."""
    task = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(_wait_for_disconnect(raw))
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
        if not task.done():
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
    if task.cancelled():
        raise ClientDisconnected
    return task.result()


async def _wait_for_disconnect(raw: Request) -> None:
    while (await raw.receive())["type"] != "http.disconnect":
        pass


async def prime(raw: Request, streams: list[AsyncIterator[SeqDelta]]) -> SSEStart:
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

    def __init__(self, first: SeqDelta | None, rest: AsyncGenerator[SeqDelta, None]) -> None:
        self.first = first
        self.rest = rest

    async def deltas(self) -> AsyncIterator[SeqDelta]:
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
        self, body: AsyncGenerator[str, None], start: SSEStart, headers: dict[str, str]
    ) -> None:
        super().__init__(body, headers={"Cache-Control": "no-cache", **headers})
        self._closers = (body, start.rest)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            for generator in self._closers:
                await generator.aclose()


def sse(
    render: Callable[[SSEStart], AsyncGenerator[str, None]], start: SSEStart, request_id: str
) -> SSEResponse:
    return SSEResponse(render(start), start, headers={"x-request-id": request_id})


DONE_EVENT = "data: [DONE]\n\n"


def event(chunk: BaseModel) -> str:
    """One SSE event; chunks leave out fields the code did not set (see responses.py)."""
    return f"data: {chunk.model_dump_json(exclude_unset=True)}\n\n"


def json_response(body: BaseModel, request_id: str) -> Response:
    return Response(
        body.model_dump_json(), media_type="application/json",
        headers={"x-request-id": request_id},
    )


class UsageCounter:
    """Token counts of a request: each prompt once, every choice's tokens; cached tokens are
    read from the first choice of each prompt (its n samples share one prompt)."""

    def __init__(self, prompts: list[list[int]], n: int) -> None:
        self.prompt_tokens = sum(len(p) for p in prompts)
        self.completion_tokens = 0
        self.cached_tokens = 0
        self._n = n

    def add(self, delta: SeqDelta) -> None:
        self.completion_tokens += len(delta.token_ids)
        if delta.finish_reason is not None and delta.index % self._n == 0:
            self.cached_tokens += delta.num_cached_tokens

    def usage(self) -> Usage:
        return make_usage(self.prompt_tokens, self.completion_tokens, self.cached_tokens)
