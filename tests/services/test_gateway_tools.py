"""Tool calling: the parsers on texts split at every point, the schemas required and named
tool choices force, and chat completions through the real gateway against the fake scheduler
(which writes a scripted output), with the `openai` client, streamed and not."""

from __future__ import annotations

import json

import jsonschema
import pytest

from services.gateway.tokenizer import Tokenizer
from services.gateway.tools import (
    HermesParser,
    Llama3JsonParser,
    NamedParser,
    Parsed,
    RequiredParser,
    ToolParser,
    forced_schema,
)
from tests.services.fake_scheduler import FakeScheduler, fake_gateway, http_client, openai_client

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "the weather in a city",
    "parameters": {"type": "object", "properties": {
        "city": {"type": "string"}, "days": {"type": "integer", "minimum": 1}},
        "required": ["city", "days"]}}}
ADD = {"type": "function", "function": {
    "name": "add", "parameters": {"type": "object", "properties": {
        "a": {"type": "integer"}, "b": {"type": "integer"}}, "required": ["a", "b"]}}}
TOOLS = [WEATHER, ADD]


def run(parser: ToolParser, pieces: list[str]) -> tuple[str, list[tuple[str, dict]]]:
    """Content and (name, arguments) of each call, from deltas fed one by one."""
    out = Parsed()
    for piece in pieces:
        out += parser.feed(piece)
    out += parser.finish()
    calls: dict[int, list] = {}
    for c in out.calls:
        if c.index not in calls:
            assert c.id and c.id.startswith("chatcmpl-tool-") and c.name
            calls[c.index] = [c.name, ""]
        else:
            assert c.id is None and c.name is None, "only a call's first delta names it"
        calls[c.index][1] += c.arguments
    assert sorted(calls) == list(range(len(calls)))
    return out.content, [(name, json.loads(args)) for name, args in calls.values()]


def splits(text: str) -> list[list[str]]:
    """The text whole, char by char, and cut in two at every point."""
    return [[text], list(text)] + [[text[:i], text[i:]] for i in range(1, len(text))]


HERMES = ('Let me look. <tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", '
          '"days": 2}}\n</tool_call><tool_call>{"name": "add", "arguments": {"a": 1, "b": 2}}'
          '</tool_call> Done <tool')


@pytest.mark.parametrize("pieces", splits(HERMES))
def test_hermes_finds_each_call_wherever_the_text_is_cut(pieces):
    content, calls = run(HermesParser(), pieces)
    assert content == "Let me look.  Done <tool"
    assert calls == [("get_weather", {"city": "Paris", "days": 2}), ("add", {"a": 1, "b": 2})]


def test_hermes_keeps_what_is_not_a_call_as_written():
    text = '<tool_call>{"name": 3}</tool_call> and <tool_call>not json</tool_call> <tool_call>{"a'
    assert run(HermesParser(), list(text)) == (text, [])


def test_hermes_streams_content_before_a_tag_completes():
    parser = HermesParser()
    assert parser.feed("Hello <tool").content == "Hello "
    assert parser.feed("s>").content == "<tools>"


LLAMA = ('<|python_tag|>{"name": "get_weather", "parameters": {"city": "Oslo", "days": 1}}; '
         '{"name": "add", "arguments": {"a": 5, "b": 6}}')


@pytest.mark.parametrize("pieces", splits(LLAMA))
def test_llama3_json_parses_calls_separated_by_semicolons(pieces):
    assert run(Llama3JsonParser(), pieces) == (
        "", [("get_weather", {"city": "Oslo", "days": 1}), ("add", {"a": 5, "b": 6})])


@pytest.mark.parametrize("text", [" The answer is {1}", '{"name": "f", "parameters": {"x"',
                                  '{"nom": "f"}'])
def test_llama3_json_leaves_text_that_is_not_calls_as_content(text):
    assert run(Llama3JsonParser(), list(text)) == (text, [])


def test_llama3_json_streams_plain_content_at_once():
    parser = Llama3JsonParser()
    assert parser.feed("  ").content == ""
    assert parser.feed("Sure").content == "  Sure"
    assert parser.feed(", {").content == ", {"


def test_required_and_named_parsers():
    text = '[{"name": "add", "parameters": {"a": 1, "b": 2}}, {"name": "get_weather", ' \
           '"parameters": {"city": "Rome", "days": 3}}]'
    assert run(RequiredParser(), splits(text)[1]) == (
        "", [("add", {"a": 1, "b": 2}), ("get_weather", {"city": "Rome", "days": 3})])
    assert run(RequiredParser(), [text[:-5]]) == (text[:-5], [])  # cut short: content
    assert run(NamedParser("add"), ['{"a": ', "4, ", '"b": 5}']) == (
        "", [("add", {"a": 4, "b": 5})])
    empty = NamedParser("add").finish().calls  # nothing written: the call, no arguments
    assert [(c.index, c.name, c.arguments) for c in empty] == [(0, "add", "")]


def test_forced_schemas_take_valid_calls_and_refuse_others():
    required = forced_schema(TOOLS, "required", parallel=True)
    assert required is not None
    good = [{"name": "add", "parameters": {"a": 1, "b": 2}},
            {"name": "get_weather", "parameters": {"city": "x", "days": 1}}]
    jsonschema.validate(good, required)
    for bad in ([], [{"name": "sub", "parameters": {"a": 1, "b": 2}}],
                [{"name": "add", "parameters": {"city": "x", "days": 1}}]):
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate(bad, required)
    single = forced_schema(TOOLS, "required", parallel=False)
    assert single is not None
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(good, single)
    named = forced_schema(TOOLS, {"type": "function", "function": {"name": "add"}}, True)
    assert named == ADD["function"]["parameters"]
    assert forced_schema(TOOLS, "auto", True) is None and forced_schema(TOOLS, "none", True) is None


