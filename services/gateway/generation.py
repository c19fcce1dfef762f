"""A choice's share of a Scheduler.Generate stream (one per prompt, carrying its n samples),
turned into text deltas; the choices merged.

Per choice:  GenerateOutput (token ids) -> IncrementalDetokenizer -> StopMatcher -> SeqDelta.
A sequence that ends before the scheduler said it finished (stop string, client gone, error)
cancels its gRPC stream and aborts the request, so the scheduler frees its blocks.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncGenerator, Sequence
from contextlib import aclosing
from dataclasses import dataclass, field

import grpc

from common.sampling_params import GenerateOutput, GenerateRequest, TokenLogprobs
from protos.scheduler_codec import output_from_pb
from services.gateway.detokenizer import IncrementalDetokenizer
from services.gateway.errors import GatewayError
from services.gateway.scheduler_client import SampleStreams
from services.gateway.stop import StopMatcher
from services.gateway.telemetry import GatewayMetrics, SequenceTelemetry
from services.gateway.tokenizer import Tokenizer


@dataclass(frozen=True)
class OutputOptions:
    """What the gateway does with a choice's tokens (the scheduler never sees these)."""

    stop: tuple[str, ...] = ()
    include_stop_str_in_output: bool = False
    min_tokens: int = 0
    skip_special_tokens: bool = True


@dataclass
class SeqDelta:
    """New output of choice `index`. text_offsets[i] is where token_ids[i]'s text starts in the
    choice's (untruncated) text; logprobs, when asked, has one entry per token id;
    prompt_logprobs, when asked, comes with the first delta (one per prompt token but the
    first)."""

    index: int
    text: str
    token_ids: list[int]
    text_offsets: list[int]
    logprobs: Sequence[TokenLogprobs] = ()
    prompt_logprobs: Sequence[TokenLogprobs] = ()
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    num_cached_tokens: int = 0


DeltaStream = AsyncGenerator[SeqDelta, None]  # one choice's deltas


@dataclass
class Choice:
    """A choice's whole output, accumulated from its deltas (non-streaming responses)."""

    index: int
    text_parts: list[str] = field(default_factory=list)
    token_ids: list[int] = field(default_factory=list)
    text_offsets: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprobs] = field(default_factory=list)
    prompt_logprobs: Sequence[TokenLogprobs] = ()
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    num_cached_tokens: int = 0

    def add(self, delta: SeqDelta) -> None:
        self.text_parts.append(delta.text)
        self.token_ids.extend(delta.token_ids)
        self.text_offsets.extend(delta.text_offsets)
        self.logprobs.extend(delta.logprobs)
        if delta.prompt_logprobs:
            self.prompt_logprobs = delta.prompt_logprobs
        if delta.finish_reason is not None:
            self.finish_reason = delta.finish_reason
            self.stop_reason = delta.stop_reason
            self.num_cached_tokens = delta.num_cached_tokens

    @property
    def text(self) -> str:
        return "".join(self.text_parts)


async def run_sequence(
    request: GenerateRequest,
    source: SampleStreams,
    sample: int,
    tokenizer: Tokenizer,
    index: int,
    options: OutputOptions,
    metrics: GatewayMetrics | None = None,
) -> DeltaStream:
    """Deltas of one choice (sample `sample` of `request`, streamed by `source`, the call that
    carries `request`); the last one carries finish_reason."""
    request_id = request.request_ids[sample]
    telemetry = SequenceTelemetry(metrics, request, request_id, counts_prompt=sample == 0)
    final_reason, num_cached = None, 0
    detok = IncrementalDetokenizer(
        tokenizer, request.prompt_token_ids, options.skip_special_tokens
    )
    stops = StopMatcher(options.stop, options.include_stop_str_in_output)
    num_tokens, text_len = 0, 0
    scheduler_finished = False
    stream = source.stream(sample, telemetry.span)
    try:
        async for message in stream:
            output = output_from_pb(message)
            ids = list(output.token_ids)
            num_tokens += len(ids)
            telemetry.on_tokens(len(ids))
            detok_start = time.perf_counter() if telemetry.tracing else 0.0
            offsets, pieces = [], []
            for k, token_id in enumerate(ids):
                offsets.append(text_len)
                if k == len(ids) - 1 and _hides_stop_token(output, options):
                    continue
                piece = detok.add(token_id)
                text_len += len(piece)
                pieces.append(piece)
            if output.finish_reason:
                pieces.append(detok.flush())
            if telemetry.tracing:
                telemetry.detokenize_s += time.perf_counter() - detok_start
            text = stops.feed("".join(pieces), check=num_tokens > options.min_tokens)
            delta = SeqDelta(index, text, ids, offsets, output.logprobs, output.prompt_logprobs)
            scheduler_finished = bool(output.finish_reason)
            if stops.matched is not None:
                delta.finish_reason, delta.stop_reason = "stop", stops.matched
            elif output.finish_reason:
                delta.text += stops.flush()
                delta.finish_reason = _finish_reason(output)
                stop_token = output.stop_token_id
                if delta.finish_reason == "stop" and stop_token in request.sampling.stop_token_ids:
                    delta.stop_reason = stop_token  # vLLM: None for EOS, the id for stop_token_ids
            if delta.finish_reason is not None:
                delta.num_cached_tokens = output.num_cached_tokens
                final_reason, num_cached = delta.finish_reason, output.num_cached_tokens
            yield delta
            if delta.finish_reason is not None:
                return
        raise GatewayError(
            502, "The scheduler closed the stream without a finish reason.", "server_error"
        )
    finally:
        await stream.aclose()
        if not scheduler_finished:
            source.client.abort_soon(request_id)
        if final_reason is None and scheduler_finished:
            final_reason = "error"
        telemetry.finish(final_reason, num_cached)


def _hides_stop_token(output: GenerateOutput, options: OutputOptions) -> bool:
    """The token that stopped the sequence is counted but not shown, as in vLLM."""
    return (
        output.finish_reason == "stop"
        and output.stop_token_id >= 0
        and len(output.token_ids) > 0
        and output.token_ids[-1] == output.stop_token_id
        and not options.include_stop_str_in_output
    )


def _finish_reason(output: GenerateOutput) -> str:
    if output.finish_reason == "error":
        raise GatewayError(
            500, output.error or "The scheduler failed this request.", "server_error"
        )
    return output.finish_reason


async def merge(streams: list[DeltaStream]) -> DeltaStream:
    """Interleave the choices' deltas as they arrive. Closing the merged stream, or one choice
    failing, closes every choice (each aborts its scheduler request)."""
    if len(streams) == 1:
        async with aclosing(streams[0]) as only:
            async for delta in only:
                yield delta
        return
    queue: asyncio.Queue[SeqDelta | int] = asyncio.Queue()

    async def pump(i: int, stream: DeltaStream) -> None:
        try:
            async with aclosing(stream):
                async for delta in stream:
                    queue.put_nowait(delta)
        finally:
            queue.put_nowait(i)  # end marker; awaiting the task then raises its error, if any

    tasks = [asyncio.create_task(pump(i, s)) for i, s in enumerate(streams)]
    try:
        remaining = len(tasks)
        while remaining:
            item = await queue.get()
            if isinstance(item, int):
                remaining -= 1
                await tasks[item]
            else:
                yield item
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


GenerationError = (GatewayError, grpc.aio.AioRpcError)
