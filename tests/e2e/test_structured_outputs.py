"""Structured outputs through the four real processes, asked with the openai client as a user
would: outputs for random bounded JSON schemas parse and validate against them, whole and
streamed, chat and completions, and stop on their own; the first token honours the grammar where
the prefill worker samples it, and so do the forks of n=3; a schema the engine cannot serve is a
400; tool calls forced by tool_choice (required, a named function) are valid calls,
whole and streamed.

One stack for the module, started with --structured-outputs-config disable_any_whitespace: the
model has random weights, and free whitespace (like an unbounded string) can fill any budget.
Every schema here bounds its output, so an output that does not stop is a bug.
"""
import asyncio
import json
import re

import jsonschema
import openai
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tests.e2e.conftest import Stack
from tests.json_schemas import ARRAYS, LEAVES, max_bytes, objects

MAX_TOKENS = 200
PROMPT = "Answer in JSON."
LONG_PROMPT = list(range(100, 160))  # 60 tokens: the idle prefill worker takes it


@pytest.fixture(scope="module")
def stack(tiny_llama, tmp_path_factory):
    # plans of several decode steps: each step's tokens stream as it ends, under the grammar
    s = Stack(tiny_llama, tmp_path_factory.mktemp("structured"), "--num-kv-blocks", "256",
              "--structured-outputs-config", '{"disable_any_whitespace": true}',
              "--num-scheduler-steps", "4")
    yield s
    s.stop()


@pytest.fixture(scope="module")
def model(stack) -> str:
    with openai.OpenAI(base_url=f"{stack.url}/v1", api_key="none") as client:
        return client.models.list().data[0].id


@pytest.fixture
def client(stack):
    with openai.OpenAI(base_url=f"{stack.url}/v1", api_key="none", max_retries=0,
                       timeout=120) as c:
        yield c


# -- bounded schemas: every output they allow is at most max_bytes long -------------------------

SCHEMAS = objects(st.one_of(LEAVES, ARRAYS, objects(st.one_of(LEAVES, ARRAYS)))).filter(
    lambda s: max_bytes(s) < MAX_TOKENS)  # and the eos


STRING = re.compile(r'"(?:[^"\\]|\\.)*"')


def check_json(text: str, schema: dict) -> None:
    jsonschema.validate(json.loads(text), schema)
    # no whitespace outside strings but xgrammar's separators: disable_any_whitespace held
    outside = STRING.sub('""', text).replace(", ", ",").replace(": ", ":")
    assert not re.search(r"\s", outside), text


async def _both(url: str, model: str, schema: dict, seed: int):
    """A whole chat completion (OpenAI's response_format) and a streamed completion (vLLM's
    response_format on /v1/completions), at once."""
    fmt = {"type": "json_schema", "json_schema": {"name": "out", "schema": schema}}
    async with openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0,
                                  timeout=120) as client:
        chat = client.chat.completions.create(
            model=model, messages=[{"role": "user", "content": PROMPT}], response_format=fmt,
            max_tokens=MAX_TOKENS, temperature=1.0, seed=seed)

        async def streamed():
            chunks = [c async for c in await client.completions.create(
                model=model, prompt=PROMPT, max_tokens=MAX_TOKENS, temperature=1.0, seed=seed,
                stream=True, extra_body={"response_format": fmt})]
            return ("".join(c.choices[0].text for c in chunks if c.choices),
                    [c.choices[0].finish_reason for c in chunks if c.choices])
        return await asyncio.gather(chat, streamed())


@settings(max_examples=25, deadline=None, derandomize=True)
@given(schema=SCHEMAS, seed=st.integers(0, 2**32))
def test_random_bounded_schemas_hold_whole_and_streamed(stack, model, schema, seed):
    whole, (text, finishes) = asyncio.run(_both(stack.url, model, schema, seed))
    choice = whole.choices[0]
    assert choice.finish_reason == "stop", (schema, choice)
    check_json(choice.message.content, schema)
    assert finishes[-1] == "stop" and set(finishes[:-1]) <= {None}, (schema, finishes)
    check_json(text, schema)


NESTED = {"type": "object", "additionalProperties": False, "required": ["id", "tags", "meta"],
          "properties": {
              "id": {"type": "integer", "minimum": 1, "maximum": 999},
              "tags": {"type": "array", "items": {"enum": ["a", "bb"]}, "maxItems": 3},
              "meta": {"type": "object", "additionalProperties": False,
                       "required": ["ok", "note"],
                       "properties": {"ok": {"type": "boolean"},
                                      "note": {"type": "string", "maxLength": 5}}}}}


def test_chat_streamed_and_completions_whole(client, model):
    fmt = {"type": "json_schema", "json_schema": {"name": "item", "schema": NESTED}}
    stream = client.chat.completions.create(
        model=model, messages=[{"role": "user", "content": PROMPT}], max_tokens=MAX_TOKENS,
        response_format=fmt, stream=True, temperature=0)
    chunks = [c for c in stream if c.choices]
    check_json("".join(c.choices[0].delta.content or "" for c in chunks), NESTED)
    assert chunks[-1].choices[0].finish_reason == "stop"
    whole = client.completions.create(model=model, prompt=PROMPT, max_tokens=MAX_TOKENS,
                                      temperature=0, extra_body={"response_format": fmt})
    check_json(whole.choices[0].text, NESTED)
    assert whole.choices[0].finish_reason == "stop"


