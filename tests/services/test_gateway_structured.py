"""Structured outputs at the gateway against the fake scheduler: every form a client may ask in
(OpenAI's response_format, vLLM's structured_outputs and its older guided_* fields) reaches the
scheduler as one grammar, SamplingParams.grammar, which an xgrammar matcher compiled against the
model's tokenizer (as the workers compile it) accepts for an output the request allows and refuses
for one it does not; choices match exactly whatever characters they hold; disabling free
whitespace (per request or for the server) refuses whitespace between JSON tokens; what cannot be
served is a 400 naming the field, before the scheduler sees anything.
"""

from __future__ import annotations

import json

import httpx
import jsonschema
import pytest
import xgrammar as xgr
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from services.gateway.structured_outputs import StructuredOutputsConfig, _grammar
from services.gateway.tokenizer import Tokenizer
from tests.json_schemas import ARRAYS, LEAVES, compact, instances, objects
from tests.services.fake_scheduler import FakeGateway, fake_gateway, http_client, openai_client
from tests.services.test_gateway import CHAT_MESSAGES, encode

pytestmark = pytest.mark.anyio

POINT = {
    "type": "object",
    "properties": {"x": {"type": "integer"}, "y": {"type": "integer", "minimum": -9}},
    "required": ["x", "y"],
}
EBNF = 'root ::= "(" num ("," num)* ")"\nnum ::= [0-9]+'
REGEX = r"\d{3}-[a-z]+"

# (what the request asks, an output it allows, one it does not)
FORMS = {
    "response_format json_object": (
        {"response_format": {"type": "json_object"}}, '{"a": [1, "x"]}', "[1]"),
    "response_format json_schema": (
        {"response_format": {"type": "json_schema",
                             "json_schema": {"name": "point", "schema": POINT}}},
        '{"x": 1, "y": -2}', '{"x": 1, "y": -20}'),
    "structured_outputs.json": (
        {"structured_outputs": {"json": POINT}}, '{"x": 1, "y": 2}', '{"x": 1}'),
    "structured_outputs.json as text": (
        {"structured_outputs": {"json": json.dumps(POINT)}}, '{"x": 1, "y": 2}',
        '{"x": 1, "y": 2, "z": 3}'),  # strict: no property the schema does not name
    "structured_outputs.json_object": (
        {"structured_outputs": {"json_object": True}}, "{}", '"x"'),
    "structured_outputs.regex": (
        {"structured_outputs": {"regex": REGEX}}, "123-abc", "12-abc"),
    "structured_outputs.choice": (
        {"structured_outputs": {"choice": ["red", "green"]}}, "green", "gree"),
    "structured_outputs.grammar": (
        {"structured_outputs": {"grammar": EBNF}}, "(1,22)", "(1,)"),
    "guided_json": ({"guided_json": POINT}, '{"x": 7, "y": 0}', '{"x": "7", "y": 0}'),
    "guided_json as text": (
        {"guided_json": json.dumps(POINT)}, '{"x": 1, "y": 2}', '{"x": 1.5, "y": 2}'),
    "guided_regex": (
        {"guided_regex": REGEX, "guided_decoding_backend": "xgrammar"}, "007-x", "007-X"),
    "guided_choice": ({"guided_choice": ["yes", "no"]}, "no", "yes no"),
    "guided_grammar": ({"guided_grammar": EBNF}, "(5)", "5"),
}
CHOICES = ['say "hi"', "back\\slash", "two\nlines", "ünïcode ✓", "plain"]


@pytest.fixture(scope="module")
def compiler(tokenizer: Tokenizer) -> xgr.GrammarCompiler:
    """Against the model's vocabulary, as the workers compile a request's grammar."""
    info = xgr.TokenizerInfo.from_huggingface(tokenizer.hf, vocab_size=tokenizer.vocab_size)
    return xgr.GrammarCompiler(info, max_threads=1)


def accepts(compiler: xgr.GrammarCompiler, tokenizer: Tokenizer, grammar: str,
            text: str) -> bool:
    """Whether a worker's matcher would take `text`'s tokens, then an eos."""
    assert grammar
    eos = tokenizer.eos_token_ids
    matcher = xgr.GrammarMatcher(compiler.compile_grammar(grammar), override_stop_tokens=eos)
    return all(matcher.accept_token(t) for t in encode(tokenizer, text)) and \
        matcher.accept_token(eos[0])


