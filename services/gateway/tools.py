"""Tool calling in chat completions: what `tool_choice` forces, and the parsers that find tool
calls in a choice's text.

    tool_choice "none"       tools reach the chat template; the output is content
    tool_choice "auto"       the model decides; `--tool-call-parser` finds its calls in the text
                             (needs `--enable-auto-tool-choice`, as vLLM)
    tool_choice "required"   a grammar holds the output to a JSON array of one or more calls
                             ([{"name": ..., "parameters": {...}}], one with
                             parallel_tool_calls false), each call's parameters to its schema
    a named function         a grammar holds the output to that function's parameters schema

Parsers take a choice's text deltas and give back content deltas and tool-call deltas, as the
OpenAI stream carries them (the first delta of a call has its index, id, type and name; later
ones add to its arguments). `hermes`: `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`
blocks among content; `llama3_json`: an output that is one or more `{"name": ...,
"parameters": {...}}` objects separated by `;`, after an optional `<|python_tag|>`.
"""

from __future__ import annotations

import json
import uuid
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Any

PARSERS = ("hermes", "llama3_json")


def tool_call_id() -> str:
    return f"chatcmpl-tool-{uuid.uuid4().hex}"


@dataclass
class CallDelta:
    """Part of tool call `index`: its first delta carries id and name, every one arguments."""
    index: int
    arguments: str = ""
    id: str | None = None
    name: str | None = None


@dataclass
class Parsed:
    content: str = ""
    calls: list[CallDelta] = field(default_factory=list)

    def __iadd__(self, other: Parsed) -> Parsed:
        self.content += other.content
        self.calls += other.calls
        return self


def forced_schema(tools: list[dict[str, Any]], choice: str | dict[str, Any],
                  parallel: bool) -> dict[str, Any] | None:
    """The JSON schema a tool_choice holds the output to; None when it forces nothing."""
    if isinstance(choice, dict):
        return _parameters(_function(tools, choice["function"]["name"]))
    if choice != "required":
        return None
    calls = [{"type": "object",
              "properties": {"name": {"type": "string", "enum": [f["function"]["name"]]},
                             "parameters": _parameters(f)},
              "required": ["name", "parameters"]} for f in tools]
    schema: dict[str, Any] = {"type": "array", "minItems": 1,
                              "items": calls[0] if len(calls) == 1 else {"anyOf": calls}}
    if not parallel:
        schema["maxItems"] = 1
    return schema


def _function(tools: list[dict[str, Any]], name: str) -> dict[str, Any]:
    for tool in tools:
        if tool["function"]["name"] == name:
            return tool
    raise KeyError(name)


def _parameters(tool: dict[str, Any]) -> dict[str, Any]:
    return tool["function"].get("parameters") or {"type": "object", "properties": {}}


class ToolParser(ABC):
    """One choice's text -> content and tool calls, delta by delta."""

    def __init__(self) -> None:
        self.num_calls = 0

    @abstractmethod
    def feed(self, text: str) -> Parsed:
        """The next text delta."""

    @abstractmethod
    def finish(self) -> Parsed:
        """The choice ended: what was held back."""

    def _call(self, name: str, arguments: Any) -> CallDelta:
        self.num_calls += 1
        text = arguments if isinstance(arguments, str) else json.dumps(arguments,
                                                                      ensure_ascii=False)
        return CallDelta(self.num_calls - 1, text, tool_call_id(), name)


class NamedParser(ToolParser):
    """tool_choice names a function: the whole output is its arguments, streamed as they come."""

    def __init__(self, name: str):
        super().__init__()
        self.name = name

    def feed(self, text: str) -> Parsed:
        if self.num_calls == 0:
            return Parsed(calls=[self._call(self.name, text)])
        return Parsed(calls=[CallDelta(0, text)] if text else [])

    def finish(self) -> Parsed:
        return self.feed("") if self.num_calls == 0 else Parsed()


class RequiredParser(ToolParser):
    """tool_choice "required": a JSON array of calls, parsed once whole. An output cut short
    (max_tokens) is content."""

    def __init__(self) -> None:
        super().__init__()
        self.text = ""

    def feed(self, text: str) -> Parsed:
        self.text += text
        return Parsed()

    def finish(self) -> Parsed:
        try:
            calls = json.loads(self.text)
        except json.JSONDecodeError:
            return Parsed(content=self.text)
        if not isinstance(calls, list) or not all(_is_call(c, "parameters") for c in calls):
            return Parsed(content=self.text)
        return Parsed(calls=[self._call(c["name"], c["parameters"]) for c in calls])