def _worker_counters(stack) -> dict[str, dict]:
    return {w["role"]: w for w in stack.wait_idle()["workers"]}


def test_the_prefill_worker_samples_the_first_token_under_the_grammar(stack, client, model):
    choices = ["alpha", "#beta", "7 gamma"]
    before = _worker_counters(stack)
    one = client.completions.create(model=model, prompt=LONG_PROMPT, max_tokens=1,
                                    extra_body={"guided_choice": choices})
    after = _worker_counters(stack)
    # it never reached the decode worker: the prefill worker sampled its one token
    assert after["prefill"]["prompt_tokens_computed"] - before["prefill"][
        "prompt_tokens_computed"] == len(LONG_PROMPT)
    assert after["decode"]["prompt_tokens_computed"] == before["decode"]["prompt_tokens_computed"]
    text = one.choices[0].text
    assert text and any(c.startswith(text) for c in choices), text

    whole = client.completions.create(model=model, prompt=LONG_PROMPT[::-1],
                                      max_tokens=MAX_TOKENS,
                                      extra_body={"guided_regex": r"[0-9]{2}-[A-Z]{1,3}"})
    assert re.fullmatch(r"[0-9]{2}-[A-Z]{1,3}", whole.choices[0].text), whole.choices[0].text
    assert whole.choices[0].finish_reason == "stop"
    final = _worker_counters(stack)
    assert final["decode"]["prompt_tokens_computed"] == after["decode"]["prompt_tokens_computed"]
    assert final["decode"]["kv_blocks_received"] > after["decode"]["kv_blocks_received"]


def test_n3_samples_all_hold_the_regex(client, model):
    regex = r"[0-9]{2}( [a-z]{2,5}){1,3}\."
    out = client.completions.create(model=model, prompt=LONG_PROMPT[5:45], n=3,
                                    temperature=0.8, seed=7, max_tokens=MAX_TOKENS,
                                    extra_body={"structured_outputs": {"regex": regex}})
    assert len(out.choices) == 3
    for c in out.choices:
        assert re.fullmatch(regex, c.text), c.text
        assert c.finish_reason == "stop"


def test_a_schema_the_engine_cannot_serve_is_a_400(client, model):
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(
            model=model, messages=[{"role": "user", "content": PROMPT}], max_tokens=8,
            response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": {
                "type": "string", "pattern": "(?<=a)b"}}})
    assert e.value.status_code == 400
    assert e.value.body["param"] == "response_format"
    assert "Lookbehind" in e.value.body["message"]


# -- tool calling: required and named choices hold even a random-weight model to valid calls ----

TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "parameters": {
        "type": "object", "additionalProperties": False, "required": ["city", "days"],
        "properties": {"city": {"type": "string", "maxLength": 8},
                       "days": {"type": "integer", "minimum": 1, "maximum": 7}}}}},
    {"type": "function", "function": {"name": "convert", "parameters": {
        "type": "object", "additionalProperties": False, "required": ["unit"],
        "properties": {"unit": {"enum": ["C", "F"]}, "round": {"type": "boolean"}}}}},
]
SCHEMAS_BY_NAME = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}


def _streamed_calls(stream) -> tuple[dict[int, list], str | None]:
    calls: dict[int, list] = {}
    finish = None
    for chunk in stream:
        for c in chunk.choices:
            finish = c.finish_reason or finish
            for d in c.delta.tool_calls or []:
                entry = calls.setdefault(d.index, [None, ""])
                if d.function and d.function.name:
                    assert entry[0] is None, "a call is named once"
                    entry[0] = d.function.name
                entry[1] += (d.function.arguments or "") if d.function else ""
    return calls, finish


@pytest.mark.parametrize("choice", [
    "required", {"type": "function", "function": {"name": "convert"}}])
def test_forced_tool_calls_are_valid_whole_and_streamed(client, model, choice):
    # one call (parallel_tool_calls false): a random model would append calls to the budget
    ask = dict(model=model, tools=TOOLS, tool_choice=choice, max_tokens=MAX_TOKENS,
               temperature=0, parallel_tool_calls=False,
               messages=[{"role": "user", "content": "What is the weather in Oslo, in C?"}])
    whole = client.chat.completions.create(**ask)
    stream = client.chat.completions.create(**ask, stream=True)
    calls, finish = _streamed_calls(stream)
    message = whole.choices[0].message
    assert message.tool_calls, message
    got = [(c.function.name, c.function.arguments) for c in message.tool_calls]
    assert [tuple(v) for _, v in sorted(calls.items())] == got  # same greedy output
    for name, arguments in got:
        jsonschema.validate(json.loads(arguments), SCHEMAS_BY_NAME[name])
    if isinstance(choice, dict):
        assert [name for name, _ in got] == ["convert"]
        assert whole.choices[0].finish_reason == finish == "stop"
    else:
        assert whole.choices[0].finish_reason == finish == "tool_calls"