async def grammars_of(gw: FakeGateway, fields: dict) -> list[str]:
    """The grammar each sample of the request reached the scheduler with, through the
    completions API and then the chat API."""
    grammars = []
    async with http_client(gw.url) as http:
        for path, body in (("/v1/completions", {"prompt": "a point:"}),
                           ("/v1/chat/completions", {"messages": CHAT_MESSAGES})):
            sent = len(gw.scheduler.requests)
            response = await http.post(path, json={**body, **fields, "max_tokens": 2, "n": 2})
            assert response.status_code == 200, response.text
            grammars += [r.sampling.grammar for r in gw.scheduler.requests[sent:]]
    assert len(grammars) == 4
    return grammars


@pytest.mark.parametrize("form", FORMS)
async def test_each_form_reaches_the_scheduler_as_a_grammar_of_what_it_allows(
    model_dir: str, tokenizer: Tokenizer, compiler: xgr.GrammarCompiler, form: str
) -> None:
    fields, valid, invalid = FORMS[form]
    async with fake_gateway(model_dir, tokenizer) as gw:
        grammar, *others = await grammars_of(gw, fields)
    assert others == [grammar] * 3
    assert accepts(compiler, tokenizer, grammar, valid)
    assert not accepts(compiler, tokenizer, grammar, invalid)


async def test_no_form_and_text_format_ask_for_no_grammar(
    model_dir: str, tokenizer: Tokenizer
) -> None:
    async with fake_gateway(model_dir, tokenizer) as gw:
        assert await grammars_of(gw, {}) == [""] * 4
        assert await grammars_of(gw, {"response_format": {"type": "text"}}) == [""] * 4


async def test_openai_client_response_format(
    model_dir: str, tokenizer: Tokenizer, compiler: xgr.GrammarCompiler
) -> None:
    async with fake_gateway(model_dir, tokenizer) as gw:
        async with openai_client(gw.url) as client:
            await client.chat.completions.create(
                model=model_dir, messages=CHAT_MESSAGES, max_tokens=2,
                response_format={"type": "json_schema", "json_schema": {
                    "name": "point", "schema": POINT, "strict": True}})
            await client.completions.create(
                model=model_dir, prompt="a point:", max_tokens=2,
                extra_body={"structured_outputs": {"choice": CHOICES}})
    chat, completion = (r.sampling.grammar for r in gw.scheduler.requests)
    assert accepts(compiler, tokenizer, chat, '{"x": 3, "y": 4}')
    assert not accepts(compiler, tokenizer, chat, '{"x": 3, "y": -10}')
    assert accepts(compiler, tokenizer, completion, CHOICES[3])


@pytest.mark.parametrize("field", ["guided_choice", "structured_outputs.choice"])
async def test_choices_match_exactly_each_choice_whatever_it_holds(
    model_dir: str, tokenizer: Tokenizer, compiler: xgr.GrammarCompiler, field: str
) -> None:
    fields = ({"guided_choice": CHOICES} if field == "guided_choice"
              else {"structured_outputs": {"choice": CHOICES}})
    async with fake_gateway(model_dir, tokenizer) as gw:
        grammar = (await grammars_of(gw, fields))[0]
    for choice in CHOICES:
        assert accepts(compiler, tokenizer, grammar, choice), choice
        assert not accepts(compiler, tokenizer, grammar, choice + choice[-1]), choice
        assert not accepts(compiler, tokenizer, grammar, choice[:-1]), choice
    for near in ['say \\"hi\\"', "say hi", "back\\\\slash", "two\\nlines", "unicode ✓",
                 "ünïcode", "", "plain\n", json.dumps(CHOICES[0])]:
        assert not accepts(compiler, tokenizer, grammar, near), near


async def test_a_choice_beyond_the_basic_plane_matches_itself(
    model_dir: str, tokenizer: Tokenizer, compiler: xgr.GrammarCompiler
) -> None:
    async with fake_gateway(model_dir, tokenizer) as gw:
        grammar = (await grammars_of(gw, {"guided_choice": ["ok 😀", "𝔘"]}))[0]
    assert accepts(compiler, tokenizer, grammar, "ok 😀")
    assert accepts(compiler, tokenizer, grammar, "𝔘")


