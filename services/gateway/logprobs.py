"""Scheduler logprobs -> the two OpenAI logprob shapes.

completions: {tokens, token_logprobs, top_logprobs: [{token: logprob}], text_offset}
chat:        {content: [{token, logprob, bytes, top_logprobs: [{token, logprob, bytes}]}]}
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
    out = CompletionLogprobs(text_offset=list(text_offsets))
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
