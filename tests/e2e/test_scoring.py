"""Scoring and steering through the four real processes: /v1/completions with echo and logprobs
returns the prompt's logprobs as transformers computes them on the same weights (scored by the
worker that prefilled the prompt), streamed or not, with max_tokens 0 the prompt's alone, and
vLLM's prompt_logprobs the same (on chat completions too);
logit_bias 100 forces a token and -100 bans the greedy one, from the first token on."""
import json

import pytest
import torch
import transformers

ATOL = 1e-3  # fp32 logits of magnitude ~10-30 differ from transformers' by ~1e-4


@pytest.fixture(scope="module")
def hf(tiny_llama):
    return transformers.AutoModelForCausalLM.from_pretrained(tiny_llama, dtype=torch.float32).eval()


def _prompt(n: int, seed: int) -> list[int]:
    return torch.randint(0, 2000, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def _log_softmax(hf, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return torch.log_softmax(hf(torch.tensor([ids])).logits[0], dim=-1)  # [len, vocab]


def _complete(client, **body) -> dict:
    body = {"model": client.get("/v1/models").json()["data"][0]["id"], "temperature": 0,
            "ignore_eos": True, "return_token_ids": True, **body}
    r = client.post("/v1/completions", json=body)
    assert r.status_code == 200, r.text
    return r.json()


def _close(got, want) -> None:
    torch.testing.assert_close(torch.tensor(got, dtype=torch.float32), want, rtol=0, atol=ATOL)


@pytest.mark.parametrize("n", [2, 40])
def test_echo_logprobs_match_hf(stack, client, hf, n):
    prompt = _prompt(n, n)
    choice = _complete(client, prompt=prompt, max_tokens=4, echo=True, logprobs=3)["choices"][0]
    ids = prompt + choice["token_ids"]
    ref = _log_softmax(hf, ids)
    assert choice["token_ids"] == ref[n - 1:-1].argmax(dim=-1).tolist()  # greedy
    lp = choice["logprobs"]
    assert len(lp["tokens"]) == len(lp["token_logprobs"]) == len(ids)
    assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
    rows = torch.arange(len(ids) - 1)
    _close(lp["token_logprobs"][1:], ref[rows, torch.tensor(ids[1:])])
    for top, row in zip(lp["top_logprobs"][1:], ref[:-1]):
        assert 3 <= len(top) <= 4  # the top 3, and the token itself when not among them
        _close(sorted(top.values(), reverse=True)[:3], row.topk(3).values)
    assert lp["text_offset"] == sorted(lp["text_offset"])


def test_streamed_echo_equals_the_whole_response(stack, client):
    body = dict(prompt="The cache holds the keys and values", max_tokens=5, echo=True,
                logprobs=2)
    whole = _complete(client, **body)["choices"][0]
    model = client.get("/v1/models").json()["data"][0]["id"]
    with client.stream("POST", "/v1/completions", json={
            "model": model, "temperature": 0, "ignore_eos": True, "stream": True,
            "stream_options": {"include_usage": True, "continuous_usage_stats": True},
            **body}) as r:
        events = [line[6:] for line in r.iter_lines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    choices = [c["choices"][0] for c in chunks if c["choices"]]
    assert "".join(c["text"] for c in choices) == whole["text"]
    assert whole["text"].startswith(body["prompt"])
    streamed = [lp for c in choices for lp in c["logprobs"]["token_logprobs"]]
    assert streamed[0] is None and len(streamed) == len(whole["logprobs"]["token_logprobs"])
    _close(streamed[1:], torch.tensor(whole["logprobs"]["token_logprobs"][1:]))
    offsets = [o for c in choices for o in c["logprobs"]["text_offset"]]
    assert offsets == whole["logprobs"]["text_offset"]
    usage = [c["usage"] for c in chunks]
    assert [u["completion_tokens"] for u in usage[:-1]] == sorted(
        u["completion_tokens"] for u in usage[:-1])
    assert usage[-1]["completion_tokens"] == 5 and chunks[-1]["choices"] == []


def test_echo_with_max_tokens_0_scores_the_prompt_alone(stack, client, hf):
    prompt = _prompt(24, 5)
    choice = _complete(client, prompt=prompt, max_tokens=0, echo=True, logprobs=0)
    assert choice["usage"]["completion_tokens"] == 0
    choice = choice["choices"][0]
    assert choice["token_ids"] == [] and choice["finish_reason"] == "length"
    lp = choice["logprobs"]["token_logprobs"]
    assert len(lp) == len(prompt) and lp[0] is None
    ref = _log_softmax(hf, prompt)
    _close(lp[1:], ref[torch.arange(len(prompt) - 1), torch.tensor(prompt[1:])])


def test_vllm_prompt_logprobs_match_hf(stack, client, hf):
    prompt = _prompt(17, 3)
    choice = _complete(client, prompt=prompt, max_tokens=2, prompt_logprobs=2)["choices"][0]
    ref = _log_softmax(hf, prompt)
    scores = choice["prompt_logprobs"]
    assert len(scores) == len(prompt) and scores[0] is None
    for i, here in enumerate(scores[1:]):
        token = prompt[i + 1]
        mine = here[str(token)]
        _close([mine["logprob"]], ref[i, token:token + 1])
        lo, hi = ((ref[i] > ref[i, token] + d).sum().item() + 1 for d in (ATOL, -ATOL))
        assert lo <= mine["rank"] <= hi  # tokens within ATOL of it may rank either way
        best = sorted((v for v in here.values() if v["rank"] <= 2), key=lambda v: v["rank"])
        _close([v["logprob"] for v in best], ref[i].topk(2).values)


def test_chat_prompt_logprobs_match_hf(stack, client, hf):
    messages = [{"role": "user", "content": "Score every token of this conversation."}]
    model = client.get("/v1/models").json()["data"][0]["id"]
    prompt = client.post("/tokenize", json={"model": model, "messages": messages}).json()
    prompt = prompt["tokens"]
    r = client.post("/v1/chat/completions", json={
        "model": model, "messages": messages, "max_tokens": 1, "prompt_logprobs": 1})
    assert r.status_code == 200, r.text
    scores = r.json()["prompt_logprobs"]
    assert len(scores) == len(prompt) and scores[0] is None
    ref = _log_softmax(hf, prompt)
    _close([here[str(t)]["logprob"] for here, t in zip(scores[1:], prompt[1:])],
           ref[torch.arange(len(prompt) - 1), torch.tensor(prompt[1:])])
    refused = client.post("/v1/chat/completions", json={
        "model": model, "messages": messages, "max_tokens": 1, "prompt_logprobs": -1})
    assert refused.status_code == 400 and "vocabulary" in refused.json()["error"]["message"]


def test_logit_bias_forces_and_bans_through_the_stack(stack, client, hf):
    prompt = _prompt(12, 8)
    greedy = _log_softmax(hf, prompt)[-1].topk(2).indices.tolist()
    forced = _complete(client, prompt=prompt, max_tokens=4, logit_bias={"7": 100})
    assert forced["choices"][0]["token_ids"] == [7] * 4
    banned = _complete(client, prompt=prompt, max_tokens=1, logit_bias={str(greedy[0]): -100})
    assert banned["choices"][0]["token_ids"] == [greedy[1]]
    sampled = _complete(client, prompt=prompt, max_tokens=4, temperature=1.0, seed=5,
                        logit_bias={"11": 100})
    assert sampled["choices"][0]["token_ids"] == [11] * 4
    r = client.post("/v1/completions", json={"prompt": prompt, "logit_bias": {"99999": 1}})
    assert r.status_code == 400 and r.json()["error"]["param"] == "logit_bias"
