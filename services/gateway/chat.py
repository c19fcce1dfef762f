"""POST /v1/chat/completions: messages -> chat template -> one prompt, n choices; tool calls
found in each choice's text by its parser (tools.py)."""

from __future__ import annotations

from collections.abc import Sequence

from fastapi import Request

from common.sampling_params import TokenLogprobs
from services.gateway.errors import bad_request
from services.gateway.flow import Generation
from services.gateway.generation import Choice, SeqDelta
from services.gateway.logprobs import chat_logprobs, vllm_prompt_logprobs
from services.gateway.protocol import ChatCompletionRequest, NamedToolChoice
from services.gateway.responses import (
    ChatChoice,
    ChatCompletionResponse,
    ChatCompletionStreamResponse,
    ChatDelta,
    ChatLogprobs,
    ChatMessageOut,
    ChatStreamChoice,
    DeltaFunctionCall,
    DeltaToolCall,
    FunctionCall,
    ToolCall,
    Usage,
)
from services.gateway.serving import ServingContext
from services.gateway.tools import (
    HermesParser,
    NamedParser,
    Parsed,
    RequiredParser,
    ToolParser,
    create_parser,
)


class ChatCompletion(Generation):
    """A ChatCompletionResponse, or chat.completion.chunk events that open with one
    assistant-role chunk per choice."""

    ID_PREFIX = "chatcmpl"
    body: ChatCompletionRequest

    def __init__(self, ctx: ServingContext, body: ChatCompletionRequest, raw: Request) -> None:
        super().__init__(ctx, body, raw)
        self.tool_choice = body.resolved_tool_choice()
        config = ctx.config
        if self.tool_choice == "auto" and body.tools and not config.enable_auto_tool_choice:
            raise bad_request('"auto" tool choice requires --enable-auto-tool-choice and '
                              "--tool-call-parser to be set", "tool_choice")
        self._parsers: dict[int, ToolParser] = {}
        if self.tool_choice == "auto" and body.tools and config.tool_call_parser == "hermes" \
                and HermesParser.OPEN in self.tokenizer.hf.get_added_vocab():
            body.skip_special_tokens = False  # the tags are special tokens: keep their text

    async def prompts(self) -> list[list[int]]:
        prompt_ids = await self.ctx.encode_chat(self.body)
        self.ctx.check_prompt(prompt_ids, "messages")
        return [prompt_ids]

    def num_logprobs(self) -> int:
        return self.body.num_logprobs()

    def num_prompt_logprobs(self) -> int:
        return -1 if self.body.prompt_logprobs is None else self.body.prompt_logprobs

    def response(self, choices: list[Choice]) -> ChatCompletionResponse:
        return_ids = self.body.return_token_ids
        return ChatCompletionResponse(
            id=self.request_id,
            model=self.model,
            choices=[
                ChatChoice(
                    index=choice.index,
                    message=self._message(choice),
                    logprobs=self._logprobs(choice.token_ids, choice.logprobs),
                    finish_reason=self._finish_reason(choice.index, choice.finish_reason),
                    stop_reason=choice.stop_reason,
                    token_ids=list(choice.token_ids) if return_ids else None,
                )
                for choice in choices
            ],
            usage=self.usage_counter(choices).usage(),
            prompt_token_ids=self.prompt_ids[0] if return_ids else None,
            prompt_logprobs=None if self.body.prompt_logprobs is None else vllm_prompt_logprobs(
                self.tokenizer, self.prompt_ids[0], choices[0].prompt_logprobs,
                self.body.prompt_logprobs),
        )

    def opening_chunks(self) -> list[ChatCompletionStreamResponse]:
        chunks = []
        for index in range(self.body.n):
            choice = ChatStreamChoice(
                index=index,
                delta=ChatDelta(role="assistant", content=""),
                logprobs=None,
                finish_reason=None,
            )
            chunk = self._chunk([choice])
            if index == 0 and self.body.return_token_ids:
                chunk.prompt_token_ids = self.prompt_ids[0]
            chunks.append(chunk)
        return chunks

    def chunk(self, delta: SeqDelta) -> ChatCompletionStreamResponse | None:
        parsed = self._parse(delta.index, delta.text, delta.finish_reason is not None)
        if not (parsed.content or parsed.calls or delta.finish_reason is not None
                or self.body.return_token_ids or self.body.logprobs):
            return None
        out = ChatDelta(content=parsed.content) if parsed.content else ChatDelta()
        if parsed.calls:
            out.tool_calls = [DeltaToolCall(
                index=c.index, id=c.id, type="function" if c.id else None,
                function=DeltaFunctionCall(name=c.name, arguments=c.arguments))
                for c in parsed.calls]
        choice = ChatStreamChoice(
            index=delta.index,
            delta=out,
            logprobs=self._logprobs(delta.token_ids, delta.logprobs),
            finish_reason=self._finish_reason(delta.index, delta.finish_reason),
        )
        if delta.finish_reason is not None:
            choice.stop_reason = delta.stop_reason
        if self.body.return_token_ids:
            choice.token_ids = delta.token_ids
        return self._chunk([choice])

    def _parser(self, index: int) -> ToolParser | None:
        parser = self._parsers.get(index)
        if parser is None:
            choice = self.tool_choice
            if isinstance(choice, NamedToolChoice):
                parser = NamedParser(choice.function.name)
            elif choice == "required":
                parser = RequiredParser()
            elif choice == "auto" and self.body.tools and self.ctx.config.tool_call_parser:
                parser = create_parser(self.ctx.config.tool_call_parser)
            else:
                return None
            self._parsers[index] = parser
        return parser

    def _parse(self, index: int, text: str, last: bool) -> Parsed:
        parser = self._parser(index)
        if parser is None:
            return Parsed(content=text)
        parsed = parser.feed(text)
        if last:
            parsed += parser.finish()
        return parsed

    def _message(self, choice: Choice) -> ChatMessageOut:
        parsed = self._parse(choice.index, choice.text, True)
        calls: dict[int, ToolCall] = {}
        for c in parsed.calls:
            if c.index not in calls:
                assert c.id is not None and c.name is not None, "a call opens with its name"
                calls[c.index] = ToolCall(id=c.id, function=FunctionCall(name=c.name,
                                                                         arguments=""))
            calls[c.index].function.arguments += c.arguments
        return ChatMessageOut(content=parsed.content or (None if calls else ""),
                              tool_calls=list(calls.values()))

    def _finish_reason(self, index: int, reason: str | None) -> str | None:
        """"tool_calls" where the model stopped after calling tools (not for a named function,
        as OpenAI)."""
        parser = self._parsers.get(index)
        if reason == "stop" and parser is not None and parser.num_calls \
                and not isinstance(parser, NamedParser):
            return "tool_calls"
        return reason

    def usage_chunk(self, usage: Usage) -> ChatCompletionStreamResponse:
        chunk = self._chunk([])
        chunk.usage = usage
        return chunk

    def _chunk(self, choices: list[ChatStreamChoice]) -> ChatCompletionStreamResponse:
        return ChatCompletionStreamResponse(
            id=self.request_id, object="chat.completion.chunk", created=self.created,
            model=self.model, choices=choices,
        )

    def _logprobs(
        self, token_ids: Sequence[int], logprobs: Sequence[TokenLogprobs]
    ) -> ChatLogprobs | None:
        if not self.body.logprobs:
            return None
        return chat_logprobs(self.tokenizer, token_ids, logprobs, self.body.top_logprobs or 0)