@pytest.mark.parametrize("max_length", [4, 300, 5000])  # long bounds must compile too
async def test_a_bounded_string_takes_no_raw_control_character(
    model_dir: str, tokenizer: Tokenizer, compiler: xgr.GrammarCompiler, max_length: int
) -> None:
    schema = {"type": "object", "required": ["a"], "properties": {
        "a": {"type": "string", "maxLength": max_length}}}
    async with fake_gateway(model_dir, tokenizer) as gw:
        grammar = (await grammars_of(gw, {"guided_json": schema}))[0]
    assert accepts(compiler, tokenizer, grammar, '{"a": "ok"}')
    for text in ('{"a": "\x1c"}', '{"a": "a\tb"}'):
        with pytest.raises(json.JSONDecodeError):
            json.loads(text)
        assert not accepts(compiler, tokenizer, grammar, text), text


SPACED = '{ "x": 1, "y": 2}', '{"x":  1, "y": 2}', '{"x": 1,\n"y": 2}', '{"x": 1, "y": 2 }'


async def test_disable_any_whitespace_per_request_refuses_whitespace_between_tokens(
    model_dir: str, tokenizer: Tokenizer, compiler: xgr.GrammarCompiler
) -> None:
    schema = {"type": "json_schema", "json_schema": {"name": "point", "schema": POINT}}
    async with fake_gateway(model_dir, tokenizer) as gw:
        free = (await grammars_of(gw, {"structured_outputs": {"json": POINT}}))[0]
        tight = (await grammars_of(gw, {"structured_outputs": {
            "json": POINT, "disable_any_whitespace": True}}))[0]
        tight_format = (await grammars_of(gw, {"response_format": schema, "structured_outputs": {
            "disable_any_whitespace": True}}))[0]
    assert all(accepts(compiler, tokenizer, free, text) for text in SPACED)
    for grammar in (tight, tight_format):
        assert accepts(compiler, tokenizer, grammar, '{"x": 1, "y": 2}')
        for text in SPACED:
            assert not accepts(compiler, tokenizer, grammar, text), text


async def test_disable_any_whitespace_for_the_server_holds_every_json_request(
    model_dir: str, tokenizer: Tokenizer, compiler: xgr.GrammarCompiler
) -> None:
    config = StructuredOutputsConfig(disable_any_whitespace=True)
    async with fake_gateway(model_dir, tokenizer, structured_outputs=config) as gw:
        schema = (await grammars_of(gw, FORMS["response_format json_schema"][0]))[0]
        guided = (await grammars_of(gw, {"guided_json": POINT}))[0]
        anything = (await grammars_of(gw, {"response_format": {"type": "json_object"}}))[0]
        regex = (await grammars_of(gw, {"guided_regex": "a [0-9]+"}))[0]
    for grammar in (schema, guided, anything):
        assert accepts(compiler, tokenizer, grammar, '{"x": 1, "y": 2}')
        for text in SPACED:
            assert not accepts(compiler, tokenizer, grammar, text), text
    assert accepts(compiler, tokenizer, regex, "a 12")  # a regex's own spaces stay


