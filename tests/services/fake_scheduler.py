"""A deterministic stand-in for the scheduler, for the gateway's own tests.

`fake_gateway()` runs the real gateway (uvicorn on an ephemeral port) against a FakeScheduler
served by a real grpc.aio server, so tests exercise HTTP, SSE and gRPC end to end.

Output token k of a request is `output_ids[k % len]` when `output_ids` is set, else the prompt's
ids cyclically. It honors max_tokens, min_tokens, eos (unless ignore_eos) and stop_token_ids the
way the scheduler does, reports fake logprobs (and fake prompt logprobs with the first token,
when asked: `fake_prompt_logprobs`), and records requests, aborts and cancellations.
It reads requests and writes outputs through the gateway's codec, from the scheduler's side;
`requests` keeps the messages as they came off the wire.
"""

from __future__ import annotations

import asyncio
import socket
from collections.abc import AsyncIterator, Callable, Iterator
from contextlib import asynccontextmanager
from dataclasses import dataclass, replace
from typing import Any

import grpc
import httpx
import openai
import uvicorn
from fastapi import FastAPI

from common.grpc_options import server_options
from common.health import Health
from common.sampling_params import GenerateOutput, GenerateRequest, TokenLogprobs, TopLogprob
from protos import scheduler_pb2, scheduler_pb2_grpc
from protos.scheduler_codec import output_to_pb, request_from_pb
from services.gateway.app import create_app
from services.gateway.config import GatewayConfig
from services.gateway.scheduler_client import SchedulerClient
from services.gateway.tokenizer import Tokenizer

STARTUP_TIMEOUT_S = 30.0
HTTP_TIMEOUT_S = 30.0  # generous: the CI box may be busy
SETTLE_TIMEOUT_S = 5.0  # what gRPC left of the gateway's calls ends by then


def openai_client(url: str, api_key: str = "unused") -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(
        base_url=f"{url}/v1", api_key=api_key, max_retries=0, timeout=HTTP_TIMEOUT_S
    )


def http_client(url: str) -> httpx.AsyncClient:
    return httpx.AsyncClient(base_url=url, timeout=HTTP_TIMEOUT_S)


async def wait_for(predicate: Callable[[], object], timeout_s: float = 15.0) -> None:
    async with asyncio.timeout(timeout_s):
        while not predicate():
            await asyncio.sleep(0.01)


