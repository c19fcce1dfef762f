"""The gateway over real HTTP (uvicorn, port 0) against a fake scheduler over real gRPC.

Clients: the official `openai` client and plain httpx. The fake scheduler echoes the prompt's
token ids cyclically (or `output_ids`), so every expected text is computable here.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import socket

import grpc
import httpx
import pytest

from protos import scheduler_pb2
from services.gateway.config import GatewayConfig
from services.gateway.main import serve
from services.gateway.scheduler_client import SampleStreams, SchedulerClient
from services.gateway.tokenizer import Tokenizer
from tests.services.fake_scheduler import (
    FakeScheduler,
    fake_gateway,
    http_client,
    openai_client,
    start_fake_scheduler,
    wait_for,
)

pytestmark = pytest.mark.anyio


CHAT_MESSAGES = [{"role": "user", "content": "hi"}]


def encode(tokenizer: Tokenizer, text: str) -> list[int]:
    return tokenizer.encode_batch([text], add_special_tokens=False)[0]


def sse_events(body: str) -> list[str]:
    events = [line[len("data: "):] for line in body.split("\n\n") if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    return events


# -- completions --------------------------------------------------------------------------------


async def test_completion_with_openai_client(model_dir: str, tokenizer: Tokenizer) -> None:
    async with fake_gateway(model_dir, tokenizer) as gw:
        async with openai_client(gw.url) as client:
            result = await client.completions.create(
                model=model_dir, prompt="Hello 😀 world", max_tokens=6
            )
    prompt_ids = encode(tokenizer, "Hello 😀 world")
    assert result.choices[0].text == tokenizer.decode(prompt_ids[:6])
    assert result.choices[0].finish_reason == "length"
    assert result.model == model_dir and result.id.startswith("cmpl-")
    assert result.usage.prompt_tokens == len(prompt_ids)
    assert result.usage.completion_tokens == 6 and result.usage.total_tokens == len(prompt_ids) + 6
    [sent] = gw.scheduler.requests
    assert list(sent.prompt_token_ids) == prompt_ids
    assert sent.request_id == result.id
    assert list(sent.eos_token_ids) == tokenizer.eos_token_ids


async def test_completion_stream_with_usage(model_dir: str, tokenizer: Tokenizer) -> None:
    prompt = "日本語 and 👍🏽 emoji"
    async with fake_gateway(model_dir, tokenizer, FakeScheduler(num_cached_tokens=3)) as gw:
        async with openai_client(gw.url) as client:
            stream = await client.completions.create(
                model=model_dir, prompt=prompt, max_tokens=9, stream=True,
                stream_options={"include_usage": True},
            )
            chunks = [chunk async for chunk in stream]
    prompt_ids = encode(tokenizer, prompt)
    texts = [c.choices[0].text for c in chunks if c.choices]
    assert "".join(texts) == tokenizer.decode(prompt_ids[:9])
    assert not any("\ufffd" in t for t in texts[:-1])
    assert chunks[-2].choices[0].finish_reason == "length"
    assert chunks[-1].choices == []
    assert chunks[-1].usage.completion_tokens == 9
    assert chunks[-1].usage.prompt_tokens == len(prompt_ids)
    assert chunks[-1].usage.prompt_tokens_details.cached_tokens == 3


async def test_default_max_tokens_fills_the_context(model_dir: str, tokenizer: Tokenizer) -> None:
    async with fake_gateway(model_dir, tokenizer, max_model_len=40) as gw:
        async with http_client(gw.url) as http:
            response = await http.post("/v1/completions", json={"prompt": "the old server"})
    assert response.status_code == 200
    prompt_len = len(encode(tokenizer, "the old server"))
    assert gw.scheduler.requests[0].sampling.max_tokens == 40 - prompt_len
    assert response.json()["usage"]["completion_tokens"] == 40 - prompt_len


async def test_sampling_params_reach_the_scheduler(model_dir: str, tokenizer: Tokenizer) -> None:
    body = {
        "prompt": [5, 6, 7], "max_tokens": 4, "temperature": 0.5, "top_p": 0.9, "top_k": 7,
        "min_p": 0.1, "presence_penalty": 0.5, "frequency_penalty": -0.5,
        "repetition_penalty": 1.2, "min_tokens": 2, "ignore_eos": True, "stop_token_ids": [9],
        "seed": 11, "priority": -3, "cache_salt": "salt", "unknown_field": 1, "user": "u",
    }
    async with fake_gateway(model_dir, tokenizer) as gw:
        async with http_client(gw.url) as http:
            response = await http.post("/v1/completions", json=body)
    assert response.status_code == 200, response.text
    [sent] = gw.scheduler.requests
    s = sent.sampling
    assert (s.max_tokens, s.top_k, s.min_tokens, s.ignore_eos, s.seed) == (4, 7, 2, True, 11)
    assert s.temperature == pytest.approx(0.5) and s.top_p == pytest.approx(0.9)
    assert s.min_p == pytest.approx(0.1) and s.repetition_penalty == pytest.approx(1.2)
    assert (s.presence_penalty, s.frequency_penalty) == (0.5, -0.5)
    assert list(s.stop_token_ids) == [9] and s.logprobs == -1
    assert sent.priority == -3 and list(sent.prompt_token_ids) == [5, 6, 7]


async def test_return_token_ids(model_dir: str, tokenizer: Tokenizer) -> None:
    async with fake_gateway(model_dir, tokenizer) as gw:
        async with http_client(gw.url) as http:
            body = {"prompt": "a server", "max_tokens": 3, "return_token_ids": True}
            full = (await http.post("/v1/completions", json=body)).json()
            streamed = await http.post("/v1/completions", json={**body, "stream": True})
    prompt_ids = encode(tokenizer, "a server")
    assert full["choices"][0]["prompt_token_ids"] == prompt_ids
    expected = [prompt_ids[k % len(prompt_ids)] for k in range(3)]  # the fake echoes cyclically
    assert full["choices"][0]["token_ids"] == expected
    chunks = [json.loads(e) for e in sse_events(streamed.text)[:-1]]
    assert chunks[0]["choices"][0]["prompt_token_ids"] == prompt_ids
    assert [t for c in chunks for t in c["choices"][0]["token_ids"]] == expected


async def test_n_and_several_prompts_fan_out(model_dir: str, tokenizer: Tokenizer) -> None:
    prompts = ["first prompt", "second one"]
    async with fake_gateway(model_dir, tokenizer) as gw:
        async with openai_client(gw.url) as client:
            result = await client.completions.create(
                model=model_dir, prompt=prompts, n=2, max_tokens=2, seed=100,
                extra_headers={"x-request-id": "fan"},
            )
    assert [c.index for c in result.choices] == [0, 1, 2, 3]
    for choice in result.choices:
        assert choice.text == tokenizer.decode(encode(tokenizer, prompts[choice.index // 2])[:2])
    sent = {r.request_id: r for r in gw.scheduler.requests}
    base = min(sent).removesuffix("-0")  # the scheduler's own id, not the client's "fan"
    assert base.startswith("cmpl-") and sorted(sent) == [f"{base}-{i}" for i in range(4)]
    assert [sent[f"{base}-{i}"].sampling.seed for i in range(4)] == [100, 101, 100, 101]
    assert result.usage.completion_tokens == 8
    assert result.usage.prompt_tokens == sum(len(encode(tokenizer, p)) for p in prompts)


async def test_token_id_prompts_and_echo(model_dir: str, tokenizer: Tokenizer) -> None:
    batch = [encode(tokenizer, "abc def"), encode(tokenizer, "ghi")]
    async with fake_gateway(model_dir, tokenizer) as gw:
        async with http_client(gw.url) as http:
            body = {"prompt": batch, "max_tokens": 1, "echo": True}
            result = (await http.post("/v1/completions", json=body)).json()
    texts = [c["text"] for c in result["choices"]]
    assert texts == [tokenizer.decode(p) + tokenizer.decode(p[:1]) for p in batch]


async def test_completion_logprobs(model_dir: str, tokenizer: Tokenizer) -> None:
    async with fake_gateway(model_dir, tokenizer) as gw:
        async with openai_client(gw.url) as client:
            result = await client.completions.create(
                model=model_dir, prompt="the old server", max_tokens=3, logprobs=2
            )
    prompt_ids = encode(tokenizer, "the old server")
    logprobs = result.choices[0].logprobs
    assert logprobs.tokens == [tokenizer.decode([t]) for t in prompt_ids[:3]]
    assert logprobs.token_logprobs == [-0.125, -0.375, -0.625]
    assert all(len(top) == 2 for top in logprobs.top_logprobs)
    assert logprobs.text_offset[0] == 0
    assert logprobs.text_offset == sorted(logprobs.text_offset)
    assert gw.scheduler.requests[0].sampling.logprobs == 2


# -- chat ---------------------------------------------------------------------------------------


async def test_chat_with_openai_client(model_dir: str, tokenizer: Tokenizer) -> None:
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi 你好"}]
    async with fake_gateway(model_dir, tokenizer, served_model_name=("tiny", "alias")) as gw:
        async with openai_client(gw.url) as client:
            result = await client.chat.completions.create(
                model="alias", messages=messages, max_completion_tokens=8
            )
    prompt_ids = encode(tokenizer, tokenizer.render_chat(messages))
    assert list(gw.scheduler.requests[0].prompt_token_ids) == prompt_ids
    assert result.choices[0].message.role == "assistant"
    assert result.choices[0].message.content == tokenizer.decode(prompt_ids[:8])
    assert result.model == "alias" and result.id.startswith("chatcmpl-")
    assert result.usage.prompt_tokens == len(prompt_ids)


async def test_chat_stream_with_usage_and_token_ids(model_dir: str, tokenizer: Tokenizer) -> None:
    messages = [{"role": "user", "content": "tell me 😀"}]
    async with fake_gateway(model_dir, tokenizer) as gw:
        async with openai_client(gw.url) as client:
            stream = await client.chat.completions.create(
                model=model_dir, messages=messages, max_tokens=10, stream=True,
                stream_options={"include_usage": True}, extra_body={"return_token_ids": True},
            )
            chunks = [chunk async for chunk in stream]
    prompt_ids = encode(tokenizer, tokenizer.render_chat(messages))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert chunks[0].model_extra["prompt_token_ids"] == prompt_ids
    content = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert content == tokenizer.decode(prompt_ids[:10])
    token_ids = [
        t for c in chunks if c.choices for t in c.choices[0].model_extra.get("token_ids") or []
    ]
    assert token_ids == prompt_ids[:10]
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 10


async def test_chat_logprobs(model_dir: str, tokenizer: Tokenizer) -> None:
    async with fake_gateway(model_dir, tokenizer) as gw:
        async with openai_client(gw.url) as client:
            result = await client.chat.completions.create(
                model=model_dir, messages=[{"role": "user", "content": "é"}], max_tokens=4,
                logprobs=True, top_logprobs=2,
            )
    content = result.choices[0].logprobs.content
    ids = list(gw.scheduler.requests[0].prompt_token_ids[:4])
    assert [c.logprob for c in content] == [-0.125, -0.375, -0.625, -0.875]
    assert all(len(c.top_logprobs) == 2 for c in content)
    assert [c.token for c in content] == [tokenizer.decode([t], False) for t in ids]
    assert bytes(b for c in content for b in c.bytes) == tokenizer.decode(ids, False).encode()


async def test_chat_n_choices(model_dir: str, tokenizer: Tokenizer) -> None:
    async with fake_gateway(model_dir, tokenizer) as gw:
        async with openai_client(gw.url) as client:
            result = await client.chat.completions.create(
                model=model_dir, messages=[{"role": "user", "content": "hi"}], n=2, max_tokens=3
            )
            stream = await client.chat.completions.create(
                model=model_dir, messages=[{"role": "user", "content": "hi"}], n=2, max_tokens=3,
                stream=True,
            )
            chunks = [chunk async for chunk in stream]
    assert [c.index for c in result.choices] == [0, 1]
    assert result.choices[0].message.content == result.choices[1].message.content
    finished = {c.choices[0].index for c in chunks if c.choices[0].finish_reason}
    assert finished == {0, 1}


# -- stop conditions ----------------------------------------------------------------------------


STOP_TEXT = "The server answered each request, then it waited for the next."


@pytest.mark.parametrize("stream", [False, True])
async def test_stop_string_across_tokens(
    model_dir: str, tokenizer: Tokenizer, stream: bool
) -> None:
    output = encode(tokenizer, STOP_TEXT)
    stop = "ch req"  # spans the " each" / " request" token boundary
    assert not any(stop in tokenizer.decode([t]) for t in output)
    scheduler = FakeScheduler(output_ids=output)
    async with fake_gateway(model_dir, tokenizer, scheduler) as gw:
        async with http_client(gw.url) as http:
            body = {"prompt": "x", "max_tokens": 50, "stop": [stop, "never"], "stream": stream}
            response = await http.post("/v1/completions", json=body)
            await wait_for(lambda: gw.scheduler.aborted)
    if stream:
        chunks = [json.loads(e) for e in sse_events(response.text)[:-1]]
        texts = [c["choices"][0]["text"] for c in chunks]
        assert not any(stop in "".join(texts[: i + 1]) for i in range(len(texts)))
        choice = chunks[-1]["choices"][0]
        text = "".join(texts)
    else:
        choice = response.json()["choices"][0]
        text = choice["text"]
    assert text == STOP_TEXT[: STOP_TEXT.index(stop)]
    assert (choice["finish_reason"], choice["stop_reason"]) == ("stop", stop)
    assert gw.scheduler.aborted == [gw.scheduler.requests[0].request_id]


async def test_stop_string_included_in_output(model_dir: str, tokenizer: Tokenizer) -> None:
    scheduler = FakeScheduler(output_ids=encode(tokenizer, STOP_TEXT))
    async with fake_gateway(model_dir, tokenizer, scheduler) as gw:
        async with openai_client(gw.url) as client:
            result = await client.completions.create(
                model=model_dir, prompt="x", max_tokens=50, stop="request",
                extra_body={"include_stop_str_in_output": True},
            )
    assert result.choices[0].text == STOP_TEXT[: STOP_TEXT.index("request") + len("request")]


async def test_stop_token_ids_and_eos(model_dir: str, tokenizer: Tokenizer) -> None:
    words = encode(tokenizer, "one two three four")
    eos = tokenizer.eos_token_ids[0]
    scheduler = FakeScheduler(output_ids=[*words, eos])
    async with fake_gateway(model_dir, tokenizer, scheduler) as gw:
        async with http_client(gw.url) as http:
            body = {"prompt": "x", "max_tokens": 50, "return_token_ids": True}
            by_eos = (await http.post("/v1/completions", json=body)).json()["choices"][0]
            body["stop_token_ids"] = [words[2]]
            by_id = (await http.post("/v1/completions", json=body)).json()["choices"][0]
    assert by_eos["text"] == "one two three four" and by_eos["token_ids"] == [*words, eos]
    assert (by_eos["finish_reason"], by_eos["stop_reason"]) == ("stop", None)
    assert by_id["text"] == tokenizer.decode(words[:2]) and by_id["token_ids"] == words[:3]
    assert (by_id["finish_reason"], by_id["stop_reason"]) == ("stop", words[2])
    assert gw.scheduler.aborted == []  # the scheduler stopped these itself


# -- the other endpoints ------------------------------------------------------------------------


async def test_request_id_is_echoed_or_assigned(model_dir: str, tokenizer: Tokenizer) -> None:
    async with fake_gateway(model_dir, tokenizer) as gw:
        async with http_client(gw.url) as http:
            body = {"prompt": "hi", "max_tokens": 1}
            given = await http.post("/v1/completions", json=body, headers={"x-request-id": "abc"})
            assigned = await http.post("/v1/chat/completions", json={
                "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1})
            bad = await http.post("/v1/completions", json={}, headers={"x-request-id": "xyz"})
    assert given.headers["x-request-id"] == "abc" == given.json()["id"]
    # the client's id is echoed; the scheduler gets a unique one of the gateway's
    assert gw.scheduler.requests[0].request_id.startswith("cmpl-")
    assert assigned.headers["x-request-id"] == assigned.json()["id"]
    assert assigned.json()["id"].startswith("chatcmpl-")
    assert bad.status_code == 400 and bad.headers["x-request-id"] == "xyz"


async def test_models_tokenize_detokenize_openapi(model_dir: str, tokenizer: Tokenizer) -> None:
    async with fake_gateway(model_dir, tokenizer, served_model_name=("tiny", "alias")) as gw:
        async with openai_client(gw.url) as client:
            models = await client.models.list()
            async with http_client(gw.url) as http:
                tokens = (await http.post("/tokenize", json={
                    "model": "tiny", "prompt": "café 😀", "return_token_strs": True})).json()
                text = (await http.post("/detokenize", json={"tokens": tokens["tokens"]})).json()
                chat = (await http.post("/tokenize", json={"messages": CHAT_MESSAGES})).json()
                one = await http.get("/v1/models/alias")
                schema = await http.get("/openapi.json")
                health = await http.get("/health")
    assert [m.id for m in models.data] == ["tiny", "alias"]
    assert models.data[0].model_extra["max_model_len"] == gw.config.max_model_len
    assert tokens["count"] == len(tokens["tokens"]) and len(tokens["token_strs"]) == tokens["count"]
    assert tokens["max_model_len"] == gw.config.max_model_len
    assert text == {"prompt": "café 😀"}
    assert chat["tokens"] == encode(tokenizer, tokenizer.render_chat(CHAT_MESSAGES))
    assert one.json()["id"] == "alias"
    paths = schema.json()["paths"]
    for path in ("/v1/completions", "/v1/chat/completions", "/v1/models", "/tokenize", "/health"):
        assert path in paths
    assert health.status_code == 200


async def test_serve_runs_the_gateway(model_dir: str) -> None:
    """main.serve(): the process entry point, on a pre-bound socket, until cancelled."""
    server, address = await start_fake_scheduler(FakeScheduler())
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    config = GatewayConfig(model=model_dir, scheduler=address, port=port, max_model_len=64)
    task = asyncio.create_task(serve(config, log_level="warning", sock=sock))
    try:
        async with http_client(f"http://127.0.0.1:{port}") as http:
            async with asyncio.timeout(30):
                while True:
                    try:
                        if (await http.get("/health")).status_code == 200:
                            break
                    except httpx.TransportError:
                        await asyncio.sleep(0.05)
            response = await http.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2})
        assert response.status_code == 200
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
        sock.close()
        await server.stop(None)


async def test_sample_streams_close_one_sample_without_ending_the_others() -> None:
    """One Generate call carries a prompt's samples: a sample that stops early (a stop string,
    say) is aborted alone, and the call ends only when every sample's stream is done."""
    fake = FakeScheduler(output_ids=[5, 6, 7], delay_s=0.01)
    server, address = await start_fake_scheduler(fake)
    client = SchedulerClient.connect(address)
    request = scheduler_pb2.GenerateRequest(
        request_id="g", sample_ids=["g-1", "g-2"], prompt_token_ids=[1, 2],
        sampling=scheduler_pb2.SamplingParams(max_tokens=6, ignore_eos=True, logprobs=-1),
    )
    try:
        source = SampleStreams(client, request)
        streams = [source.stream(j) for j in range(3)]
        first = await anext(streams[1])
        assert first.sample == 1 and list(first.token_ids) == [5]
        await streams[1].aclose()
        await client.abort("g-1")
        tokens = [[t async for r in streams[j] for t in r.token_ids] for j in (0, 2)]
        assert tokens == [[5, 6, 7, 5, 6, 7]] * 2
        assert fake.aborted == ["g-1"] and fake.finished == ["g", "g-2"]
        assert fake.cancelled == []

        request.request_id, request.sample_ids[:] = "h", ["h-1", "h-2"]
        source = SampleStreams(client, request)  # every stream closed early: the call ends
        streams = [source.stream(j) for j in range(3)]
        for stream in streams:
            await anext(stream)
            await stream.aclose()
        async with asyncio.timeout(10):
            while len(fake.cancelled) < 3:
                await asyncio.sleep(0.01)
        assert sorted(fake.cancelled) == ["h", "h-1", "h-2"]
    finally:
        await client.close()
        await server.stop(None)