# (what the request asks, the param of its 400, a word of the message)
REFUSED = {
    "two forms": ({"response_format": {"type": "json_object"}, "guided_regex": "a"},
                  "guided_regex", "response_format"),
    "two forms in structured_outputs": ({"structured_outputs": {"regex": "a", "choice": ["a"]}},
                                        "structured_outputs.choice", "structured_outputs.regex"),
    "schema text not JSON": ({"guided_json": "{not json"}, "guided_json", "JSON"),
    "structured_outputs.json not JSON": ({"structured_outputs": {"json": "{"}},
                                         "structured_outputs.json", "JSON"),
    "JSON but no schema": ({"guided_json": "[1, 2]"}, "guided_json", "object"),
    "schema it cannot serve": ({"response_format": {"type": "json_schema", "json_schema": {
        "name": "n", "schema": {"type": "integer", "minimum": 5, "maximum": 1}}}},
        "response_format", "minimum"),
    "lookbehind": ({"guided_regex": "(?<=a)b"}, "guided_regex", "Lookbehind"),
    "structured_outputs lookbehind": ({"structured_outputs": {"regex": "x(?<=a)b"}},
                                      "structured_outputs.regex", "Lookbehind"),
    "bad EBNF": ({"guided_grammar": "root ::= ("}, "guided_grammar", "EBNF"),
    "EBNF whose error message splits a character": ({"guided_grammar": "\x80"},
                                                     "guided_grammar", "parse"),
    "EBNF without root": ({"structured_outputs": {"grammar": 'foo ::= "a"'}},
                          "structured_outputs.grammar", "root"),
    "whitespace_pattern": ({"structured_outputs": {"json": POINT, "whitespace_pattern": " *"}},
                           "structured_outputs.whitespace_pattern", "disable_any_whitespace"),
    "guided_whitespace_pattern": ({"guided_json": POINT, "guided_whitespace_pattern": " *"},
                                  "guided_whitespace_pattern", "disable_any_whitespace"),
    "structural_tag": ({"structured_outputs": {"structural_tag": "{}"}},
                       "structured_outputs.structural_tag", "structural_tag"),
    "json_schema without schema": ({"response_format": {"type": "json_schema",
                                                        "json_schema": {"name": "n"}}},
                                   "response_format", "schema"),
    "json_schema without json_schema": ({"response_format": {"type": "json_schema"}},
                                        "response_format", "schema"),
    "unknown format type": ({"response_format": {"type": "xml"}}, "response_format", "json_schema"),
    "unknown backend": ({"guided_regex": "a", "guided_decoding_backend": "outlines"},
                        "guided_decoding_backend", "xgrammar"),
    "no choice": ({"guided_choice": []}, "guided_choice", "choice"),
    "structured_outputs no choice": ({"structured_outputs": {"choice": []}},
                                     "structured_outputs.choice", "choice"),
}


async def test_what_cannot_be_served_is_a_400_naming_the_field(
    model_dir: str, tokenizer: Tokenizer
) -> None:
    async with fake_gateway(model_dir, tokenizer) as gw:
        async with http_client(gw.url) as http:
            for case, (fields, param, word) in REFUSED.items():
                for path, body in (("/v1/completions", {"prompt": "x"}),
                                   ("/v1/chat/completions", {"messages": CHAT_MESSAGES})):
                    response: httpx.Response = await http.post(path, json={**body, **fields})
                    assert response.status_code == 400, (case, path, response.text)
                    error = response.json()["error"]
                    assert error["param"] == param, (case, path, error)
                    assert word in error["message"], (case, path, error)
                    assert ".cc:" not in error["message"], (case, error)  # xgrammar's prefix
    assert gw.scheduler.requests == []


def test_server_config_parses_vllms_object_and_refuses_the_rest() -> None:
    assert StructuredOutputsConfig.parse("") == StructuredOutputsConfig()
    config = StructuredOutputsConfig.parse(
        '{"backend": "xgrammar", "disable_any_whitespace": true}')
    assert (config.backend, config.disable_any_whitespace) == ("xgrammar", True)
    for text, word in (("{not json", "not JSON"), ('{"whitespace": true}', "keys"),
                       ("[true]", "keys"), ('{"backend": "outlines"}', "xgrammar")):
        with pytest.raises(ValueError, match=word):
            StructuredOutputsConfig.parse(text)


def test_server_config_refuses_a_value_of_the_wrong_type() -> None:
    with pytest.raises(ValueError):
        StructuredOutputsConfig.parse('{"disable_any_whitespace": "false"}')


# -- every instance of a schema is a sentence of its grammar ------------------------------------

@settings(max_examples=80, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
def test_every_instance_of_a_schema_is_a_sentence_of_its_grammar(compiler, tokenizer, data):
    """The grammar of a random bounded schema takes each of its instances (in the schema's
    property order), as the e2e outputs show it takes nothing else."""
    schema = data.draw(SCHEMAS, label="schema")
    instance = data.draw(instances(schema), label="instance")
    jsonschema.validate(instance, schema)
    grammar = _grammar("json", json.dumps(schema), False)
    assert accepts(compiler, tokenizer, grammar, compact(instance, schema)), (schema, instance)


SCHEMAS = objects(st.one_of(LEAVES, ARRAYS, objects(st.one_of(LEAVES, ARRAYS))))
