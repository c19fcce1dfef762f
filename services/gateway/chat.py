"""POST /v1/chat/completions: messages -> chat template -> one prompt, n choices."""

from __future__ import annotations

from collections.abc import Sequence

from common.sampling_params import TokenLogprobs
from services.gateway.flow import Generation
from services.gateway.generation import Choice, SeqDelta
from services.gateway.logprobs import chat_logprobs
from services.gateway.protocol import ChatCompletionRequest
from services.gateway.responses import (
    ChatChoice,
    ChatCompletionResponse,
    ChatCompletionStreamResponse,
    ChatDelta,
    ChatLogprobs,
    ChatMessageOut,
    ChatStreamChoice,
    Usage,
)


class ChatCompletion(Generation):
    """A ChatCompletionResponse, or chat.completion.chunk events that open with one
    assistant-role chunk per choice."""

    ID_PREFIX = "chatcmpl"
    body: ChatCompletionRequest

    async def prompts(self) -> list[list[int]]:
        prompt_ids = await self.ctx.encode_chat(self.body)
        self.ctx.builder.check_prompt(prompt_ids, "messages")
        return [prompt_ids]

    def num_logprobs(self) -> int:
        return self.body.num_logprobs()

    def response(self, choices: list[Choice]) -> ChatCompletionResponse:
        return_ids = self.body.return_token_ids
        return ChatCompletionResponse(
            id=self.request_id,
            model=self.model,
            choices=[
                ChatChoice(
                    index=choice.index,
                    message=ChatMessageOut(content=choice.text),
                    logprobs=self._logprobs(choice.token_ids, choice.logprobs),
                    finish_reason=choice.finish_reason,
                    stop_reason=choice.stop_reason,
                    token_ids=list(choice.token_ids) if return_ids else None,
                )
                for choice in choices
            ],
            usage=self.usage_counter(choices).usage(),
            prompt_token_ids=self.prompt_ids[0] if return_ids else None,
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
        if not (delta.text or delta.finish_reason is not None
                or self.body.return_token_ids or self.body.logprobs):
            return None
        choice = ChatStreamChoice(
            index=delta.index,
            delta=ChatDelta(content=delta.text) if delta.text else ChatDelta(),
            logprobs=self._logprobs(delta.token_ids, delta.logprobs),
            finish_reason=delta.finish_reason,
        )
        if delta.finish_reason is not None:
            choice.stop_reason = delta.stop_reason
        if self.body.return_token_ids:
            choice.token_ids = delta.token_ids
        return self._chunk([choice])

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
