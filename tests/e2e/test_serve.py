"""End to end through the four real processes: greedy tokens equal transformers' greedy generate."""
import asyncio
import signal
import time
from pathlib import Path

import httpx
import openai
import pytest
import torch
import transformers

from tests.e2e.conftest import Stack
from tests.waiting import until

LENGTHS = [1, 15, 16, 17, 123]
MAX_TOKENS = 12


@pytest.fixture(scope="module")
def hf(tiny_llama):
    return transformers.AutoModelForCausalLM.from_pretrained(tiny_llama, dtype=torch.float32).eval()


def _prompt(n: int, seed: int) -> list[int]:
    return torch.randint(0, 2000, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def _greedy(hf, prompt, n=MAX_TOKENS):
    out = hf.generate(torch.tensor([prompt]), max_new_tokens=n, min_new_tokens=n, do_sample=False)
    return out[0, len(prompt):].tolist()


def _body(prompt, **kw):
    return {"model": kw.pop("model", None), "prompt": prompt, "max_tokens": MAX_TOKENS,
            "temperature": 0, "ignore_eos": True, "return_token_ids": True, **kw}


def _complete(client, stack, prompt, **kw):
    body = _body(prompt, **kw)
    body["model"] = body["model"] or _model_name(client)
    r = client.post("/v1/completions", json=body)
    assert r.status_code == 200, r.text
    return r.json()


def _model_name(client):
    return client.get("/v1/models").json()["data"][0]["id"]


def test_four_processes_named_for_their_roles(stack):
    cmdlines = list(stack.children().values())
    roles = sorted(c.split("pdserve ", 1)[1].split()[0] for c in cmdlines if "pdserve " in c)
    assert roles == ["decode-worker", "gateway", "prefill-worker", "scheduler"], cmdlines


def test_greedy_one_at_a_time_matches_hf(stack, client, hf):
    for n in LENGTHS:
        prompt = _prompt(n, n)
        out = _complete(client, stack, prompt)
        choice = out["choices"][0]
        assert choice["token_ids"] == _greedy(hf, prompt), f"prompt of {n} tokens"
        assert choice["finish_reason"] == "length"
        assert out["usage"]["prompt_tokens"] == n
        assert out["usage"]["completion_tokens"] == MAX_TOKENS


def test_greedy_eight_concurrent_match_hf(stack, hf):
    prompts = [_prompt(n, 100 + i) for i, n in enumerate([1, 15, 16, 17, 123, 40, 64, 3])]

    async def go():
        async with httpx.AsyncClient(base_url=stack.url, timeout=120) as c:
            name = (await c.get("/v1/models")).json()["data"][0]["id"]
            rs = await asyncio.gather(*[c.post("/v1/completions", json=_body(p, model=name))
                                        for p in prompts])
            return [r.json()["choices"][0]["token_ids"] for r in rs]

    got = asyncio.run(go())
    for p, tokens in zip(prompts, got):
        assert tokens == _greedy(hf, p), f"prompt of {len(p)} tokens"


def test_streaming_equals_non_streaming(stack, client):
    oc = openai.OpenAI(base_url=f"{stack.url}/v1", api_key="none", max_retries=0)
    name = _model_name(client)
    prompt = "The cache holds the keys and values of every token"
    full = oc.completions.create(model=name, prompt=prompt, max_tokens=MAX_TOKENS, temperature=0,
                                 extra_body={"ignore_eos": True, "return_token_ids": True})
    chunks = list(oc.completions.create(
        model=name, prompt=prompt, max_tokens=MAX_TOKENS, temperature=0, stream=True,
        stream_options={"include_usage": True},
        extra_body={"ignore_eos": True, "return_token_ids": True}))
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert text == full.choices[0].text
    streamed_ids = [t for c in chunks if c.choices for t in (c.choices[0].model_extra or {})
                    .get("token_ids") or []]
    assert streamed_ids == full.choices[0].model_extra["token_ids"]
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == MAX_TOKENS
    assert chunks[-1].usage.prompt_tokens == full.usage.prompt_tokens


def test_chat_with_openai_client(stack, client):
    oc = openai.OpenAI(base_url=f"{stack.url}/v1", api_key="none", max_retries=0)
    name = _model_name(client)
    msgs = [{"role": "user", "content": "Where do the blocks go?"}]
    full = oc.chat.completions.create(model=name, messages=msgs, max_tokens=8, temperature=0)
    assert full.choices[0].message.role == "assistant"
    assert full.usage.completion_tokens <= 8
    streamed = "".join(c.choices[0].delta.content or "" for c in oc.chat.completions.create(
        model=name, messages=msgs, max_tokens=8, temperature=0, stream=True) if c.choices)
    assert streamed == full.choices[0].message.content


def test_bad_input_gets_4xx_with_openai_error(stack, client):
    name = _model_name(client)
    r = client.post("/v1/completions", content=b"{not json", headers={"content-type": "application/json"})
    assert r.status_code == 400 and "error" in r.json()
    r = client.post("/v1/completions", json=_body([5] * 5000, model=name))
    assert r.status_code == 400 and "error" in r.json()
    r = client.post("/v1/completions", json=_body("hi", model="no-such-model"))
    assert r.status_code == 404 and "error" in r.json()
    r = client.post("/v1/completions", json=_body("hi", model=name, temperature=-1))
    assert r.status_code == 400


def test_client_disconnect_aborts_and_frees_blocks(stack, client):
    name = _model_name(client)
    body = _body(_prompt(30, 7), model=name, max_tokens=2000, stream=True)
    with client.stream("POST", "/v1/completions", json=body) as r:
        lines = r.iter_lines()
        got = [next(lines) for _ in range(6)]
        assert any(line.startswith("data: ") for line in got)
    # the response closed after a few chunks: the request must be aborted, not run 2000 tokens
    s = stack.wait_idle(timeout=30)
    assert s["num_running"] == 0 and s["num_waiting"] == 0


def test_counters_show_the_disaggregated_path_and_no_block_leaks(stack, client):
    """On an idle stack the free prefill worker takes the prompt and the decode worker only
    decodes (counters are deltas: earlier tests of the module ran on the same stack)."""
    before = {w["role"]: w for w in stack.wait_idle()["workers"]}
    _complete(client, stack, _prompt(50, 3))
    s = stack.wait_idle()
    for w in s["workers"]:
        assert w["num_free_blocks"] == w["num_blocks"], w
    delta = {w["role"]: {k: v - before[w["role"]][k] for k, v in w.items()
                         if isinstance(v, int) and k in before[w["role"]]}
             for w in s["workers"]}
    prefill, decode = delta["prefill"], delta["decode"]
    assert prefill["prompt_tokens_computed"] >= 50
    assert prefill["kv_blocks_sent"] > 0
    assert decode["kv_blocks_received"] == prefill["kv_blocks_sent"]
    assert decode["prompt_tokens_computed"] == 0
    assert decode["tokens_decoded"] > 0


def test_ctrl_c_stops_all_four(tiny_llama, tmp_path):
    others = _shm_segments()
    s = Stack(tiny_llama, tmp_path, "--num-kv-blocks", "32")
    children = list(s.children())
    assert len(children) == 4
    ours = _shm_segments() - others
    assert len(ours) == 2  # one KV cache per worker
    assert s.stop(signal.SIGINT) == 0
    deadline = time.monotonic() + 10
    while any(Path(f"/proc/{pid}").exists() for pid in children) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not [pid for pid in children if Path(f"/proc/{pid}").exists()]
    assert not ours & _shm_segments()


def _shm_segments() -> set[str]:
    return {p.name for p in Path("/dev/shm").glob("pdserve-kv-*")}



def test_logprobs_match_hf(stack, client, hf):
    prompt = _prompt(20, 5)
    out = _complete(client, stack, prompt, logprobs=3, max_tokens=6)
    choice = out["choices"][0]
    ids = choice["token_ids"]
    with torch.no_grad():
        logits = hf(torch.tensor([prompt + ids])).logits[0, len(prompt) - 1:-1]
    ref = torch.log_softmax(logits, dim=-1)
    got = torch.tensor(choice["logprobs"]["token_logprobs"])
    torch.testing.assert_close(got, ref[torch.arange(len(ids)), torch.tensor(ids)],
                               rtol=0, atol=1e-3)
    for top, row in zip(choice["logprobs"]["top_logprobs"], ref):
        assert len(top) == 3
        torch.testing.assert_close(torch.tensor(sorted(top.values(), reverse=True)),
                                   row.topk(3).values, rtol=0, atol=1e-3)


def test_seeded_sampling_is_reproducible(stack, client):
    prompt = _prompt(12, 9)
    kw = dict(temperature=1.0, top_p=0.9, max_tokens=10)
    a = _complete(client, stack, prompt, seed=1234, **kw)["choices"][0]["token_ids"]
    b = _complete(client, stack, prompt, seed=1234, **kw)["choices"][0]["token_ids"]
    c = _complete(client, stack, prompt, seed=4321, **kw)["choices"][0]["token_ids"]
    assert a == b
    assert a != c


def test_stop_token_ids_and_min_tokens(stack, client, hf):
    prompt = _prompt(10, 11)
    greedy = _greedy(hf, prompt)
    stop_at = greedy[4]
    first = greedy.index(stop_at)
    out = _complete(client, stack, prompt, stop_token_ids=[stop_at])["choices"][0]
    assert out["token_ids"] == greedy[:first + 1] and out["finish_reason"] == "stop"
    out = _complete(client, stack, prompt, stop_token_ids=[stop_at], min_tokens=MAX_TOKENS)
    assert len(out["choices"][0]["token_ids"]) == MAX_TOKENS


def test_repeated_prompt_prefills_only_its_uncached_tail(stack, client, hf):
    prompt = _prompt(75, 77)  # 4 full blocks of 16 + 11 tokens
    first = _complete(client, stack, prompt)
    before = {w["role"]: w for w in stack.wait_idle()["workers"]}
    again = _complete(client, stack, prompt)
    after = {w["role"]: w for w in stack.wait_idle()["workers"]}
    assert again["choices"][0]["token_ids"] == first["choices"][0]["token_ids"] == \
        _greedy(hf, prompt)
    assert again["usage"]["prompt_tokens_details"]["cached_tokens"] == 64
    computed = {role: after[role]["prompt_tokens_computed"]
                - before[role]["prompt_tokens_computed"] for role in ("prefill", "decode")}
    # the tail once, where the scheduler put it: the free prefill worker, or the decode worker
    # when the prefill worker was still busy with the first request's last step
    assert sorted(computed.values()) == [0, 75 - 64]
    sent = after["prefill"]["kv_blocks_sent"] - before["prefill"]["kv_blocks_sent"]
    # the decode worker kept the 4 full blocks: only the partial one travels, if any
    assert sent == (1 if computed["prefill"] else 0)


def test_n3_shares_the_prompt_blocks(stack, client):
    """One prefill and one KV transfer for three samples, each equal to the same request with
    n=1 and seed + j (the cache salts keep the four runs from sharing cached blocks)."""
    prompt = _prompt(40, 78)  # two full blocks of 16 + 8 tokens
    kw = dict(temperature=1.5, seed=5)
    alone = [_complete(client, stack, prompt, **{**kw, "seed": 5 + j}, cache_salt=f"alone{j}")
             for j in range(3)]
    before = {w["role"]: w for w in stack.wait_idle()["workers"]}
    out = _complete(client, stack, prompt, n=3, cache_salt="n3", **kw)
    after = {w["role"]: w for w in stack.wait_idle()["workers"]}
    assert [c["token_ids"] for c in out["choices"]] == \
        [a["choices"][0]["token_ids"] for a in alone]
    assert out["usage"]["completion_tokens"] == 3 * MAX_TOKENS
    computed = after["prefill"]["prompt_tokens_computed"] - before["prefill"]["prompt_tokens_computed"]
    assert computed == 40  # the prompt was prefilled once
    sent = after["prefill"]["kv_blocks_sent"] - before["prefill"]["kv_blocks_sent"]
    assert sent == 3  # and its three blocks sent once
    assert all(w["num_free_blocks"] == w["num_blocks"] for w in after.values())


def test_forced_preemption_keeps_greedy_output(tiny_llama, tmp_path, hf):
    """12 decode blocks of 16 tokens: four 40-token prompts growing by 40 cannot all fit."""
    s = Stack(tiny_llama, tmp_path, "--num-kv-blocks", "12")
    try:
        prompts = [_prompt(40, 200 + i) for i in range(4)]

        async def go():
            async with httpx.AsyncClient(base_url=s.url, timeout=300) as c:
                name = (await c.get("/v1/models")).json()["data"][0]["id"]
                rs = await asyncio.gather(*[c.post("/v1/completions", json=_body(
                    p, model=name, max_tokens=40)) for p in prompts])
                return [r.json()["choices"][0]["token_ids"] for r in rs]

        for p, tokens in zip(prompts, asyncio.run(go())):
            assert tokens == _greedy(hf, p, 40)
        stats = s.wait_idle()
        assert stats["num_preemptions"] > 0
        assert all(w["num_free_blocks"] == w["num_blocks"] for w in stats["workers"])
    finally:
        s.stop()


def test_best_of_returns_the_likeliest_of_its_samples(stack, client):
    prompt = _prompt(12, 91)
    kw = dict(temperature=1.0, max_tokens=8, seed=40)
    samples = _complete(client, stack, prompt, n=3, logprobs=0, **kw)["choices"]
    means = [sum(c["logprobs"]["token_logprobs"]) / len(c["token_ids"]) for c in samples]
    best = samples[max(range(3), key=means.__getitem__)]
    out = _complete(client, stack, prompt, n=1, best_of=3, **kw)
    assert [c["token_ids"] for c in out["choices"]] == [best["token_ids"]]
    assert out["choices"][0]["logprobs"] is None  # not asked for
    assert out["usage"]["completion_tokens"] == 3 * 8  # every sample was computed
    r = client.post("/v1/completions", json=_body(prompt, model=_model_name(client), n=2,
                                                  best_of=1))
    assert r.status_code == 400


# -- the scheduler's Session stream (what the gateway speaks) -----------------------------------

def _session_request(rid, prompt, max_tokens=MAX_TOKENS):
    from protos import scheduler_pb2
    return scheduler_pb2.SessionRequest(generate=scheduler_pb2.GenerateRequest(
        request_id=rid, prompt_token_ids=prompt, sampling=scheduler_pb2.SamplingParams(
            max_tokens=max_tokens, ignore_eos=True, logprobs=-1, prompt_logprobs=-1,
            top_p=1.0, repetition_penalty=1.0)))


async def _in_session(stack, run):
    """run(call) on a Session call to the stack's scheduler; its result. Then the session ends
    as the gateway ends one: its side closed (the scheduler aborts what still runs), read to
    the end, so that no completion of the call comes after this event loop closed."""
    import grpc

    from protos import scheduler_pb2_grpc
    async with grpc.aio.insecure_channel(f"127.0.0.1:{stack.sched_port}") as channel:
        call = scheduler_pb2_grpc.SchedulerStub(channel).Session(timeout=120)
        try:
            result = await run(call)
            await call.done_writing()
            while await call.read() is not grpc.aio.EOF:
                pass
            return result
        finally:
            call.cancel()  # a no-op once the call has ended


def test_a_session_sends_each_steps_outputs_in_one_message_and_matches_hf(stack, hf):
    """Each step's outputs for the session's requests go in one message: never more messages
    than the workers ran steps, which are far fewer than the outputs. Not that all four decode
    in one step: the decode worker prefills short prompts itself, and a prompt the prefill
    worker takes may land after the others finished (seen on a loaded 2-core box, even at 40
    tokens). 32 tokens leave them long enough for two at least to decode together (past 32,
    greedy picks eos for s1, which HF's min_new_tokens masks and ignore_eos does not)."""
    prompts = {f"s{i}": _prompt(9 + i, 300 + i) for i in range(4)}
    num_tokens = 32

    async def run(call):
        for rid, prompt in prompts.items():
            await call.write(_session_request(rid, prompt, max_tokens=num_tokens))
        tokens = {rid: [] for rid in prompts}
        running, messages = set(prompts), []
        while running:
            message = await call.read()
            messages.append([o.request_id for o in message.outputs])
            for o in message.outputs:
                tokens[o.request_id] += o.token_ids
                if o.finish_reason:
                    assert o.finish_reason == "length" and o.sample == 0
                    running.discard(o.request_id)
        return tokens, messages

    stack.wait_idle()  # the steps counted below are this session's
    steps = _steps(stack)
    tokens, messages = asyncio.run(_in_session(stack, run))
    steps = _steps(stack) - steps
    assert tokens == {rid: _greedy(hf, p, num_tokens) for rid, p in prompts.items()}
    # a step that runs several of the requests puts all their outputs in one message (a step
    # that only registers or sends KV has none)
    assert len(messages) <= steps < sum(map(len, messages))
    assert max(len(set(ids)) for ids in messages) >= 2
    assert stack.wait_idle()["num_running"] == 0


def _steps(stack) -> int:
    """The steps the stack's workers have run, all told."""
    return sum(w["steps"] for w in stack.stats()["workers"])


def test_a_session_refuses_bad_requests_alone_and_aborts_on_request_and_on_close(stack, hf):
    import grpc

    from protos import scheduler_pb2

    async def run(call):
        await call.write(_session_request("long", _prompt(5, 310), max_tokens=1000))
        await call.write(_session_request("long", _prompt(5, 311)))  # its id is in use
        await call.write(_session_request("", _prompt(5, 312)))
        await call.write(_session_request("huge", _prompt(5, 313), max_tokens=1 << 30))
        await call.write(_session_request("ok", _prompt(7, 314)))
        refused, ok, ok_done, long_tokens = {}, [], False, 0
        while len(refused) < 3 or not ok_done or long_tokens < 3:
            message = await call.read()
            refused.update({r.request_id: r.code for r in message.refused})
            for o in message.outputs:
                if o.request_id == "ok":
                    ok += o.token_ids
                    ok_done = bool(o.finish_reason)
                else:
                    assert o.request_id == "long" and not o.finish_reason
                    long_tokens += len(o.token_ids)
        codes = grpc.StatusCode
        assert refused == {"long": codes.ALREADY_EXISTS.value[0],
                           "": codes.INVALID_ARGUMENT.value[0],
                           "huge": codes.INVALID_ARGUMENT.value[0]}
        assert ok == _greedy(hf, _prompt(7, 314))
        await call.write(scheduler_pb2.SessionRequest(abort="long"))
        await asyncio.to_thread(until, lambda: stack.stats()["num_running"] == 0, 30.0,
                                "no request running")
        # the session goes on: a new request, left running when the session closes
        await call.write(_session_request("left", _prompt(6, 315), max_tokens=1000))
        while not any(o.request_id == "left" for o in (await call.read()).outputs):
            pass

    asyncio.run(_in_session(stack, run))
    s = stack.wait_idle()  # closing the session aborted "left"
    assert s["num_running"] == 0 and s["num_waiting"] == 0
    assert all(w["num_free_blocks"] == w["num_blocks"] for w in s["workers"])
