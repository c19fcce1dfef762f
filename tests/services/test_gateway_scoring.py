"""The completions API's scoring and steering fields against the fake scheduler: echo with
logprobs (the prompt's tokens first), vLLM's prompt_logprobs, logit_bias reaching the scheduler,
stream_options.continuous_usage_stats, and the 400s for what cannot be honoured.

The fake scheduler scores prompt token i >= 1 at -i/8 with rank i, its top k being token 7 at
-1/16 then the token itself (fake_prompt_logprobs); generated token k at -0.25 * (k % 4) - 0.125.
"""

from __future__ import annotations

import json

import httpx
import pytest

from services.gateway.detokenizer import REPLACEMENT_CHAR
from services.gateway.tokenizer import Tokenizer
from tests.services.fake_scheduler import fake_gateway, http_client, openai_client
from tests.services.test_gateway import encode, sse_events

pytestmark = pytest.mark.anyio

GENERATED_LOGPROBS = [-0.125, -0.375, -0.625]


def check_offsets(text: str, offsets: list[int], ids: list[int], tokenizer: Tokenizer,
                  skip_special_tokens: bool = True) -> None:
    """offsets[i] is where token i's text starts in `text`: the text before it is the decode
    of the tokens before it, wherever that decode ends on a whole character."""
    assert offsets == sorted(offsets) and offsets[0] == 0 and offsets[-1] <= len(text)
    for i, offset in enumerate(offsets):
        before = tokenizer.decode(ids[:i], skip_special_tokens=skip_special_tokens)
        if REPLACEMENT_CHAR not in before:
            assert text[:offset] == before, i


async def test_echo_with_logprobs_puts_the_prompt_first(
    model_dir: str, tokenizer: Tokenizer
) -> None:
    prompt = "the old server"
    async with fake_gateway(model_dir, tokenizer) as gw:
        async with openai_client(gw.url) as client:
            result = await client.completions.create(
                model=model_dir, prompt=prompt, max_tokens=3, logprobs=2, echo=True
            )
    ids = encode(tokenizer, prompt)
    out = ids[:3]  # the fake scheduler repeats the prompt
    choice = result.choices[0]
    assert choice.text == prompt + tokenizer.decode(out)
    lp = choice.logprobs
    assert lp.tokens == [tokenizer.token_text(t) for t in ids + out]
    assert lp.token_logprobs == [None, *(-i / 8 for i in range(1, len(ids))),
                                 *GENERATED_LOGPROBS]
    assert lp.top_logprobs[0] is None
    for i, top in enumerate(lp.top_logprobs[1:len(ids)], start=1):
        assert top == {tokenizer.token_text(7): -0.0625, tokenizer.token_text(ids[i]): -i / 8}
    assert all(len(top) == 2 for top in lp.top_logprobs[len(ids):])
    check_offsets(choice.text, lp.text_offset, ids + out, tokenizer)
    sampling = gw.scheduler.requests[0].sampling
    assert (sampling.logprobs, sampling.prompt_logprobs) == (2, 2)


async def test_streamed_echo_logprobs_equal_the_whole_response(
    model_dir: str, tokenizer: Tokenizer
) -> None:
    body = {"prompt": "Hello 😀 world", "max_tokens": 5, "logprobs": 1, "echo": True}
    async with fake_gateway(model_dir, tokenizer) as gw:
        async with http_client(gw.url) as http:
            whole = (await http.post("/v1/completions", json=body)).json()["choices"][0]
            streamed = await http.post("/v1/completions", json={**body, "stream": True})
    chunks = [json.loads(e)["choices"] for e in sse_events(streamed.text)[:-1]]
    choices = [c[0] for c in chunks if c]
    assert "".join(c["text"] for c in choices) == whole["text"]
    joined: dict[str, list] = {"tokens": [], "token_logprobs": [], "top_logprobs": [],
                               "text_offset": []}
    for c in choices:
        for key in joined:
            joined[key] += c["logprobs"][key]
    assert joined == whole["logprobs"]
    ids = encode(tokenizer, body["prompt"])
    assert whole["logprobs"]["token_logprobs"][:len(ids)] == [
        None, *(-i / 8 for i in range(1, len(ids)))]
    check_offsets(whole["text"], whole["logprobs"]["text_offset"], ids + ids[:5], tokenizer)


