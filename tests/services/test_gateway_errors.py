"""Gateway failure paths: bad input, auth, scheduler errors, deadlines, clients that go away.

Every error is an OpenAI-style body {"error": {message, type, param, code}} with the right
status, never a 500 for bad input; a client that disconnects gets its scheduler request aborted.
"""

from __future__ import annotations

import asyncio
import json
import re
import shutil
import socket

import grpc
import httpx
import openai
import pytest

from services.gateway.tokenizer import Tokenizer
from tests.services.fake_scheduler import (
    FakeScheduler,
    fake_gateway,
    http_client,
    openai_client,
    wait_for,
)

pytestmark = pytest.mark.anyio


CHAT = {"messages": [{"role": "user", "content": "hi"}]}


def assert_error(response: httpx.Response, status: int, param: str | None = None) -> dict:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert isinstance(error["message"], str) and error["message"]
    if param is not None:
        assert error["param"] == param
    return error


def dead_address() -> str:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return f"127.0.0.1:{sock.getsockname()[1]}"


# -- bad input ----------------------------------------------------------------------------------


BAD_COMPLETIONS = [
    ({"prompt": "x", "temperature": -1}, "temperature"),
    ({"prompt": "x", "top_p": 0}, "top_p"),
    ({"prompt": "x", "top_p": 1.5}, "top_p"),
    ({"prompt": "x", "n": 0}, "n"),
    ({"prompt": "x", "max_tokens": 0}, "max_tokens"),
    ({"prompt": "x", "logprobs": 21}, "logprobs"),
    ({"prompt": "x", "top_k": -2}, "top_k"),
    ({"prompt": "x", "min_p": 2}, "min_p"),
    ({"prompt": "x", "presence_penalty": 3}, "presence_penalty"),
    ({"prompt": "x", "max_tokens": 2, "min_tokens": 3}, None),
    ({"prompt": "x", "stream_options": {"include_usage": True}}, None),
    ({"prompt": "x", "suffix": "y"}, "suffix"),
    ({"prompt": "x", "prompt_logprobs": 21}, "prompt_logprobs"),
    ({"prompt": "x", "prompt_logprobs": -1}, "prompt_logprobs"),
    ({"prompt": "x", "prompt_logprobs": 1, "stream": True}, "prompt_logprobs"),
    ({"prompt": "x", "logit_bias": {"five": 1.0}}, "logit_bias"),
    ({"prompt": "x", "logit_bias": {"-1": 1.0}}, "logit_bias"),
    ({"prompt": "x", "logit_bias": {"5": 100.5}}, "logit_bias"),
    ({"prompt": "x", "logit_bias": {"5": -101}}, "logit_bias"),
    ({"prompt": "x", "logit_bias": {"5": "up"}}, "logit_bias"),
    ({"prompt": "x", "logit_bias": {"5": 1.0, "1000000000": 1.0}}, "logit_bias"),
    ({"prompt": "x", "temperature": "hot"}, "temperature"),
    ({"prompt": 5}, "prompt"),
    ({"prompt": [1, "a"]}, "prompt"),
    ({"prompt": []}, "prompt"),
    ({"prompt": ""}, "prompt"),
    ({}, "prompt"),
    ({"prompt": [10**9]}, "prompt"),
    ({"prompt": [-1]}, "prompt"),
    ({"prompt": "x", "max_tokens": 10**6}, "max_tokens"),
    # integers past what the scheduler's int32 fields carry, or past the context
    ({"prompt": "x", "max_tokens": 2**31}, "max_tokens"),
    ({"prompt": "x", "top_k": 2**31}, "top_k"),
    ({"prompt": "x", "min_tokens": 2**31}, "min_tokens"),
    ({"prompt": "x", "min_tokens": 10**6}, "min_tokens"),
    ({"prompt": "x", "stop_token_ids": [600835554523665]}, "stop_token_ids"),
    ({"prompt": "x", "stop_token_ids": [-1]}, "stop_token_ids"),
    ({"prompt": "x", "priority": 2**31}, "priority"),
    ({"prompt": "x", "seed": 2**63}, "seed"),
    ({"prompt": "x", "best_of": 0}, "best_of"),
    ({"prompt": "x", "best_of": 2**40}, "best_of"),
]


