"""Scheduler logprobs -> the two OpenAI logprob shapes, and vLLM's prompt_logprobs.

completions: {tokens, token_logprobs, top_logprobs: [{token: logprob}], text_offset}
             (with echo, the prompt's tokens first: None for the first, which nothing predicts)
chat:        {content: [{token, logprob, bytes, top_logprobs: [{token, logprob, bytes}]}]}
vLLM:        prompt_logprobs: [None, {token id: {logprob, rank, decoded_token}}, ...]
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from common.sampling_params import TokenLogprobs
from services.gateway.responses import (
    ChatLogprobs,
    ChatTokenLogprob,
    ChatTopLogprob,
    CompletionLogprobs,
    Logprob,
    PromptLogprobs,
)
from services.gateway.tokenizer import Tokenizer

MIN_LOGPROB = -9999.0  # JSON has no -inf; vLLM clamps the same way


def _clamp(logprob: float) -> float:
    return MIN_LOGPROB if math.isnan(logprob) or logprob < MIN_LOGPROB else logprob


def completion_logprobs(
    tokenizer: Tokenizer,
    token_ids: Sequence[int],
    logprobs: Sequence[TokenLogprobs],
    text_offsets: Sequence[int],
    num_top: int,
) -> CompletionLogprobs:
    """The sampled token is always in its top_logprobs dict, as in vLLM."""
    # every field given: streamed chunks leave out fields never set
    out = CompletionLogprobs(tokens=[], token_logprobs=[], top_logprobs=[],
                             text_offset=list(text_offsets))
    for k, token_id in enumerate(token_ids):
        token = tokenizer.token_text(token_id)
        out.tokens.append(token)
        if k >= len(logprobs):  # the scheduler sent none: report the tokens only
            out.token_logprobs.append(None)
            out.top_logprobs.append(None)
            continue
        entry = logprobs[k]
        top = {tokenizer.token_text(t.token_id): _clamp(t.logprob) for t in entry.top[:num_top]}
        top.setdefault(token, _clamp(entry.logprob))
        out.token_logprobs.append(_clamp(entry.logprob))
        out.top_logprobs.append(top)
    return out


def echo_logprobs(
    tokenizer: Tokenizer,
    prompt_ids: Sequence[int],
    prompt_logprobs: Sequence[TokenLogprobs],
    text_offsets: Sequence[int],
    num_top: int,
    then: CompletionLogprobs,
) -> CompletionLogprobs:
    """The prompt's tokens (prompt_logprobs scores tokens 1..), then the completion's (`then`,
    its offsets already counting the echoed prompt)."""
    rest = completion_logprobs(
        tokenizer, prompt_ids[1:], prompt_logprobs, text_offsets[1:], num_top
    )
    return CompletionLogprobs(
        tokens=[tokenizer.token_text(prompt_ids[0]), *rest.tokens, *then.tokens],
        token_logprobs=[None, *rest.token_logprobs, *then.token_logprobs],
        top_logprobs=[None, *rest.top_logprobs, *then.top_logprobs],
        text_offset=[text_offsets[0], *rest.text_offset, *then.text_offset],
    )


def vllm_prompt_logprobs(
    tokenizer: Tokenizer,
    prompt_ids: Sequence[int],
    prompt_logprobs: Sequence[TokenLogprobs],
    num_top: int,
) -> PromptLogprobs:
    """Per prompt token, as vLLM: None for the first; then the token itself (with its rank) and
    the top num_top, keyed by token id."""
    out: PromptLogprobs = [None]
    for token_id, entry in zip(prompt_ids[1:], prompt_logprobs):
        here = {str(token_id): Logprob(logprob=_clamp(entry.logprob), rank=entry.rank or None,
                                       decoded_token=tokenizer.token_text(token_id))}
        for rank, top in enumerate(entry.top[:num_top], start=1):
            here.setdefault(str(top.token_id), Logprob(
                logprob=_clamp(top.logprob), rank=rank,
                decoded_token=tokenizer.token_text(top.token_id)))
        out.append(here)
    return out


def chat_logprobs(
    tokenizer: Tokenizer,
    token_ids: Sequence[int],
    logprobs: Sequence[TokenLogprobs],
    num_top: int,
) -> ChatLogprobs:
    content = []
    for token_id, entry in zip(token_ids, logprobs):
        content.append(
            ChatTokenLogprob(
                token=tokenizer.token_text(token_id),
                logprob=_clamp(entry.logprob),
                bytes=tokenizer.token_bytes(token_id),
                top_logprobs=[
                    ChatTopLogprob(
                        token=tokenizer.token_text(top.token_id),
                        logprob=_clamp(top.logprob),
                        bytes=tokenizer.token_bytes(top.token_id),
                    )
                    for top in entry.top[:num_top]
                ],
            )
        )
    return ChatLogprobs(content=content)