pytestmark = pytest.mark.anyio


def script(tokenizer: Tokenizer, text: str) -> FakeScheduler:
    """A scheduler whose output is `text` then eos."""
    ids = tokenizer.hf.encode(text, add_special_tokens=False)
    return FakeScheduler(output_ids=ids + [tokenizer.eos_token_ids[0]])


MESSAGES = [{"role": "user", "content": "What is the weather in Paris?"}]


async def test_auto_tool_calls_are_parsed_whole_and_streamed(model_dir: str,
                                                            tokenizer: Tokenizer) -> None:
    scheduler = script(tokenizer, HERMES.removesuffix(" Done <tool"))
    async with fake_gateway(model_dir, tokenizer, scheduler, enable_auto_tool_choice=True,
                            tool_call_parser="hermes") as gw:
        async with openai_client(gw.url) as client:
            whole = await client.chat.completions.create(
                model=model_dir, messages=MESSAGES, tools=TOOLS, max_tokens=200)
            stream = await client.chat.completions.create(
                model=model_dir, messages=MESSAGES, tools=TOOLS, max_tokens=200, stream=True)
            chunks = [c async for c in stream]
    choice = whole.choices[0]
    assert choice.finish_reason == "tool_calls"
    assert choice.message.content == "Let me look. "
    calls = [(c.function.name, json.loads(c.function.arguments))
             for c in choice.message.tool_calls]
    assert calls == [("get_weather", {"city": "Paris", "days": 2}), ("add", {"a": 1, "b": 2})]
    assert len({c.id for c in choice.message.tool_calls}) == 2
    streamed: dict[int, list] = {}
    content = ""
    for chunk in chunks:
        for c in chunk.choices:
            content += c.delta.content or ""
            for d in c.delta.tool_calls or []:
                entry = streamed.setdefault(d.index, [d.function.name, ""])
                entry[1] += d.function.arguments or ""
    assert content == "Let me look. "
    assert [(n, json.loads(a)) for n, a in streamed.values()] == calls
    assert chunks[-1].choices[0].finish_reason == "tool_calls"
    # the tools reached the scheduler's prompt through the chat template, no grammar forced
    assert gw.scheduler.requests[0].sampling.grammar == ""


async def test_required_and_named_choices_send_their_grammar(model_dir: str,
                                                             tokenizer: Tokenizer) -> None:
    scheduler = script(tokenizer, '[{"name": "add", "parameters": {"a": 1, "b": 2}}]')
    async with fake_gateway(model_dir, tokenizer, scheduler) as gw:
        async with openai_client(gw.url) as client:
            required = await client.chat.completions.create(
                model=model_dir, messages=MESSAGES, tools=TOOLS, tool_choice="required",
                max_tokens=200)
            named = await client.chat.completions.create(
                model=model_dir, messages=MESSAGES, tools=TOOLS, max_tokens=200,
                tool_choice={"type": "function", "function": {"name": "add"}})
    call = required.choices[0].message.tool_calls[0]
    assert (call.function.name, json.loads(call.function.arguments)) == ("add", {"a": 1, "b": 2})
    assert required.choices[0].finish_reason == "tool_calls"
    # named: the whole output is the arguments (here the scripted array), finish_reason stop
    named_call = named.choices[0].message.tool_calls[0]
    assert named_call.function.name == "add" and named.choices[0].finish_reason == "stop"
    grammars = [r.sampling.grammar for r in gw.scheduler.requests]
    assert all(grammars) and grammars[0] != grammars[1]


@pytest.mark.parametrize("body, param", [
    ({"tools": TOOLS}, "tool_choice"),  # auto, without --enable-auto-tool-choice
    ({"tool_choice": "required"}, None),
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "mul"}}}, None),
    ({"tools": TOOLS, "tool_choice": "required",
      "response_format": {"type": "json_object"}}, "tool_choice"),
    ({"tools": [{"type": "function", "function": {"name": ""}}]}, None),
])
async def test_tool_requests_that_cannot_be_honoured_are_400(model_dir: str, tokenizer: Tokenizer,
                                                           body: dict, param: str | None) -> None:
    async with fake_gateway(model_dir, tokenizer) as gw:
        async with http_client(gw.url) as http:
            r = await http.post("/v1/chat/completions",
                                json={"messages": MESSAGES, "max_tokens": 5, **body})
    assert r.status_code == 400, r.text
    if param is not None:
        assert r.json()["error"]["param"] == param


async def test_tool_call_history_reaches_the_template(model_dir: str, tokenizer: Tokenizer) -> None:
    history = MESSAGES + [
        {"role": "assistant", "content": None, "tool_calls": [{
            "id": "call-1", "type": "function",
            "function": {"name": "add", "arguments": '{"a": 1, "b": 2}'}}]},
        {"role": "tool", "tool_call_id": "call-1", "content": "3"}]
    async with fake_gateway(model_dir, tokenizer) as gw:
        async with http_client(gw.url) as http:
            ok = await http.post("/v1/chat/completions", json={
                "messages": history, "tools": TOOLS, "tool_choice": "none", "max_tokens": 3})
            bad = await http.post("/v1/chat/completions", json={
                "messages": [history[0], {**history[1], "tool_calls": [{
                    "id": "c", "type": "function",
                    "function": {"name": "add", "arguments": "{not json"}}]}],
                "max_tokens": 3})
    assert ok.status_code == 200, ok.text
    assert ok.json()["choices"][0]["message"]["tool_calls"] == []
    prompt = tokenizer.decode(list(gw.scheduler.requests[0].prompt_token_ids),
                              skip_special_tokens=False)
    assert "What is the weather in Paris?" in prompt and "3" in prompt
    assert bad.status_code == 400