async def test_bad_completion_requests_are_400(model_dir: str, tokenizer: Tokenizer) -> None:
    async with fake_gateway(model_dir, tokenizer) as gw:
        async with http_client(gw.url) as http:
            for body, param in BAD_COMPLETIONS:
                response = await http.post("/v1/completions", json=body)
                assert_error(response, 400, param)
            invalid_json = await http.post(
                "/v1/completions", content=b'{"prompt": ',
                headers={"content-type": "application/json"},
            )
            assert_error(invalid_json, 400)
            not_an_object = await http.post("/v1/completions", json=["prompt"])
            assert_error(not_an_object, 400)
    assert gw.scheduler.requests == []


SURROGATES = [  # JSON escapes of lone UTF-16 surrogates, in keys and values of every route
    ("/tokenize", b'{"prompt": "a\\ud800b"}'),
    ("/tokenize", b'{"\\udc00": 1, "prompt": "x"}'),
    ("/tokenize", b'{"messages": [{"role": "user", "content": "\\udbff"}]}'),
    ("/detokenize", b'{"tokens": [1], "model": "\\ud800"}'),
    ("/v1/completions", b'{"prompt": "\\ud83d", "max_tokens": 1}'),
    ("/v1/completions", b'{"prompt": "x", "stop": ["\\ude00\\ud83d"], "max_tokens": 1}'),
    ("/v1/completions", b'{"prompt": "x", "model": "\\ud800", "max_tokens": 1}'),
    ("/v1/chat/completions", b'{"messages": [{"role": "user", "content": "\\ud800"}]}'),
]


async def test_unpaired_surrogates_are_400_and_pairs_pass(model_dir: str,
                                                          tokenizer: Tokenizer) -> None:
    json_type = {"content-type": "application/json"}
    async with fake_gateway(model_dir, tokenizer) as gw:
        async with http_client(gw.url) as http:
            for path, body in SURROGATES:
                error = assert_error(await http.post(path, content=body, headers=json_type), 400)
                assert "surrogate" in error["message"], (path, body)
            paired = b'{"prompt": "smile \\ud83d\\ude00", "max_tokens": 1}'  # one code point
            ok = await http.post("/v1/completions", content=paired, headers=json_type)
            assert ok.status_code == 200, ok.text
            tokenized = await http.post("/tokenize", content=paired.replace(b', "max_tokens": 1',
                                                                            b""), headers=json_type)
            assert tokenized.status_code == 200, tokenized.text
    assert len(gw.scheduler.requests) == 1  # only the paired one


async def test_a_body_over_the_limit_is_413_unread(model_dir: str, tokenizer: Tokenizer) -> None:
    limit = 4096
    async with fake_gateway(model_dir, tokenizer, max_request_body_bytes=limit) as gw:
        async with http_client(gw.url) as http:
            big = {"prompt": "x" * limit, "max_tokens": 1}
            error = assert_error(await http.post("/v1/completions", json=big), 413)
            assert str(limit) in error["message"]

            async def chunked():  # no content-length: counted as it arrives
                for _ in range(8):
                    yield b" " * 1024
            streamed = await http.post("/v1/completions", content=chunked(),
                                       headers={"content-type": "application/json"})
            assert_error(streamed, 413)
            small = await http.post("/v1/completions", json={"prompt": "x", "max_tokens": 1})
            assert small.status_code == 200, small.text  # and it goes on serving
    assert len(gw.scheduler.requests) == 1


