"""POST /v1/completions: prompts (text or token ids) in, one choice per (prompt, sample) out;
best_of > n samples more and keeps each prompt's best n. echo puts the prompt before each
choice's text (and, with logprobs, the prompt's tokens before its logprobs, scored by the
worker that prefilled it); vLLM's prompt_logprobs comes in its own field."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace

from fastapi import Request

from common.sampling_params import TokenLogprobs
from services.gateway.detokenizer import text_offsets
from services.gateway.errors import bad_request
from services.gateway.flow import Generation
from services.gateway.generation import Choice, SeqDelta
from services.gateway.logprobs import completion_logprobs, echo_logprobs, vllm_prompt_logprobs
from services.gateway.protocol import CompletionRequest
from services.gateway.responses import (
    CompletionChoice,
    CompletionLogprobs,
    CompletionResponse,
    CompletionStreamChoice,
    CompletionStreamResponse,
    PromptLogprobs,
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
        if body.max_tokens == 0 and not body.echo:
            raise bad_request("max_tokens must be at least 1; 0 needs echo, which returns the "
                              "prompt alone (with logprobs, its scores)", "max_tokens")
        self.best_of = body.best_of or body.n
        self.texts: list[str] = []
        self.echo_logprobs = body.echo and body.logprobs is not None
        self.prompt_offsets: list[list[int]] = []  # where each prompt token starts in its text
        self._started: set[int] = set()

    async def prompts(self) -> list[list[int]]:
        prompts, self.texts = await self._tokenize()
        if len(prompts) * self.best_of > MAX_CHOICES:
            raise bad_request(
                f"At most {MAX_CHOICES} choices (prompts x best_of) per request.", "n"
            )
        if self.echo_logprobs:
            # a text prompt is echoed as sent (no BOS the tokenizer added); token ids as
            # decoded, special tokens included
            skip = isinstance(self.body.prompt, str) or isinstance(self.body.prompt[0], str)
            self.prompt_offsets = await self.tokenizer.arun(
                lambda: [text_offsets(self.tokenizer, p, skip) for p in prompts])
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
            texts = []  # decoded below, once the ids are checked
        for ids in prompts:
            self.ctx.check_prompt(ids, "prompt")
        if not texts:
            decode = self.tokenizer.decode
            texts = [decode(p, skip_special_tokens=False) if self.body.echo else ""
                     for p in prompts]
        return prompts, texts

    def samples_per_prompt(self) -> int:
        return self.best_of

    def shape(self, delta: SeqDelta) -> SeqDelta:
        """echo with max_tokens 0 scores the prompt alone: the one token the workers sampled
        (a request samples at least one) is not reported, and the choice ends at its length."""
        if not self.body.scores_only():
            return delta
        finish = "length" if delta.finish_reason == "stop" else delta.finish_reason
        return replace(delta, text="", token_ids=[], text_offsets=[], logprobs=(),
                       finish_reason=finish, stop_reason=None)

    def num_logprobs(self) -> int:
        num_logprobs = -1 if self.body.logprobs is None else self.body.logprobs
        if self.best_of > self.body.n:  # ranking needs every sampled token's logprob
            num_logprobs = max(num_logprobs, 0)
        return num_logprobs

    def num_prompt_logprobs(self) -> int:
        return self.body.num_prompt_logprobs()

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
                logprobs=self._logprobs(choice.index, choice.token_ids, choice.logprobs,
                                        choice.text_offsets, choice.prompt_logprobs),
                finish_reason=choice.finish_reason,
                stop_reason=choice.stop_reason,
                prompt_logprobs=self._prompt_logprobs(choice.index, choice.prompt_logprobs),
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
        choice = self._stream_choice(delta, first=True)
        choice.text = self._echo(delta.index) + choice.text
        if self.body.return_token_ids:
            choice.prompt_token_ids = self.prompt_ids[self._prompt_of(delta.index)]
        if self.body.prompt_logprobs is not None:
            choice.prompt_logprobs = self._prompt_logprobs(delta.index, delta.prompt_logprobs)
        return choice

    def _stream_choice(self, delta: SeqDelta, first: bool = False) -> CompletionStreamChoice:
        choice = CompletionStreamChoice(
            index=delta.index,
            text=delta.text,
            logprobs=self._logprobs(delta.index, delta.token_ids, delta.logprobs,
                                    delta.text_offsets, delta.prompt_logprobs if first else None),
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
        index: int,
        token_ids: Sequence[int],
        logprobs: Sequence[TokenLogprobs],
        offsets: Sequence[int],
        prompt_logprobs: Sequence[TokenLogprobs] | None,
    ) -> CompletionLogprobs | None:
        """Choice `index`'s logprobs for these tokens; prompt_logprobs (not None: the choice's
        first output) puts the echoed prompt's before them."""
        if self.body.logprobs is None:
            return None
        shift = len(self._echo(index))  # offsets count the echoed prompt
        out = completion_logprobs(
            self.tokenizer, token_ids, logprobs, [o + shift for o in offsets], self.body.logprobs
        )
        if prompt_logprobs is None or not self.echo_logprobs:
            return out
        prompt = self._prompt_of(index)
        return echo_logprobs(self.tokenizer, self.prompt_ids[prompt], prompt_logprobs,
                             self.prompt_offsets[prompt], self.body.logprobs, then=out)

    def _prompt_logprobs(
        self, index: int, prompt_logprobs: Sequence[TokenLogprobs]
    ) -> PromptLogprobs | None:
        if self.body.prompt_logprobs is None:
            return None
        return vllm_prompt_logprobs(self.tokenizer, self.prompt_ids[self._prompt_of(index)],
                                    prompt_logprobs, self.body.prompt_logprobs)

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
