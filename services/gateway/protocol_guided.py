"""Request models of structured outputs and tools, shared by both generation APIs
(protocol.py); structured_outputs.py and tools.py give them meaning."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field


class OpenAIBaseModel(BaseModel):
    model_config = ConfigDict(extra="ignore", allow_inf_nan=False)


class JsonSchemaFormat(OpenAIBaseModel):
    model_config = ConfigDict(extra="ignore", populate_by_name=True)
    name: str | None = None
    description: str | None = None
    schema_: dict[str, Any] | None = Field(None, alias="schema")
    strict: bool | None = None


class ResponseFormat(OpenAIBaseModel):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class StructuredOutputsParams(OpenAIBaseModel):
    """vLLM's `structured_outputs`: one of json, regex, choice, grammar, json_object."""
    json_: str | dict[str, Any] | None = Field(None, alias="json")
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    disable_any_whitespace: bool = False
    # objects take no property their schema does not name whatever this says (strict schemas)
    disable_additional_properties: bool = False
    whitespace_pattern: str | None = None  # refused: xgrammar has no whitespace pattern
    structural_tag: str | None = None  # refused

    model_config = ConfigDict(extra="ignore", populate_by_name=True)

class FunctionDefinition(OpenAIBaseModel):
    name: str = Field(min_length=1)
    description: str | None = None
    parameters: dict[str, Any] | None = None  # a JSON schema; none: no parameters
    strict: bool | None = None


class ChatTool(OpenAIBaseModel):
    type: Literal["function"] = "function"
    function: FunctionDefinition


class FunctionName(OpenAIBaseModel):
    name: str


class NamedToolChoice(OpenAIBaseModel):
    type: Literal["function"] = "function"
    function: FunctionName


def template_tools(tools: list[ChatTool] | None) -> list[dict[str, Any]] | None:
    """Tools as chat templates take them (OpenAI's JSON)."""
    return [t.model_dump(exclude_none=True) for t in tools] if tools else None