BAD_CHATS = [
    {"messages": []},
    {"messages": [{"content": "no role"}]},
    {**CHAT, "top_logprobs": 2},
    {**CHAT, "logprobs": True, "top_logprobs": 21},
    {**CHAT, "tools": [{"type": "function", "function": {"name": "f"}}]},
    {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]},
    {**CHAT, "max_completion_tokens": 0},
    {**CHAT, "logit_bias": {"1000000000": -100}},
    {**CHAT, "logit_bias": {"5": 1e9}},
    {**CHAT, "add_generation_prompt": True, "continue_final_message": True},
]


async def test_bad_chat_requests_are_400(model_dir: str, tokenizer: Tokenizer) -> None:
    async with fake_gateway(model_dir, tokenizer) as gw:
        async with http_client(gw.url) as http:
            for body in BAD_CHATS:
                assert_error(await http.post("/v1/chat/completions", json=body), 400)
            parts = {"messages": [{"role": "user", "content": [{"type": "text", "text": "hi"}]}],
                     "max_tokens": 1}
            assert (await http.post("/v1/chat/completions", json=parts)).status_code == 200


async def test_prompt_too_long_is_400(model_dir: str, tokenizer: Tokenizer) -> None:
    async with fake_gateway(model_dir, tokenizer, max_model_len=16) as gw:
        async with http_client(gw.url) as http:
            long = await http.post("/v1/completions", json={"prompt": list(range(16))})
            ten = list(range(10))
            room = await http.post("/v1/completions", json={"prompt": ten, "max_tokens": 7})
            fits = await http.post("/v1/completions", json={"prompt": ten, "max_tokens": 6})
            chat = await http.post("/v1/chat/completions", json={
                "messages": [{"role": "user", "content": "a long message " * 10}]})
    assert "maximum context length is 16" in assert_error(long, 400, "prompt")["message"]
    assert_error(room, 400, "max_tokens")
    assert fits.status_code == 200
    assert_error(chat, 400, "messages")


async def test_unknown_model_is_404(model_dir: str, tokenizer: Tokenizer) -> None:
    async with fake_gateway(model_dir, tokenizer, served_model_name=("tiny",)) as gw:
        async with http_client(gw.url) as http:
            response = await http.post("/v1/completions", json={"model": "gpt-9", "prompt": "x"})
            unknown_route = await http.get("/v1/nothing")
        async with openai_client(gw.url, "x") as client:
            with pytest.raises(openai.NotFoundError):
                await client.chat.completions.create(model=model_dir, messages=CHAT["messages"])
    error = assert_error(response, 404, "model")
    assert error["message"] == "The model `gpt-9` does not exist."
    assert error["code"] == "model_not_found"
    assert_error(unknown_route, 404)


async def test_api_key(model_dir: str, tokenizer: Tokenizer) -> None:
    body = {"prompt": "x", "max_tokens": 1}
    async with fake_gateway(model_dir, tokenizer, api_key="secret") as gw:
        async with http_client(gw.url) as http:
            missing = await http.post("/v1/completions", json=body)
            wrong = await http.post(
                "/v1/completions", json=body, headers={"Authorization": "Bearer no"}
            )
            invalid_body = await http.post("/v1/completions", json={})
            models = await http.get("/v1/models")
            tokenize = await http.post("/tokenize", json={"prompt": "x"})
            health = await http.get("/health")
        async with openai_client(gw.url, "secret") as client:
            ok = await client.completions.create(model=model_dir, **body)
    for response in (missing, wrong, invalid_body, models, tokenize):
        assert_error(response, 401)
    assert health.status_code == 200
    assert ok.choices[0].finish_reason == "length"


# -- scheduler failures -------------------------------------------------------------------------


