"""POST /v1/completions: prompts (text or token ids) in, one choice per (prompt, sample) out;
best_of > n samples more and keeps each prompt's best n."""

from __future__ import annotations

from collections.abc import Sequence

from fastapi import Request

from common.sampling_params import TokenLogprobs
from services.gateway.errors import bad_request
from services.gateway.flow import Generation
from services.gateway.generation import Choice, SeqDelta
from services.gateway.logprobs import completion_logprobs
from services.gateway.protocol import CompletionRequest
from services.gateway.responses import (
    CompletionChoice,
    CompletionLogprobs,
    CompletionResponse,
    CompletionStreamChoice,
    CompletionStreamResponse,
    Usage,
)
from services.gateway.serving import ServingContext

MAX_CHOICES = 256


class Completion(Generation):
    """A CompletionResponse, or text_completion chunks; a choice's first chunk carries the echoed
    prompt (and its token ids when asked)."""

    ID_PREFIX = "cmpl"
    body: CompletionRequest

    def __init__(self, ctx: ServingContext, body: CompletionRequest, raw: Request) -> None:
        super().__init__(ctx, body, raw)
        self.best_of = body.best_of or body.n
        self.texts: list[str] = []
        self._started: set[int] = set()

    async def prompts(self) -> list[list[int]]:
        prompts, self.texts = await self._tokenize()
        if len(prompts) * self.best_of > MAX_CHOICES:
            raise bad_request(
                f"At most {MAX_CHOICES} choices (prompts x best_of) per request.", "n"
            )
        return prompts

    async def _tokenize(self) -> tuple[list[list[int]], list[str]]:
        """Token ids of each prompt, and its text (for echo)."""
        prompt = self.body.prompt
        if isinstance(prompt, str):
            prompt = [prompt]
        elif isinstance(prompt[0], int):
            prompt = [prompt]
        if isinstance(prompt[0], str):
            texts = list(prompt)
            prompts = await self.tokenizer.aencode_batch(texts, self.body.add_special_tokens)
        else:
            prompts = [list(p) for p in prompt]
            for ids in prompts:
                self.tokenizer.check_token_ids(ids, "prompt")
            decode = self.tokenizer.decode
            texts = [decode(p, skip_special_tokens=False) if self.body.echo else ""
                     for p in prompts]
        for ids in prompts:
            self.ctx.builder.check_prompt(ids)
        return prompts, texts

    def samples_per_prompt(self) -> int:
        return self.best_of

    def num_logprobs(self) -> int:
        num_logprobs = -1 if self.body.logprobs is None else self.body.logprobs
        if self.best_of > self.body.n:  # ranking needs every sampled token's logprob
            num_logprobs = max(num_logprobs, 0)
        return num_logprobs

    def response(self, choices: list[Choice]) -> CompletionResponse:
        generated = sum(len(c.token_ids) for c in choices)
        if self.best_of > self.body.n:
            choices = best_choices(choices, self.best_of, self.body.n,
                                   keep_logprobs=self.body.logprobs is not None)
        usage = self.usage_counter(choices)
        usage.completion_tokens = generated  # the discarded samples were computed too
        out = [
            CompletionChoice(
                index=choice.index,
                text=self._echo(choice.index) + choice.text,
                logprobs=self._logprobs(choice.token_ids, choice.logprobs, choice.text_offsets),
                finish_reason=choice.finish_reason,
                stop_reason=choice.stop_reason,
                prompt_token_ids=self._token_ids(self.prompt_ids[self._prompt_of(choice.index)]),
                token_ids=self._token_ids(choice.token_ids),
            )
            for choice in choices
        ]
        return CompletionResponse(
            id=self.request_id, model=self.model, choices=out, usage=usage.usage()
        )

    def chunk(self, delta: SeqDelta) -> CompletionStreamResponse | None:
        if delta.index not in self._started:
            self._started.add(delta.index)
            return self._chunk([self._first_choice(delta)])
        if not (delta.text or delta.finish_reason is not None
                or self.body.return_token_ids or self.body.logprobs is not None):
            return None
        return self._chunk([self._stream_choice(delta)])

    def usage_chunk(self, usage: Usage) -> CompletionStreamResponse:
        chunk = self._chunk([])
        chunk.usage = usage
        return chunk

    def _prompt_of(self, index: int) -> int:
        return index // self.body.n

    def _echo(self, index: int) -> str:
        return self.texts[self._prompt_of(index)] if self.body.echo else ""

    def _first_choice(self, delta: SeqDelta) -> CompletionStreamChoice:
        choice = self._stream_choice(delta)
        choice.text = self._echo(delta.index) + choice.text
        if self.body.return_token_ids:
            choice.prompt_token_ids = self.prompt_ids[self._prompt_of(delta.index)]
        return choice

    def _stream_choice(self, delta: SeqDelta) -> CompletionStreamChoice:
        choice = CompletionStreamChoice(
            index=delta.index,
            text=delta.text,
            logprobs=self._logprobs(delta.token_ids, delta.logprobs, delta.text_offsets),
            finish_reason=delta.finish_reason,
        )
        if delta.finish_reason is not None:
            choice.stop_reason = delta.stop_reason
        if self.body.return_token_ids:
            choice.token_ids = delta.token_ids
        return choice

    def _chunk(self, choices: list[CompletionStreamChoice]) -> CompletionStreamResponse:
        return CompletionStreamResponse(
            id=self.request_id, object="text_completion", created=self.created,
            model=self.model, choices=choices,
        )

    def _logprobs(
        self,
        token_ids: Sequence[int],
        logprobs: Sequence[TokenLogprobs],
        offsets: Sequence[int],
    ) -> CompletionLogprobs | None:
        if self.body.logprobs is None:
            return None
        return completion_logprobs(
            self.tokenizer, token_ids, logprobs, offsets, self.body.logprobs
        )

    def _token_ids(self, ids: list[int]) -> list[int] | None:
        return list(ids) if self.body.return_token_ids else None


def best_choices(choices: list[Choice], best_of: int, n: int,
                 keep_logprobs: bool) -> list[Choice]:
    """Per prompt, the n of its best_of samples with the highest mean token logprob, best first,
    re-indexed prompt * n + rank."""
    out = []
    for prompt in range(len(choices) // best_of):
        group = choices[prompt * best_of:(prompt + 1) * best_of]
        ranked = sorted(group, key=lambda c: -sum(lp.logprob for lp in c.logprobs)
                        / max(1, len(c.logprobs)))
        for rank, choice in enumerate(ranked[:n]):
            choice.index = prompt * n + rank
            if not keep_logprobs:
                choice.logprobs = []
            out.append(choice)
    return out