async def test_negative_seeds_wrap_to_the_unsigned_field(model_dir: str,
                                                         tokenizer: Tokenizer) -> None:
    async with fake_gateway(model_dir, tokenizer) as gw:
        async with http_client(gw.url) as http:
            body = {"prompt": "hi", "max_tokens": 1, "seed": -1, "n": 2}
            response = await http.post("/v1/completions", json=body)
    assert response.status_code == 200, response.text
    assert [r.sampling.seed for r in gw.scheduler.requests] == [2**64 - 1, 0]


def _request(rid: str, max_tokens: int = 4) -> scheduler_pb2.GenerateRequest:
    return scheduler_pb2.GenerateRequest(
        request_id=rid, prompt_token_ids=[1, 2],
        sampling=scheduler_pb2.SamplingParams(max_tokens=max_tokens, ignore_eos=True,
                                              logprobs=-1))


async def test_requests_share_one_session_and_a_scheduler_without_one_gets_generate_calls(
) -> None:
    """Against a scheduler that serves Session, every request goes on the one stream; one
    that does not (UNIMPLEMENTED: a scheduler older than the gateway) gets a Generate call per
    request, the same responses."""
    fake = FakeScheduler(output_ids=[5, 6, 7])
    server, address = await start_fake_scheduler(fake)
    client = SchedulerClient.connect(address)
    try:
        tokens = [[t async for r in client.generate(_request(f"a{i}")) for t in r.token_ids]
                  for i in range(2)]
        assert tokens == [[5, 6, 7, 5]] * 2 and client.sessions
    finally:
        await client.close()
        await server.stop(None)

    old = FakeScheduler(output_ids=[5, 6, 7])
    server = grpc.aio.server()
    server.add_generic_rpc_handlers([grpc.method_handlers_generic_handler(
        "pdserve.scheduler.Scheduler", {"Generate": grpc.unary_stream_rpc_method_handler(
            old.Generate, request_deserializer=scheduler_pb2.GenerateRequest.FromString,
            response_serializer=scheduler_pb2.GenerateResponse.SerializeToString)})])
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    client = SchedulerClient.connect(f"127.0.0.1:{port}")
    try:
        tokens = [[t async for r in client.generate(_request(f"b{i}")) for t in r.token_ids]
                  for i in range(2)]
        assert tokens == [[5, 6, 7, 5]] * 2 and not client.sessions
        assert [r.request_id for r in old.requests] == ["b0", "b1"]
    finally:
        await client.close()
        await server.stop(None)