async def test_scheduler_unavailable_is_503(model_dir: str, tokenizer: Tokenizer) -> None:
    async with fake_gateway(
        model_dir, tokenizer, scheduler_address=dead_address(), connect_timeout_s=0.3,
        no_worker_wait_s=0.3,
    ) as gw:
        async with http_client(gw.url) as http:
            completion = await http.post("/v1/completions", json={"prompt": "x"})
            streamed = await http.post("/v1/completions", json={"prompt": "x", "stream": True})
            ready = await http.get("/ready")
            health = await http.get("/health")
    for response in (completion, streamed, ready):
        error = assert_error(response, 503)
        assert error["code"] == "scheduler_unavailable", error
        assert response.headers["retry-after"] == "1"
    assert health.status_code == 200  # liveness: the gateway itself is up


@pytest.mark.parametrize(
    ("code", "status"),
    [
        (grpc.StatusCode.RESOURCE_EXHAUSTED, 429),
        (grpc.StatusCode.INVALID_ARGUMENT, 400),
        (grpc.StatusCode.UNAVAILABLE, 503),
        (grpc.StatusCode.INTERNAL, 500),
    ],
)
async def test_scheduler_status_codes(
    model_dir: str, tokenizer: Tokenizer, code: grpc.StatusCode, status: int
) -> None:
    scheduler = FakeScheduler()
    scheduler.fail_with = (code, "scheduler says no")
    async with fake_gateway(model_dir, tokenizer, scheduler) as gw:
        async with http_client(gw.url) as http:
            plain = await http.post("/v1/completions", json={"prompt": "x"})
            # A stream fails before its first token, so it keeps the status too.
            streamed = await http.post("/v1/chat/completions", json={**CHAT, "stream": True})
    for response in (plain, streamed):
        error = assert_error(response, status)
        assert "scheduler says no" in error["message"]
        if status in (429, 503):
            assert response.headers["retry-after"] == "1"


async def test_deadline_exceeded_is_504(model_dir: str, tokenizer: Tokenizer) -> None:
    # a token a second against a 3 s deadline: the first arrives in time on a busy machine too
    scheduler = FakeScheduler(delay_s=1.0)
    async with fake_gateway(model_dir, tokenizer, scheduler, request_timeout_s=3.0) as gw:
        async with http_client(gw.url) as http:
            plain = await http.post("/v1/completions", json={"prompt": "x", "max_tokens": 20})
            streamed = await http.post(
                "/v1/completions", json={"prompt": "x", "max_tokens": 20, "stream": True}
            )
            await wait_for(lambda: len(gw.scheduler.aborted) == 2)
    assert assert_error(plain, 504)["code"] == "deadline_exceeded"
    assert streamed.status_code == 200  # the first token came in time
    events = [e for e in streamed.text.split("\n\n") if e]
    assert events[-1] == "data: [DONE]"
    assert json.loads(events[-2].removeprefix("data: "))["error"]["code"] == "deadline_exceeded"


async def test_error_in_a_started_stream_is_an_sse_event(
    model_dir: str, tokenizer: Tokenizer
) -> None:
    scheduler = FakeScheduler()
    scheduler.finish_with_error = "worker lost"
    async with fake_gateway(model_dir, tokenizer, scheduler) as gw:
        async with http_client(gw.url) as http:
            plain = await http.post("/v1/completions", json={"prompt": "x y z", "max_tokens": 3})
            streamed = await http.post(
                "/v1/chat/completions", json={**CHAT, "max_tokens": 3, "stream": True}
            )
    assert "worker lost" in assert_error(plain, 500)["message"]
    events = [e.removeprefix("data: ") for e in streamed.text.split("\n\n") if e]
    assert events[-1] == "[DONE]"
    assert json.loads(events[-2])["error"]["message"] == "worker lost"
    assert json.loads(events[0])["choices"][0]["delta"]["role"] == "assistant"


