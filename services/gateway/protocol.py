"""Request models: OpenAI's completions and chat completions, plus vLLM's extensions.

Unknown fields are ignored, like OpenAI. Range checks live here so that every bad parameter
is a pydantic error, which errors.py turns into a 400 naming the field.
"""

from __future__ import annotations

import json
from typing import Annotated, Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    StrictInt,
    StrictStr,
    ValidationError,
    ValidationInfo,
    field_validator,
    model_validator,
)

from services.gateway.protocol_guided import (
    ChatTool,
    NamedToolChoice,
    OpenAIBaseModel,
    ResponseFormat,
    StructuredOutputsParams,
    template_tools,
)
from services.gateway.tools import forced_schema

MAX_N = 128
MAX_LOGPROBS = 20
MAX_LOGIT_BIAS = 100.0  # OpenAI's bound on each bias, either way
INT32 = 2**31
INT64 = 2**63

PromptInput = StrictStr | list[StrictStr] | list[StrictInt] | list[list[StrictInt]]


class StreamOptions(OpenAIBaseModel):
    include_usage: bool = False
    continuous_usage_stats: bool = False


class SamplingRequest(OpenAIBaseModel):
    """Fields shared by both generation APIs."""

    model: str | None = None
    n: int = Field(1, ge=1, le=MAX_N)
    stream: bool = False
    stream_options: StreamOptions | None = None
    max_tokens: int | None = Field(None, ge=1, lt=INT32)
    temperature: float | None = Field(None, ge=0)
    top_p: float | None = Field(None, gt=0, le=1)
    presence_penalty: float = Field(0.0, ge=-2, le=2)
    frequency_penalty: float = Field(0.0, ge=-2, le=2)
    seed: int | None = Field(None, ge=-INT64, lt=INT64)
    stop: str | list[str] | None = None
    user: str | None = None
    logit_bias: dict[str, float] | None = None
    # vLLM extensions
    top_k: int | None = Field(None, ge=-1, lt=INT32)
    min_p: float | None = Field(None, ge=0, le=1)
    repetition_penalty: float | None = Field(None, gt=0)
    min_tokens: int = Field(0, ge=0, lt=INT32)
    ignore_eos: bool = False
    stop_token_ids: list[Annotated[int, Field(ge=0, lt=INT32)]] | None = None
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    return_token_ids: bool = False
    priority: int = Field(0, ge=-INT32, lt=INT32)
    cache_salt: str | None = None  # isolates this request's prefix-cache entries
    prompt_logprobs: int | None = Field(None, le=MAX_LOGPROBS)  # each prompt token's + top k
    # structured outputs (structured_outputs.py): OpenAI's, vLLM's, and vLLM's older names
    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputsParams | None = None
    guided_json: str | dict[str, Any] | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    guided_decoding_backend: str | None = None
    guided_whitespace_pattern: str | None = None

    @field_validator("logit_bias")
    @classmethod
    def _check_logit_bias(cls, value: dict[str, float] | None) -> dict[str, float] | None:
        """Keys are token ids (JSON keys are strings); the vocabulary bound is checked against
        the tokenizer once the request reaches the model (flow.py)."""
        for key, bias in (value or {}).items():
            if not key.strip().isdecimal():
                raise ValueError(f"logit_bias keys must be token ids (non-negative integers), "
                                 f"got {key!r}")
            if not -MAX_LOGIT_BIAS <= bias <= MAX_LOGIT_BIAS:
                raise ValueError(f"logit_bias values must be between {-MAX_LOGIT_BIAS:g} and "
                                 f"{MAX_LOGIT_BIAS:g}, got {bias:g} for token {key.strip()}")
        return value

    @field_validator("prompt_logprobs")
    @classmethod
    def _check_prompt_logprobs(cls, value: int | None, info: ValidationInfo) -> int | None:
        if value == -1:  # vLLM's "the whole vocabulary", past its default --max-logprobs too
            raise ValueError(f"prompt_logprobs -1 asks for every token of the vocabulary; at "
                             f"most {MAX_LOGPROBS} are reported per token")
        if value is not None and value < 0:
            raise ValueError("prompt_logprobs must be >= 0")
        if value and info.data.get("stream"):  # as vLLM's: no streamed shape carries them
            raise ValueError("`prompt_logprobs` are not available when `stream=True`.")
        return value

    def logit_bias_pairs(self) -> tuple[tuple[int, float], ...]:
        """(token id, bias), sorted by id, as SamplingParams carries them."""
        return tuple(sorted((int(k), b) for k, b in (self.logit_bias or {}).items()))

    @model_validator(mode="after")
    def _check_sampling(self) -> SamplingRequest:
        if self.stream_options is not None and not self.stream:
            raise ValueError("stream_options can only be set when stream is true")
        limit = self.requested_max_tokens()
        if limit is not None and self.min_tokens > limit:
            raise ValueError(f"min_tokens ({self.min_tokens}) must be <= max_tokens ({limit})")
        if self.cache_salt is not None and not self.cache_salt:
            raise ValueError("cache_salt must be a non-empty string")
        return self

    def requested_max_tokens(self) -> int | None:
        return self.max_tokens

    def forced_tool_schema(self) -> dict[str, Any] | None:
        """The schema tool_choice holds the output to (chat completions only)."""
        return None

    def stop_strings(self) -> list[str]:
        if self.stop is None:
            return []
        stops = [self.stop] if isinstance(self.stop, str) else self.stop
        return [s for s in stops if s]

    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage

    def continuous_usage(self) -> bool:
        """Usage on every streamed chunk: vLLM's continuous_usage_stats, which, as there, needs
        include_usage too."""
        return self.include_usage() and bool(
            self.stream_options and self.stream_options.continuous_usage_stats)