async def test_a_request_past_its_deadline_fails_and_is_aborted_its_session_goes_on() -> None:
    fake = FakeScheduler(output_ids=[5], delay_s=0.3)
    server, address = await start_fake_scheduler(fake)
    client = SchedulerClient.connect(address, request_timeout_s=0.5)
    try:
        with pytest.raises(grpc.aio.AioRpcError) as err:
            async for _ in client.generate(_request("slow", max_tokens=100)):
                pass
        assert err.value.code() is grpc.StatusCode.DEADLINE_EXCEEDED
        await wait_for(lambda: fake.cancelled == ["slow"])
        tokens = [t async for r in client.generate(_request("quick", max_tokens=1))
                  for t in r.token_ids]
        assert tokens == [5] and fake.finished == ["quick"]
    finally:
        await client.close()
        await server.stop(None)


async def test_a_lost_session_fails_each_open_request_and_the_next_opens_another() -> None:
    fake = FakeScheduler(output_ids=[5], delay_s=0.05)
    server, address = await start_fake_scheduler(fake)
    client = SchedulerClient.connect(address)
    try:
        streams = [client.generate(_request(f"c{i}", max_tokens=1000)) for i in range(2)]
        for stream in streams:
            await anext(stream)
        await server.stop(None)  # the scheduler goes: both are lost, as a Generate call was
        for stream in streams:
            with pytest.raises(grpc.aio.AioRpcError) as err:
                async for _ in stream:
                    pass
            assert err.value.code() in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.CANCELLED)
        server, _ = await start_fake_scheduler(fake, port=int(address.rsplit(":", 1)[1]))
        tokens = [t async for r in client.generate(_request("d", max_tokens=2))
                  for t in r.token_ids]
        assert tokens == [5, 5]
    finally:
        await client.close()
        await server.stop(None)