# -- clients that go away -----------------------------------------------------------------------


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
async def test_disconnect_mid_stream_aborts(
    model_dir: str, tokenizer: Tokenizer, path: str
) -> None:
    scheduler = FakeScheduler(delay_s=0.02)
    body = {"prompt": "x", **CHAT, "max_tokens": 1000, "stream": True}
    async with fake_gateway(model_dir, tokenizer, scheduler, max_model_len=2048) as gw:
        async with http_client(gw.url) as http:
            async with http.stream("POST", path, json=body, headers={"x-request-id": "gone"}) as r:
                assert r.status_code == 200
                events = 0
                async for line in r.aiter_lines():
                    events += line.startswith("data: ")
                    if events == 3:
                        break
            sent = gw.scheduler.requests[0].request_id  # the scheduler's id, not "gone"
            await wait_for(lambda: sent in gw.scheduler.aborted)
            await wait_for(lambda: sent in gw.scheduler.cancelled)
    assert sent not in gw.scheduler.finished


@pytest.mark.parametrize("stream", [False, True])
async def test_disconnect_while_waiting_aborts(
    model_dir: str, tokenizer: Tokenizer, stream: bool
) -> None:
    """Before any byte of the response: the JSON case, and a stream still waiting for its first
    token (the gateway holds the status line until then)."""
    scheduler = FakeScheduler(delay_s=5.0)
    body = {"prompt": "x", "max_tokens": 1000, "n": 2, "stream": stream}
    async with fake_gateway(model_dir, tokenizer, scheduler, max_model_len=2048) as gw:
        async with httpx.AsyncClient(base_url=gw.url, timeout=30) as http:
            post = asyncio.create_task(
                http.post("/v1/completions", json=body, headers={"x-request-id": "bye"}))
            # both choices reached the scheduler, nothing came back yet: now the client leaves
            await wait_for(lambda: len(gw.scheduler.requests) == 2)
            post.cancel()
            with pytest.raises(asyncio.CancelledError):
                await post
            sent = sorted(r.request_id for r in gw.scheduler.requests)
            assert [i.rsplit("-", 1)[1] for i in sent] == ["0", "1"]
            await wait_for(lambda: sorted(gw.scheduler.aborted) == sent)
            await wait_for(lambda: len(gw.scheduler.cancelled) == 2)
    assert gw.scheduler.finished == []


# -- chat templates -----------------------------------------------------------------------------


@pytest.fixture(scope="module")
def strict_template_dir(model_dir: str, tmp_path_factory: pytest.TempPathFactory) -> str:
    """The tiny model with a template that rejects a conversation opening with the assistant."""
    out = tmp_path_factory.mktemp("strict")
    shutil.copytree(model_dir, out, dirs_exist_ok=True)
    config_path = out / "tokenizer_config.json"
    config = json.loads(config_path.read_text())
    config["chat_template"] = (
        "{% if messages[0]['role'] == 'assistant' %}"
        "{{ raise_exception('Conversation must start with a user message') }}{% endif %}"
        + config["chat_template"]
    )
    config_path.write_text(json.dumps(config))
    return str(out)


async def test_chat_template_errors_are_400(strict_template_dir: str) -> None:
    bad = {"messages": [{"role": "assistant", "content": "hi"}]}
    async with fake_gateway(strict_template_dir) as gw:
        async with http_client(gw.url) as http:
            response = await http.post("/v1/chat/completions", json=bad)
            good = await http.post("/v1/chat/completions", json={**CHAT, "max_tokens": 1})
    assert "must start with a user message" in assert_error(response, 400, "messages")["message"]
    assert good.status_code == 200


async def test_no_chat_template_is_400(
    model_dir: str, tmp_path_factory: pytest.TempPathFactory
) -> None:
    out = tmp_path_factory.mktemp("plain")
    shutil.copytree(model_dir, out, dirs_exist_ok=True)
    config = json.loads((out / "tokenizer_config.json").read_text())
    del config["chat_template"]
    (out / "tokenizer_config.json").write_text(json.dumps(config))
    async with fake_gateway(str(out)) as gw:
        async with http_client(gw.url) as http:
            response = await http.post("/v1/chat/completions", json=CHAT)
            completion = await http.post("/v1/completions", json={"prompt": "x", "max_tokens": 1})
    assert "no chat template" in assert_error(response, 400)["message"]
    assert completion.status_code == 200


