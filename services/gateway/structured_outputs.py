"""Structured outputs: every form a client may ask in, turned into one EBNF grammar text
(SamplingParams.grammar) that the workers compile against the model's vocabulary (xgrammar).

    response_format    {"type": "json_object"} | {"type": "json_schema", "json_schema": {...}}
    structured_outputs vLLM's: json | regex | choice | grammar | json_object
    guided_*           vLLM's older names: guided_json, guided_regex, guided_choice,
                       guided_grammar
    tool_choice        "required" or a named function (tools.py)

At most one per request. A schema, regex or grammar the engine cannot handle is a 400 here,
before any worker sees it. JSON schemas are strict, as OpenAI's strict mode and vLLM's xgrammar
backend: an object takes no property its schema does not name. Whitespace between JSON tokens
is free unless the request or the server (`--structured-outputs-config`) disables it; a small
model can fill its whole budget with it.
"""

from __future__ import annotations

import functools
import json
import re
from dataclasses import dataclass, fields
from typing import Any

from common import torch_free
from services.gateway.errors import bad_request
from services.gateway.protocol import SamplingRequest

BACKENDS = ("auto", "xgrammar")
# xgrammar prefixes its messages with "[hh:mm:ss] /path/file.cc:line: "
_ENGINE_PREFIX = re.compile(r"^\[[\d:]+\] \S+:\d+: ")


@dataclass(frozen=True)
class StructuredOutputsConfig:
    """The server's `--structured-outputs-config` (a JSON object, vLLM's keys)."""
    backend: str = "auto"  # the grammar engine: xgrammar, the one pdserve serves with
    disable_any_whitespace: bool = False  # JSON without free whitespace, for every request

    def __post_init__(self) -> None:
        if not isinstance(self.disable_any_whitespace, bool):
            raise ValueError("--structured-outputs-config: disable_any_whitespace must be true "
                             f"or false, got {self.disable_any_whitespace!r}")
        if self.backend not in BACKENDS:
            raise ValueError(f"structured outputs backend {self.backend!r}: pdserve serves "
                             f"with xgrammar (choose from {', '.join(BACKENDS)})")

    @classmethod
    def parse(cls, text: str) -> StructuredOutputsConfig:
        if not text:
            return cls()
        try:
            given = json.loads(text)
        except json.JSONDecodeError as e:
            raise ValueError(f"--structured-outputs-config is not JSON: {e}") from None
        known = {f.name for f in fields(cls)}
        if not isinstance(given, dict) or set(given) - known:
            raise ValueError(f"--structured-outputs-config takes a JSON object with keys "
                             f"{sorted(known)}, got {text}")
        return cls(**given)


@dataclass(frozen=True)
class _Ask:
    kind: str    # json | json_object | regex | choice | grammar
    spec: str    # the schema as JSON text, the regex, the choices as a JSON list, the EBNF
    param: str   # the field it came in, for the 400


def request_grammar(req: SamplingRequest, config: StructuredOutputsConfig) -> str:
    """The EBNF the request's output must match; "" when it asks for none."""
    asks = _asks(req)
    if not asks:
        return ""
    if len(asks) > 1:
        raise bad_request("Only one kind of structured output may be asked per request; got "
                          + ", ".join(a.param for a in asks), asks[1].param)
    ask = asks[0]
    options = req.structured_outputs
    for given, param in ((options and options.whitespace_pattern,
                          "structured_outputs.whitespace_pattern"),
                         (req.guided_whitespace_pattern, "guided_whitespace_pattern")):
        if given is not None:
            raise bad_request("whitespace_pattern is not supported by the xgrammar engine; use "
                              "disable_any_whitespace", param)
    if req.guided_decoding_backend not in (None, *BACKENDS):
        raise bad_request(f"guided_decoding_backend {req.guided_decoding_backend!r}: pdserve "
                          "serves structured outputs with xgrammar", "guided_decoding_backend")
    any_whitespace = not (config.disable_any_whitespace
                          or (options is not None and options.disable_any_whitespace))
    try:
        return _grammar(ask.kind, ask.spec, any_whitespace)
    except RuntimeError as e:  # what xgrammar raises for what it cannot parse or support
        message = _ENGINE_PREFIX.sub("", str(e).strip())
        raise bad_request(f"The {ask.param} cannot be served as a grammar: {message}",
                          ask.param) from None
    except UnicodeDecodeError:  # xgrammar's message quoting the text was cut inside a character
        message = "it does not parse (the parser's message could not be decoded)"
        raise bad_request(f"The {ask.param} cannot be served as a grammar: {message}",
                          ask.param) from None