class _EndsItsFirstSessions(FakeScheduler):
    """Ends each of its first `sessions` Session streams, UNAVAILABLE as a scheduler that goes,
    once it read one message: the gateway is still writing its other requests to it."""

    def __init__(self, sessions: int, **kwargs) -> None:
        super().__init__(**kwargs)
        self.to_end = sessions

    async def Session(self, request_iterator, context):
        if self.to_end > 0:
            self.to_end -= 1
            async for _ in request_iterator:
                break
            await context.abort(grpc.StatusCode.UNAVAILABLE, "the scheduler goes")
        async for message in super().Session(request_iterator, context):
            yield message


async def test_a_session_that_ends_under_the_gateways_writes_is_lost_not_an_internal_error(
) -> None:
    """gRPC reports a call whose write failed as the call ended as INTERNAL "Internal error from
    Core", dropping the call's own status (grpc/grpc issue 36066): a scheduler killed while the
    gateway wrote to its session turned streams into 500s instead of resubmitting them. Each of
    20 sessions ends under 40 requests' writes; every request is lost (UNAVAILABLE), and
    through SampleStreams, which resubmits what is lost, each request's stream goes on."""
    fake = _EndsItsFirstSessions(20, output_ids=[5, 6])
    server, address = await start_fake_scheduler(fake)
    client = SchedulerClient.connect(address, recovery_s=30.0)

    async def code(rid: str) -> grpc.StatusCode:
        with pytest.raises(grpc.aio.AioRpcError) as err:
            async for _ in client.generate(_request(rid)):
                pass
        return err.value.code()

    async def tokens(rid: str) -> list[int]:
        streams = SampleStreams(client, _request(rid, max_tokens=3))
        return [t async for r in streams.stream(0) for t in r.token_ids]
    try:
        for k in range(10):
            codes = await asyncio.gather(*(code(f"e{k}.{i}") for i in range(40)))
            assert set(codes) == {grpc.StatusCode.UNAVAILABLE}
        # ten sessions left to end: the streams ride through them
        assert await asyncio.gather(*(tokens(f"f{i}") for i in range(40))) == [[5, 6, 5]] * 40
        assert fake.to_end == 0
    finally:
        await client.close()
        await server.stop(None)