# -- overload: stalled readers, one key's share -------------------------------------------------


def _stalled_reader(url: str, body: dict) -> socket.socket:
    """A client that posts a completion and reads nothing of its answer, with a receive
    buffer as small as the kernel allows."""
    host, port = url.removeprefix("http://").split(":")
    stalled = socket.socket()
    stalled.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    stalled.connect((host, int(port)))
    payload = json.dumps(body).encode()
    stalled.sendall(b"POST /v1/completions HTTP/1.1\r\nhost: x\r\ncontent-type: "
                    b"application/json\r\ncontent-length: %d\r\n\r\n%s"
                    % (len(payload), payload))
    return stalled


async def test_a_stalled_reader_is_cut_off_and_others_stream_on(model_dir: str,
                                                                tokenizer: Tokenizer) -> None:
    """A client that sends a streaming request and then reads nothing: once the socket buffers
    are full its stream ends within --stream-write-timeout and its request is aborted on the
    scheduler (its blocks freed); a stream beside it runs to its end meanwhile."""
    scheduler = FakeScheduler(tokens_per_message=8, delay_s=0.02)  # 10 s of tokens
    big = {"prompt": "x", "max_tokens": 4000, "n": 4, "logprobs": 20, "stream": True,
           "ignore_eos": True}
    async with fake_gateway(model_dir, tokenizer, scheduler, max_model_len=4096,
                            stream_write_timeout_s=1.0) as gw:
        stalled = _stalled_reader(gw.url, big)
        try:
            await wait_for(lambda: gw.scheduler.requests, 15)
            sent = gw.scheduler.requests[0].request_id
            async with http_client(gw.url) as http:
                other = await http.post("/v1/completions", json={
                    "prompt": "x y", "max_tokens": 40, "stream": True})
            assert other.status_code == 200 and other.text.endswith("data: [DONE]\n\n")
            await wait_for(lambda: sent in gw.scheduler.aborted or sent in gw.scheduler.cancelled,
                           30)
            assert sent not in gw.scheduler.finished
        finally:
            stalled.close()


async def test_a_stalled_reader_of_a_whole_response_is_cut_off(model_dir: str,
                                                              tokenizer: Tokenizer) -> None:
    """Not streamed: a client that reads nothing of a response larger than the socket buffers
    holds its connection only until --stream-write-timeout; what it reads afterwards ends short
    of the declared length (the server dropped the connection) while other requests are served
    meanwhile."""
    scheduler = FakeScheduler(tokens_per_message=64)  # ~8 MB: past the kernel's buffers (4 MB)
    big = {"prompt": "x", "max_tokens": 4000, "n": 8, "logprobs": 20, "ignore_eos": True}
    async with fake_gateway(model_dir, tokenizer, scheduler, max_model_len=4096,
                            stream_write_timeout_s=1.0) as gw:
        stalled = _stalled_reader(gw.url, big)
        try:
            await wait_for(lambda: gw.scheduler.finished, 15)
            async with http_client(gw.url) as http:
                other = await http.post("/v1/completions", json={"prompt": "x y", "max_tokens": 4})
            assert other.status_code == 200
            await asyncio.sleep(3.0)  # the write timeout, and then some
            stalled.settimeout(10)
            received = b""
            while chunk := await asyncio.to_thread(stalled.recv, 1 << 20):
                received += chunk
        finally:
            stalled.close()
        head, _, body = received.partition(b"\r\n\r\n")
        assert head.startswith(b"HTTP/1.1 200")
        declared = int(next(line.split(b":")[1] for line in head.split(b"\r\n")
                            if line.lower().startswith(b"content-length")))
        assert declared > 6 << 20 and len(body) < declared


