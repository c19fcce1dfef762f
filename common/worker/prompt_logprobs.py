"""Prompt logprobs (vLLM's `prompt_logprobs`, OpenAI's `echo` with `logprobs`): each prompt token
after the first, scored by the raw logits of the position before it, with the k most likely
tokens there and its rank.

A prefill chunk computing positions [start, start + n) scores the prompt tokens they predict:

    positions   start ........ start+n-1
    scores      start+1 ...... start+n      (only those < num_prompt_tokens: the last prompt
                                             position predicts the first output token instead)

so the chunks of a prompt score tokens 1 .. num_prompt_tokens - 1, each exactly once, wherever
the chunks run. Logits are computed ROWS_PER_SLICE positions at a time: a long prompt never
holds a [num_tokens, vocab] tensor.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from common.plans import PromptLogprobs
from common.sampling_params import TokenLogprobs
from common.worker.sampler import token_logprobs

ROWS_PER_SLICE = 256


@dataclass(frozen=True)
class PromptChunk:
    """Hidden rows [row, row + len(targets)) of a step score the request's prompt tokens
    first, first + 1, ... (their ids: targets), each with the top k."""
    request_id: str
    row: int
    first: int
    targets: list[int]
    k: int


def score_chunk(request_id: str, row: int, start: int, n: int, token_ids: list[int],
                num_prompt_tokens: int, k: int) -> PromptChunk | None:
    """What a chunk computing positions [start, start + n) (hidden rows from `row`) scores,
    or None when it scores nothing (a last chunk of one position)."""
    last = min(start + n, num_prompt_tokens - 1)  # the last prompt token it scores
    if last <= start:
        return None
    return PromptChunk(request_id, row, start + 1, token_ids[start + 1:last + 1], k)


def prompt_logprobs(hidden: torch.Tensor, compute_logits, vocab_size: int,
                    chunks: list[PromptChunk]) -> list[PromptLogprobs]:
    """hidden: [num_tokens, hidden_size], the step's final hidden states; compute_logits maps
    rows of it to [rows, >= vocab_size] logits. One PromptLogprobs per chunk, in order."""
    rows = torch.cat([torch.arange(c.row, c.row + len(c.targets)) for c in chunks])
    targets = torch.tensor([t for c in chunks for t in c.targets], dtype=torch.long)
    ks = [c.k for c in chunks for _ in c.targets]
    device = hidden.device
    entries: list[TokenLogprobs] = []
    for lo in range(0, len(rows), ROWS_PER_SLICE):
        idx = rows[lo:lo + ROWS_PER_SLICE].to(device)
        logits = compute_logits(hidden[idx])[:, :vocab_size].float()  # [R, V]
        entries += token_logprobs(logits, targets[lo:lo + ROWS_PER_SLICE].to(device),
                                  ks[lo:lo + ROWS_PER_SLICE], rank=True)
    out, i = [], 0
    for c in chunks:
        out.append(PromptLogprobs(c.request_id, c.first, tuple(entries[i:i + len(c.targets)])))
        i += len(c.targets)
    return out