async def test_token_id_prompts_echo_their_decoded_text_and_its_offsets(
    model_dir: str, tokenizer: Tokenizer
) -> None:
    bos = tokenizer.hf.convert_tokens_to_ids(tokenizer.hf.bos_token)
    prompts = [[bos, *encode(tokenizer, "abc def")], encode(tokenizer, "ghi")]
    async with fake_gateway(model_dir, tokenizer) as gw:
        async with http_client(gw.url) as http:
            body = {"prompt": prompts, "max_tokens": 1, "echo": True, "logprobs": 0}
            result = (await http.post("/v1/completions", json=body)).json()
    for prompt, choice in zip(prompts, result["choices"]):
        echoed = tokenizer.decode(prompt, skip_special_tokens=False)
        assert choice["text"] == echoed + tokenizer.decode(prompt[:1])
        lp = choice["logprobs"]
        assert lp["tokens"][:len(prompt)] == [tokenizer.token_text(t) for t in prompt]
        assert lp["top_logprobs"][0] is None
        assert lp["top_logprobs"][1:len(prompt)] == [
            {tokenizer.token_text(t): -i / 8} for i, t in enumerate(prompt[1:], start=1)]
        check_offsets(echoed, lp["text_offset"][:len(prompt)], prompt, tokenizer,
                      skip_special_tokens=False)
        assert lp["text_offset"][len(prompt)] == len(echoed)


async def test_echo_with_max_tokens_0_scores_the_prompt_alone(
    model_dir: str, tokenizer: Tokenizer
) -> None:
    prompt = "the old server"
    ids = encode(tokenizer, prompt)
    body = {"prompt": prompt, "max_tokens": 0, "echo": True, "logprobs": 1,
            "return_token_ids": True}
    async with fake_gateway(model_dir, tokenizer) as gw:
        async with http_client(gw.url) as http:
            whole = (await http.post("/v1/completions", json=body)).json()
            streamed = await http.post("/v1/completions", json={
                **body, "stream": True, "stream_options": {"include_usage": True}})
            refused = await http.post("/v1/completions", json={"prompt": prompt,
                                                               "max_tokens": 0})
    choice = whole["choices"][0]
    assert choice["text"] == prompt and choice["token_ids"] == []
    assert choice["finish_reason"] == "length"
    assert choice["logprobs"]["token_logprobs"] == [None, *(-i / 8 for i in range(1, len(ids)))]
    assert choice["logprobs"]["tokens"] == [tokenizer.token_text(t) for t in ids]
    assert whole["usage"]["completion_tokens"] == 0
    assert gw.scheduler.requests[0].sampling.max_tokens == 1  # sampled, not reported
    events = [json.loads(e) for e in sse_events(streamed.text)[:-1]]
    choices = [c for e in events for c in e["choices"]]
    assert "".join(c["text"] for c in choices) == prompt
    assert [t for c in choices for t in c["logprobs"]["tokens"]] == choice["logprobs"]["tokens"]
    assert choices[-1]["finish_reason"] == "length"
    assert events[-1]["usage"]["completion_tokens"] == 0
    assert refused.status_code == 400 and "echo" in refused.json()["error"]["message"]


async def test_vllm_prompt_logprobs_for_every_choice(
    model_dir: str, tokenizer: Tokenizer
) -> None:
    async with fake_gateway(model_dir, tokenizer) as gw:
        async with http_client(gw.url) as http:
            body = {"prompt": "the old server", "max_tokens": 2, "n": 2, "prompt_logprobs": 1}
            result = (await http.post("/v1/completions", json=body)).json()
    ids = encode(tokenizer, "the old server")
    for choice in result["choices"]:
        assert choice["logprobs"] is None and choice["text"] == tokenizer.decode(ids[:2])
        scores = choice["prompt_logprobs"]
        assert len(scores) == len(ids) and scores[0] is None
        for i, (token, here) in enumerate(zip(ids[1:], scores[1:]), start=1):
            assert here[str(token)] == {"logprob": -i / 8, "rank": i,
                                        "decoded_token": tokenizer.token_text(token)}
            assert here["7"]["rank"] == 1 and len(here) == (1 if token == 7 else 2)
    sampling = gw.scheduler.requests[0].sampling
    assert (sampling.logprobs, sampling.prompt_logprobs) == (-1, 1)