class FakeScheduler(scheduler_pb2_grpc.SchedulerServicer):
    def __init__(
        self,
        output_ids: list[int] | None = None,
        tokens_per_message: int = 1,
        delay_s: float = 0.0,
        num_cached_tokens: int = 0,
    ) -> None:
        self.output_ids = output_ids
        self.tokens_per_message = tokens_per_message
        self.delay_s = delay_s
        self.num_cached_tokens = num_cached_tokens
        self.fail_with: tuple[grpc.StatusCode, str] | None = None  # abort every Generate
        self.finish_with_error: str | None = None  # end streams with finish_reason "error"
        self.requests: list[scheduler_pb2.GenerateRequest] = []
        self.aborted: list[str] = []
        self.cancelled: list[str] = []
        self.finished: list[str] = []
        self.sessions_closed = 0  # Session streams that the gateway ended by closing its side
        self._aborting: set[str] = set()

    def outputs(self, request: GenerateRequest) -> tuple[list[int], str, int]:
        """(token ids, finish reason, stop token id) that the request will produce."""
        source = self.output_ids or list(request.prompt_token_ids)
        sampling = request.sampling
        eos = set(request.eos_token_ids)
        stop_ids = set(sampling.stop_token_ids)
        out: list[int] = []
        while len(out) < sampling.max_tokens:
            token = source[len(out) % len(source)]
            out.append(token)
            if len(out) <= sampling.min_tokens:
                continue
            if (token in eos and not sampling.ignore_eos) or token in stop_ids:
                return out, "stop", token
        return out, "length", -1

    async def Generate(
        self, request: scheduler_pb2.GenerateRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[scheduler_pb2.GenerateResponse]:
        samples = self._start(request)
        if self.fail_with is not None:
            await context.abort(*self.fail_with)
        async for response in self._rounds(samples):
            yield response

    async def Session(
        self, request_iterator: AsyncIterator[scheduler_pb2.SessionRequest],
        context: grpc.aio.ServicerContext,
    ) -> AsyncIterator[scheduler_pb2.SessionResponse]:
        """The same requests on one stream: each runs as a Generate call would, its responses
        named by its request_id (one message each), fail_with as a refusal; an abort message
        stops a sample as Abort does and is recorded as a cancellation (the gateway closed
        its stream early), as is every sample still running when the session ends."""
        messages: asyncio.Queue[scheduler_pb2.SessionResponse | None] = asyncio.Queue()
        tasks: set[asyncio.Task] = set()

        async def run(request: scheduler_pb2.GenerateRequest) -> None:
            samples = self._start(request)
            if self.fail_with is not None:
                code, message = self.fail_with
                refusal = scheduler_pb2.Refusal(request_id=request.request_id,
                                                code=code.value[0], message=message)
                messages.put_nowait(scheduler_pb2.SessionResponse(refused=[refusal]))
                return
            async for response in self._rounds(samples):
                response.request_id = request.request_id
                messages.put_nowait(scheduler_pb2.SessionResponse(outputs=[response]))

        async def read() -> None:
            async for message in request_iterator:
                if message.HasField("generate"):
                    task = asyncio.get_running_loop().create_task(run(message.generate))
                    tasks.add(task)
                    task.add_done_callback(tasks.discard)
                elif message.HasField("abort"):
                    self.cancelled.append(message.abort)
                    self._aborting.add(message.abort)
            self.sessions_closed += 1
            messages.put_nowait(None)

        reader = asyncio.get_running_loop().create_task(read())
        try:
            while (item := await messages.get()) is not None:
                yield item
        finally:
            reader.cancel()
            for task in list(tasks):
                task.cancel()

    def _start(self, request: scheduler_pb2.GenerateRequest) -> list[scheduler_pb2.GenerateRequest]:
        """The request's samples; self.requests records each as its own request."""
        samples = [_sample(request, j) for j in range(1 + len(request.sample_ids))]
        self.requests.extend(samples)
        return samples

    async def _rounds(
        self, samples: list[scheduler_pb2.GenerateRequest]
    ) -> AsyncIterator[scheduler_pb2.GenerateResponse]:
        """The request's samples (n > 1) interleaved, one message each per round, as the real
        scheduler's batches do."""
        pending = {j: self._responses(request_from_pb(s)) for j, s in enumerate(samples)}
        try:
            while pending:
                if self.delay_s:
                    await asyncio.sleep(self.delay_s)
                for j in list(pending):
                    rid = samples[j].request_id
                    if rid in self._aborting:
                        del pending[j]
                        yield scheduler_pb2.GenerateResponse(
                            finish_reason="abort", stop_token_id=-1, sample=j)
                        continue
                    response = next(pending[j])
                    response.sample = j
                    if response.finish_reason:
                        del pending[j]
                        self.finished.append(rid)
                    yield response
        except asyncio.CancelledError:
            self.cancelled.extend(samples[j].request_id for j in pending)
            raise

    def _responses(self, request: GenerateRequest) -> Iterator[scheduler_pb2.GenerateResponse]:
        ids, finish, stop_token = self.outputs(request)
        num_logprobs = request.sampling.logprobs
        step = self.tokens_per_message
        for start in range(0, len(ids), step):
            chunk = tuple(ids[start : start + step])
            logprobs = tuple(
                _fake_logprobs(token, start + k, num_logprobs) for k, token in enumerate(chunk)
            ) if num_logprobs >= 0 else ()
            output = GenerateOutput(token_ids=chunk, logprobs=logprobs)
            if start == 0 and request.sampling.prompt_logprobs >= 0:
                output = replace(output, prompt_logprobs=fake_prompt_logprobs(
                    request.prompt_token_ids, request.sampling.prompt_logprobs))
            if start + step >= len(ids):
                output = replace(
                    output,
                    finish_reason="error" if self.finish_with_error else finish,
                    error=self.finish_with_error or "",
                    stop_token_id=stop_token,
                    num_prompt_tokens=len(request.prompt_token_ids),
                    num_cached_tokens=self.num_cached_tokens,
                )
            yield output_to_pb(output)

    async def Abort(
        self, request: scheduler_pb2.AbortRequest, context: grpc.aio.ServicerContext
    ) -> scheduler_pb2.AbortResponse:
        self.aborted.append(request.request_id)
        self._aborting.add(request.request_id)
        known = any(r.request_id == request.request_id for r in self.requests)
        return scheduler_pb2.AbortResponse(found=known)

    async def Stats(
        self, request: scheduler_pb2.StatsRequest, context: grpc.aio.ServicerContext
    ) -> scheduler_pb2.StatsResponse:
        return scheduler_pb2.StatsResponse(num_finished=len(self.finished))


def _sample(request: scheduler_pb2.GenerateRequest, j: int) -> scheduler_pb2.GenerateRequest:
    """Sample j of a request, as its own request: its id, and seed + j."""
    sample = scheduler_pb2.GenerateRequest()
    sample.CopyFrom(request)
    del sample.sample_ids[:]
    if j:
        sample.request_id = request.sample_ids[j - 1]
        if request.sampling.HasField("seed"):
            sample.sampling.seed = (request.sampling.seed + j) % 2**64
    return sample


def _fake_logprobs(token: int, position: int, k: int) -> TokenLogprobs:
    logprob = -0.25 * (position % 4) - 0.125
    top = [TopLogprob(token, logprob)]
    top += [TopLogprob(abs(token - i), logprob - i) for i in range(1, k)]
    return TokenLogprobs(logprob, tuple(top[:k]))


def fake_prompt_logprobs(prompt_ids: tuple[int, ...] | list[int],
                         k: int) -> tuple[TokenLogprobs, ...]:
    """Prompt token i >= 1 scores -i/8 at rank i; its top k: token 7 at -1/16, then token i."""
    out = []
    for i, token in enumerate(prompt_ids[1:], start=1):
        top = (TopLogprob(7, -0.0625), TopLogprob(token, -i / 8))[:k]
        out.append(TokenLogprobs(-i / 8, top, rank=i))
    return tuple(out)


async def start_fake_scheduler(
    servicer: FakeScheduler, host: str = "127.0.0.1", port: int = 0
) -> tuple[grpc.aio.Server, str]:
    """Serve `servicer` on host:port (0: any free one); returns (server, "host:port")."""
    server = grpc.aio.server(options=server_options())  # the real scheduler's keepalive policy
    scheduler_pb2_grpc.add_SchedulerServicer_to_server(servicer, server)
    Health(server)  # "" SERVING: as a scheduler with workers attached
    port = server.add_insecure_port(f"{host}:{port}")
    await server.start()
    return server, f"{host}:{port}"


@asynccontextmanager
async def serve_app(app: FastAPI, host: str = "127.0.0.1") -> AsyncIterator[str]:
    """Serve `app` with uvicorn on host:0 in this event loop; yields its base URL."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, 0))
    port = sock.getsockname()[1]
    server = uvicorn.Server(
        uvicorn.Config(app, log_level="warning", lifespan="off", timeout_graceful_shutdown=1)
    )
    task = asyncio.create_task(server.serve(sockets=[sock]))
    try:
        async with asyncio.timeout(STARTUP_TIMEOUT_S):
            while not server.started:
                if task.done():
                    task.result()  # raises what stopped it
                    raise RuntimeError("uvicorn exited during startup")
                await asyncio.sleep(0.005)
        yield f"http://{host}:{port}"
    finally:
        server.should_exit = True
        await asyncio.wait_for(task, STARTUP_TIMEOUT_S)
        sock.close()


async def settle(tasks_before: set[asyncio.Task], timeout_s: float = SETTLE_TIMEOUT_S) -> None:
    """Waits, up to timeout_s, for the tasks started since `tasks_before` to end. gRPC ends a
    cancelled call (the gateway's readiness Watch) or a stopped server's handler in tasks of
    its own, as completions come from its poller thread, which serves every event loop of the
    process: one for this loop that comes after the loop closed is handled in the next test's
    loop and fails that test (RuntimeError: Event loop is closed, from
    PollerCompletionQueue._handle_events)."""
    left = asyncio.all_tasks() - tasks_before - {asyncio.current_task()}
    if left:
        await asyncio.wait(left, timeout=timeout_s)


@dataclass
class FakeGateway:
    url: str
    scheduler: FakeScheduler
    config: GatewayConfig
    client: SchedulerClient
    app: FastAPI


@asynccontextmanager
async def fake_gateway(
    model_dir: str,
    tokenizer: Tokenizer | None = None,
    scheduler: FakeScheduler | None = None,
    scheduler_address: str | None = None,
    **config: Any,
) -> AsyncIterator[FakeGateway]:
    """The real gateway against a FakeScheduler (or against `scheduler_address`, e.g. a dead
    port). `config` overrides GatewayConfig fields."""
    tasks_before = asyncio.all_tasks()
    scheduler = scheduler or FakeScheduler()
    server, address = await start_fake_scheduler(scheduler)
    gateway_config = GatewayConfig(
        model=model_dir, scheduler=scheduler_address or address, port=0, **config
    )
    client = SchedulerClient.connect(
        gateway_config.scheduler, gateway_config.request_timeout_s,
        gateway_config.connect_timeout_s,
    )
    try:
        app = create_app(gateway_config, client, tokenizer)
        async with serve_app(app) as url:
            yield FakeGateway(url, scheduler, gateway_config, client, app)
    finally:
        await client.close()
        await server.stop(None)
        await settle(tasks_before)