def _asks(req: SamplingRequest) -> list[_Ask]:
    asks = []
    fmt = req.response_format
    if fmt is not None and fmt.type == "json_object":
        asks.append(_Ask("json_object", "", "response_format"))
    elif fmt is not None and fmt.type == "json_schema":
        if fmt.json_schema is None or fmt.json_schema.schema_ is None:
            raise bad_request("response_format of type json_schema needs json_schema.schema",
                              "response_format")
        asks.append(_Ask("json", json.dumps(fmt.json_schema.schema_), "response_format"))
    so = req.structured_outputs
    if so is not None:
        if so.json_ is not None:
            asks.append(_Ask("json", _schema_text(so.json_, "structured_outputs.json"),
                             "structured_outputs.json"))
        if so.json_object:
            asks.append(_Ask("json_object", "", "structured_outputs.json_object"))
        for kind in ("regex", "choice", "grammar"):
            if getattr(so, kind) is not None:
                asks.append(_spec(kind, getattr(so, kind), f"structured_outputs.{kind}"))
        if so.structural_tag is not None:
            raise bad_request("structural_tag is not supported",
                              "structured_outputs.structural_tag")
    tool_schema = req.forced_tool_schema()
    if tool_schema is not None:
        asks.append(_Ask("json", json.dumps(tool_schema), "tool_choice"))
    if req.guided_json is not None:
        asks.append(_Ask("json", _schema_text(req.guided_json, "guided_json"), "guided_json"))
    for kind in ("regex", "choice", "grammar"):
        if (value := getattr(req, f"guided_{kind}")) is not None:
            asks.append(_spec(kind, value, f"guided_{kind}"))
    return asks


def _spec(kind: str, value: Any, param: str) -> _Ask:
    if kind == "choice":
        if not value:
            raise bad_request("choice needs at least one string", param)
        return _Ask(kind, json.dumps(value), param)
    return _Ask(kind, value, param)


def _schema_text(schema: str | dict[str, Any], param: str) -> str:
    if isinstance(schema, dict):
        return json.dumps(schema)
    try:
        json.loads(schema)
    except json.JSONDecodeError as e:
        raise bad_request(f"{param} is not a JSON schema: {e}", param) from None
    return schema


@functools.lru_cache(maxsize=256)
def _grammar(kind: str, spec: str, any_whitespace: bool) -> str:
    """EBNF text of one ask; raises RuntimeError (xgrammar's) for one it cannot serve.
    xgrammar is imported here, at the first guided request, not when the gateway starts: its
    package imports torch, which a gateway process otherwise keeps out (torch_free.py)."""
    torch_free.let_in()
    import xgrammar as xgr
    if kind == "json":
        ebnf = str(xgr.Grammar.from_json_schema(spec, any_whitespace=any_whitespace))
        grammar = xgr.Grammar.from_ebnf(ebnf.replace(_BOUNDED_STRING_CHARS, _JSON_STRING_CHARS))
    elif kind == "json_object":
        grammar = xgr.Grammar.from_json_schema('{"type": "object"}',
                                               any_whitespace=any_whitespace)
    elif kind == "regex":
        grammar = xgr.Grammar.from_regex(spec)
    elif kind == "choice":
        choices = " | ".join(_ebnf_literal(c) for c in json.loads(spec))
        grammar = xgr.Grammar.from_ebnf(f"root ::= {choices}")
    else:
        assert kind == "grammar", kind
        grammar = xgr.Grammar.from_ebnf(spec)
    return str(grammar)


# xgrammar 0.2.8 writes the characters of a length-bounded JSON string as this class, which
# admits raw control characters (a tab, 0x1c) that JSON strings may not hold; the second is the
# class JSON allows unescaped (such a string still holds no escape, as xgrammar has it)
_BOUNDED_STRING_CHARS = r'[^\"\\\r\n]'
_JSON_STRING_CHARS = r'[^\0-\x1f\"\\]'


def _ebnf_literal(text: str) -> str:
    """An EBNF sequence matching exactly `text`: a literal per character (JSON's escapes are
    EBNF's), since xgrammar 0.2.8 mis-compiles one literal holding several multi-byte
    characters among others ("\u00fcn\u00efc" refuses its own tokens)."""
    return ("(" + " ".join(json.dumps(ch, ensure_ascii=False) for ch in text) + ")"
            if text else '""')