async def test_close_ends_the_session_before_it_returns() -> None:
    """close() closes the session's side and reads the stream to the scheduler's end of it,
    rather than cancelling it: a cancelled call's last completions come later, from gRPC's
    poller thread, and after the event loop closed they fail the next loop of the process
    (RuntimeError: Event loop is closed). The scheduler stops what still ran."""
    fake = FakeScheduler(output_ids=[5], delay_s=0.05)
    server, address = await start_fake_scheduler(fake)
    client = SchedulerClient.connect(address)
    try:
        stream = client.generate(_request("long", max_tokens=1000))
        await anext(stream)
        await client.close()
        assert fake.sessions_closed == 1
        await wait_for(lambda: fake.cancelled == ["long"])
        with pytest.raises(grpc.aio.AioRpcError):  # its session is gone
            await anext(stream)
    finally:
        await server.stop(None)


async def test_a_refused_request_fails_with_its_status_and_nothing_is_aborted() -> None:
    fake = FakeScheduler(output_ids=[5])
    fake.fail_with = (grpc.StatusCode.RESOURCE_EXHAUSTED, "queue full")
    server, address = await start_fake_scheduler(fake)
    client = SchedulerClient.connect(address)
    try:
        with pytest.raises(grpc.aio.AioRpcError) as err:
            async for _ in client.generate(_request("e")):
                pass
        assert (err.value.code(), err.value.details()) == (
            grpc.StatusCode.RESOURCE_EXHAUSTED, "queue full")
        fake.fail_with = None  # the session goes on
        assert [t async for r in client.generate(_request("f", 1)) for t in r.token_ids] == [5]
        assert fake.cancelled == [] and fake.aborted == []
    finally:
        await client.close()
        await server.stop(None)