def _is_call(obj: Any, arguments: str) -> bool:
    return isinstance(obj, dict) and isinstance(obj.get("name"), str) and arguments in obj


class HermesParser(ToolParser):
    """Content streams; a `<tool_call>` block is held until its `</tool_call>`, then is a call
    (or, not a JSON call, content as written)."""

    OPEN, CLOSE = "<tool_call>", "</tool_call>"

    def __init__(self) -> None:
        super().__init__()
        self.pending = ""   # text not yet given back
        self.inside = False

    def feed(self, text: str) -> Parsed:
        self.pending += text
        out = Parsed()
        while True:
            if not self.inside:
                start = self.pending.find(self.OPEN)
                if start < 0:  # keep what may be the start of a tag
                    keep = _partial_suffix(self.pending, self.OPEN)
                    out.content += self.pending[:len(self.pending) - keep]
                    self.pending = self.pending[len(self.pending) - keep:]
                    return out
                out.content += self.pending[:start]
                self.pending = self.pending[start:]
                self.inside = True
            end = self.pending.find(self.CLOSE)
            if end < 0:
                return out
            block = self.pending[:end + len(self.CLOSE)]
            self.pending = self.pending[end + len(self.CLOSE):]
            self.inside = False
            out += self._block(block)

    def finish(self) -> Parsed:
        rest, self.pending = self.pending, ""
        return Parsed(content=rest)

    def _block(self, block: str) -> Parsed:
        body = block[len(self.OPEN):-len(self.CLOSE)]
        try:
            call = json.loads(body)
        except json.JSONDecodeError:
            return Parsed(content=block)
        if not _is_call(call, "arguments"):
            return Parsed(content=block)
        return Parsed(calls=[self._call(call["name"], call["arguments"])])


class Llama3JsonParser(ToolParser):
    """An output starting with `{` (after `<|python_tag|>`, if any) is held whole and parsed as
    calls at the end; any other output streams as content."""

    TAG = "<|python_tag|>"

    def __init__(self) -> None:
        super().__init__()
        self.text = ""
        self.mode = ""  # "": undecided, "content", "calls"

    def feed(self, text: str) -> Parsed:
        if self.mode == "content":
            return Parsed(content=text)
        self.text += text
        if self.mode == "":
            head = self.text.lstrip()
            if head.startswith(self.TAG):
                head = head[len(self.TAG):].lstrip()
            if not head or self.TAG.startswith(head):
                return Parsed()
            self.mode = "calls" if head.startswith("{") else "content"
            if self.mode == "content":
                text, self.text = self.text, ""
                return Parsed(content=text)
        return Parsed()

    def finish(self) -> Parsed:
        text, self.text = self.text, ""
        if self.mode != "calls":
            return Parsed(content=text)
        body = text.lstrip()
        body = body[len(self.TAG):] if body.startswith(self.TAG) else body
        decoder, calls, at = json.JSONDecoder(), [], 0
        try:
            while at < len(body):
                while at < len(body) and body[at] in " \t\r\n;":
                    at += 1
                if at == len(body):
                    break
                obj, at = decoder.raw_decode(body, at)
                key = "parameters" if isinstance(obj, dict) and "parameters" in obj \
                    else "arguments"
                if not _is_call(obj, key):
                    return Parsed(content=text)
                calls.append((obj["name"], obj[key]))
        except json.JSONDecodeError:
            return Parsed(content=text)
        return Parsed(calls=[self._call(name, args) for name, args in calls])


def _partial_suffix(text: str, tag: str) -> int:
    """Length of the longest suffix of text that is a proper prefix of tag."""
    for n in range(min(len(text), len(tag) - 1), 0, -1):
        if tag.startswith(text[-n:]):
            return n
    return 0


def create_parser(name: str) -> ToolParser:
    if name == "hermes":
        return HermesParser()
    if name == "llama3_json":
        return Llama3JsonParser()
    raise ValueError(f"unknown tool call parser {name!r}; known: {', '.join(PARSERS)}")