async def test_a_body_that_does_not_arrive_in_time_gets_408(model_dir: str,
                                                           tokenizer: Tokenizer) -> None:
    """A client that declares a body and sends part of it (slowloris) gets 408 after
    --request-body-timeout; nothing reaches the scheduler; a whole body beside it is served."""
    scheduler = FakeScheduler()
    async with fake_gateway(model_dir, tokenizer, scheduler, request_body_timeout_s=1.0) as gw:
        host, port = gw.url.removeprefix("http://").split(":")
        with socket.create_connection((host, int(port)), timeout=10) as slow:
            slow.sendall(b"POST /v1/completions HTTP/1.1\r\nhost: x\r\ncontent-type: "
                         b"application/json\r\ncontent-length: 100\r\n\r\n{\"prompt\": ")
            async with http_client(gw.url) as http:
                other = await http.post("/v1/completions", json={"prompt": "x", "max_tokens": 2})
            assert other.status_code == 200
            answer = await asyncio.to_thread(_whole_response, slow)
        head, _, body = answer.partition(b"\r\n\r\n")
        assert head.startswith(b"HTTP/1.1 408"), answer
        assert b"--request-body-timeout" in body
        assert len(scheduler.requests) == 1  # the other request's only


def _whole_response(sock: socket.socket) -> bytes:
    """An HTTP response read up to its Content-Length (head and body may come apart)."""
    data = b""
    while b"\r\n\r\n" not in data or len(data.partition(b"\r\n\r\n")[2]) < int(
            re.search(rb"content-length: *(\d+)", data, re.I).group(1)):
        chunk = sock.recv(65536)
        if not chunk:
            break
        data += chunk
    return data


async def test_one_key_may_hold_only_its_share(model_dir: str, tokenizer: Tokenizer) -> None:
    scheduler = FakeScheduler(delay_s=0.05)
    slow = {"prompt": "x", "max_tokens": 200, "stream": True}

    def key(k: str) -> dict[str, str]:
        return {"authorization": f"Bearer {k}"}

    async with fake_gateway(model_dir, tokenizer, scheduler, max_model_len=2048,
                            max_concurrent_requests_per_key=2) as gw:
        async with http_client(gw.url) as http:
            async with http.stream("POST", "/v1/completions", json=slow, headers=key("a")) as r1, \
                    http.stream("POST", "/v1/completions", json=slow, headers=key("a")) as r2:
                assert (r1.status_code, r2.status_code) == (200, 200)
                third = await http.post("/v1/completions", json={"prompt": "x"},
                                        headers=key("a"))
                error = assert_error(third, 429)
                assert error["code"] == "concurrency_limit_exceeded"
                assert third.headers["retry-after"] == "1"
                other = await http.post("/v1/completions", json={"prompt": "x", "max_tokens": 2},
                                        headers=key("b"))
                assert other.status_code == 200, other.text  # another key has its own share
            # both streams ended (closed early): the slots are back
            await wait_for(lambda: not gw.app.state.ctx.in_flight.counts, 10)
            again = await http.post("/v1/completions", json={"prompt": "x", "max_tokens": 2},
                                    headers=key("a"))
            assert again.status_code == 200, again.text


async def test_tokenize_refuses_what_chat_refuses(model_dir: str, tokenizer: Tokenizer) -> None:
    """Messages the chat template cannot take are a 400 on /tokenize too (the fuzzer found a
    500 there): unsupported content parts, tool call arguments that are not JSON."""
    bad_messages = [
        [{"role": "user", "content": [{"type": ""}]}],
        [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}],
        [{"role": "assistant", "tool_calls": [
            {"id": "c", "type": "function", "function": {"name": "f", "arguments": "{"}}]}],
    ]
    async with fake_gateway(model_dir, tokenizer) as gw:
        async with http_client(gw.url) as http:
            for messages in bad_messages:
                assert_error(await http.post("/tokenize", json={"messages": messages}), 400)
                assert_error(await http.post("/v1/chat/completions",
                                             json={"messages": messages}), 400)