class CompletionRequest(SamplingRequest):
    prompt: PromptInput
    max_tokens: int | None = Field(None, ge=0, lt=INT32)  # 0: with echo, score the prompt alone
    echo: bool = False
    logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    suffix: str | None = None
    best_of: int | None = Field(None, ge=1, le=MAX_N)
    add_special_tokens: bool = True

    @field_validator("prompt", mode="wrap")
    @classmethod
    def _check_prompt(cls, value: Any, handler: Any) -> Any:
        try:
            prompt = handler(value)
        except ValidationError:
            raise ValueError(
                "prompt must be a string, a list of strings, a list of token ids "
                "or a list of lists of token ids"
            ) from None
        if isinstance(prompt, list) and (not prompt or any(p in ("", []) for p in prompt)):
            raise ValueError("prompt must not be empty")
        if prompt == "":
            raise ValueError("prompt must not be empty")
        return prompt

    @field_validator("suffix")
    @classmethod
    def _check_suffix(cls, value: str | None) -> str | None:
        if value:
            raise ValueError(
                "suffix is not supported: inserting the completion before a suffix "
                "(fill-in-the-middle) needs a FIM prompt format, which pdserve does not build "
                "for any model; send the text before the insertion point as the prompt instead"
            )
        return value

    @model_validator(mode="after")
    def _check_unsupported(self) -> CompletionRequest:
        if self.best_of is not None and self.best_of < self.n:
            raise ValueError("best_of must be greater than or equal to n")
        if self.best_of is not None and self.best_of > self.n and self.stream:
            raise ValueError("best_of > n cannot be streamed")
        return self

    def scores_only(self) -> bool:
        """echo with max_tokens 0, as vLLM: the prompt (and its logprobs), no completion."""
        return self.echo and self.max_tokens == 0

    def requested_max_tokens(self) -> int | None:
        return 1 if self.scores_only() else self.max_tokens  # the one token is not reported

    def num_prompt_logprobs(self) -> int:
        """-1: none; otherwise the top-k the workers report per prompt token (echo with logprobs
        shows them in `logprobs`, prompt_logprobs in vLLM's own field)."""
        wanted = [self.logprobs if self.echo and self.logprobs is not None else -1,
                  -1 if self.prompt_logprobs is None else self.prompt_logprobs]
        return max(wanted)