async def test_logit_bias_reaches_the_scheduler_sorted(
    model_dir: str, tokenizer: Tokenizer
) -> None:
    bias = {"7": 100, " 3": -100, "1999": 0.5}
    async with fake_gateway(model_dir, tokenizer) as gw:
        async with openai_client(gw.url) as client:
            await client.completions.create(model=model_dir, prompt="x", max_tokens=1,
                                            logit_bias=bias)
            await client.chat.completions.create(
                model=model_dir, messages=[{"role": "user", "content": "hi"}], max_tokens=1,
                logit_bias={"5": -1})
    completion, chat = (r.sampling for r in gw.scheduler.requests)
    assert dict(completion.logit_bias) == {3: -100.0, 7: 100.0, 1999: 0.5}
    assert dict(chat.logit_bias) == {5: -1.0}
    assert completion.prompt_logprobs == chat.prompt_logprobs == -1


async def test_continuous_usage_stats_on_every_chunk(
    model_dir: str, tokenizer: Tokenizer
) -> None:
    body = {"prompt": ["the old server", "ghi"], "max_tokens": 3, "n": 2, "stream": True,
            "stream_options": {"include_usage": True, "continuous_usage_stats": True}}
    async with fake_gateway(model_dir, tokenizer) as gw:
        async with http_client(gw.url) as http:
            streamed = await http.post("/v1/completions", json=body)
            alone = await http.post("/v1/completions", json={
                **body, "stream_options": {"continuous_usage_stats": True}})
            chat = await http.post("/v1/chat/completions", json={
                "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2,
                "stream": True, "stream_options": body["stream_options"]})
    prompt_lens = [len(encode(tokenizer, p)) for p in body["prompt"]]
    chunks = [json.loads(e) for e in sse_events(streamed.text)[:-1]]
    seen = [0] * 4
    for chunk in chunks[:-1]:
        (choice,) = chunk["choices"]
        i = choice["index"]
        seen[i] += 1  # the fake scheduler streams one token per chunk
        assert chunk["usage"] == {"prompt_tokens": prompt_lens[i // 2],
                                  "completion_tokens": seen[i],
                                  "total_tokens": prompt_lens[i // 2] + seen[i]}
    assert seen == [3] * 4
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] == 12
    assert all("usage" not in json.loads(e) for e in sse_events(alone.text)[:-1])  # as vLLM
    chat_chunks = [json.loads(e) for e in sse_events(chat.text)[:-1]]
    role, *tokens, final = chat_chunks
    assert role["usage"]["completion_tokens"] == 0 and role["usage"]["prompt_tokens"] > 0
    counts = [c["usage"]["completion_tokens"] for c in tokens]  # a chunk without text is skipped
    assert counts == sorted(counts) and counts[-1] == 2 and counts[0] >= 1
    assert {c["usage"]["prompt_tokens"] for c in tokens} == {role["usage"]["prompt_tokens"]}
    assert final["choices"] == [] and final["usage"]["completion_tokens"] == 2


async def test_what_cannot_be_honoured_is_a_clear_400(
    model_dir: str, tokenizer: Tokenizer
) -> None:
    async with fake_gateway(model_dir, tokenizer) as gw:
        async with http_client(gw.url) as http:

            async def error(body: dict) -> dict:
                response: httpx.Response = await http.post("/v1/completions", json=body)
                assert response.status_code == 400, response.text
                return response.json()["error"]

            suffix = await error({"prompt": "def f(", "suffix": "return x"})
            bias_vocab = await error({"prompt": "x", "logit_bias": {"5": 1, "2048": -2}})
            bias_range = await error({"prompt": "x", "logit_bias": {"5": -100.5}})
            bias_key = await error({"prompt": "x", "logit_bias": {"x5": 1}})
    assert suffix["param"] == "suffix" and "fill-in-the-middle" in suffix["message"]
    assert bias_vocab["param"] == "logit_bias"
    assert "2048" in bias_vocab["message"] and "vocabulary" in bias_vocab["message"]
    assert "between -100 and 100" in bias_range["message"] and "-100.5" in bias_range["message"]
    assert "'x5'" in bias_key["message"]
    assert gw.scheduler.requests == []