class ContentPart(BaseModel):
    model_config = ConfigDict(extra="allow")
    type: str
    text: str | None = None


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")  # name, tool_calls, ... reach the chat template
    role: str = Field(min_length=1)
    content: str | list[ContentPart] | None = None

    @model_validator(mode="after")
    def _check_template_input(self) -> ChatMessage:
        """Unsupported content parts and tool call arguments that are not JSON are a 400 for
        every request that carries messages (chat completions and /tokenize alike)."""
        self.for_template()
        return self

    def for_template(self) -> dict:
        """The message as the chat template sees it: content flattened to text, and the
        arguments of an assistant's tool calls as objects (templates write them with tojson),
        where the API carries them as JSON text."""
        message = self.model_dump(exclude_none=True)
        for call in message.get("tool_calls") or ():
            function = call.get("function") if isinstance(call, dict) else None
            if isinstance(function, dict) and isinstance(function.get("arguments"), str):
                try:
                    function["arguments"] = json.loads(function["arguments"])
                except json.JSONDecodeError:
                    raise ValueError("tool call arguments must be JSON text") from None
        if isinstance(self.content, list):
            texts = []
            for part in self.content:
                if part.type not in ("text", "input_text") or part.text is None:
                    raise ValueError(f"content part type {part.type!r} is not supported")
                texts.append(part.text)
            message["content"] = "\n".join(texts)
        elif self.content is None:
            message["content"] = ""
        return message


class ChatCompletionRequest(SamplingRequest):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1, lt=INT32)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    add_special_tokens: bool = False
    chat_template_kwargs: dict[str, Any] | None = None
    tools: list[ChatTool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool = True

    def requested_max_tokens(self) -> int | None:
        return self.max_completion_tokens or self.max_tokens

    def num_logprobs(self) -> int:
        """-1: none; otherwise the top-k to report (0: the sampled token only)."""
        return (self.top_logprobs or 0) if self.logprobs else -1

    def resolved_tool_choice(self) -> str | NamedToolChoice:
        """OpenAI's default: auto with tools, none without."""
        if self.tool_choice is not None:
            return self.tool_choice
        return "auto" if self.tools else "none"

    def forced_tool_schema(self) -> dict[str, Any] | None:
        choice = self.resolved_tool_choice()
        if choice in ("none", "auto"):
            return None
        return forced_schema(template_tools(self.tools) or [],
                             choice.model_dump() if isinstance(choice, NamedToolChoice)
                             else choice, self.parallel_tool_calls)

    @model_validator(mode="after")
    def _check_chat(self) -> ChatCompletionRequest:
        if self.top_logprobs and not self.logprobs:
            raise ValueError("top_logprobs requires logprobs to be true")
        choice = self.tool_choice
        if choice not in (None, "none", "auto") and not self.tools:
            raise ValueError("tool_choice other than none and auto needs tools")
        names = [t.function.name for t in self.tools or ()]
        if isinstance(choice, NamedToolChoice) and choice.function.name not in names:
            raise ValueError(f"tool_choice names {choice.function.name!r}, which is not among "
                             f"the tools ({', '.join(names)})")
        return self


class TokenizeCompletionRequest(OpenAIBaseModel):
    model: str | None = None
    prompt: str
    add_special_tokens: bool = True
    return_token_strs: bool = False


class TokenizeChatRequest(OpenAIBaseModel):
    model: str | None = None
    messages: list[ChatMessage] = Field(min_length=1)
    tools: list[ChatTool] | None = None
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    add_special_tokens: bool = False
    chat_template_kwargs: dict[str, Any] | None = None
    return_token_strs: bool = False


class DetokenizeRequest(OpenAIBaseModel):
    model: str | None = None
    tokens: list[StrictInt]

