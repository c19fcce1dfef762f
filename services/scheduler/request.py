"""A request as the scheduler tracks it: tokens, sampling, where it runs."""
from __future__ import annotations

import enum
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

from common.sampling_params import ResumedSample, SamplingParams, TokenLogprobs
from services.scheduler.block_hash import extend_block_hashes


class Status(enum.Enum):
    WAITING = "waiting"          # in the queue
    PREFILLING = "prefilling"    # chunks running on its prefill worker
    TRANSFERRING = "transferring"  # prefill done; KV on its way to (or copied on) the decode worker
    DECODING = "decoding"        # in its decode worker's running batch
    FORKING = "forking"          # a sample of its leader's prompt: waits for its first token
                                 # (sampled with the leader's), then for the leader's KV
    FINISHED = "finished"


@dataclass(frozen=True)
class Output:
    """What the scheduler tells the request's stream after a step."""
    request_id: str
    token_ids: list[int]
    logprobs: list[TokenLogprobs]
    finish_reason: str = ""      # "", "stop", "length", "abort", "error"
    prompt_logprobs: list[TokenLogprobs] = field(default_factory=list)  # with the first token
    stop_token_id: int = -1
    num_prompt_tokens: int = 0
    num_cached_tokens: int = 0
    error: str = ""


@dataclass(eq=False)
class Request:
    request_id: str
    prompt_token_ids: list[int]
    sampling: SamplingParams
    eos_token_ids: list[int]
    priority: int = 0
    arrival_time: float = field(default_factory=time.monotonic)
    output_token_ids: list[int] = field(default_factory=list)
    status: Status = Status.WAITING
    prefill_worker: str | None = None  # worker computing its prompt (may be the decode worker)
    decode_worker: str | None = None
    num_computed_tokens: int = 0       # on the worker that currently computes it
    transfer_id: str = ""
    num_preemptions: int = 0
    finish_reason: str = ""
    cache_salt: str = ""
    block_hashes: list[bytes] = field(default_factory=list)  # of its full blocks, chained
    num_cached_tokens: int | None = None  # prefix hit at first admission
    prefill_locally: bool = False  # its KV transfer failed once: its decode worker prefills it
    taken_back: bool = False  # a prefill worker took it back from the decode worker prefilling it
    prefix_filled: bool = False  # ... after that decode worker sent it the prompt's KV so far
    hold_declined: bool = False  # a decode worker would have held it but for its batch
    # the last price of holding it beside a decode worker's batch (Prefill._hold_pays): the
    # seconds the batch would lose, those the decode worker would take for it, those the
    # prompt would gain there, the prefill workers' load
    hold_terms: tuple[float, float, float, float] | None = None
    first_token_at: float | None = None  # when its first token came (the scheduler's clock)
    held_at: float = 0.0  # a long prompt on a decode worker: when that one took it (the
    held_from: int = 0    # scheduler's clock), and its tokens computed then
    # n > 1: the leader prefills the prompt once; its forks (FORKING) sample their first token
    # from the same logits, then share its full prompt blocks on the decode worker
    leader: Request | None = None
    forks: list[Request] = field(default_factory=list)
    # its prompt's logprobs as prefill chunks score them (tokens 1 ..), out with the first token
    prompt_logprobs: list[TokenLogprobs] = field(default_factory=list)

    @property
    def all_token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def max_tokens(self) -> int:
        return self.sampling.max_tokens

    @property
    def scores_prompt(self) -> bool:
        """Whether its prompt logprobs are asked for and not out yet (they go with the first
        token): then every prompt position must be computed, none read from a cache."""
        return self.sampling.prompt_logprobs >= 0 and not self.output_token_ids

    def hashes(self, block_size: int) -> list[bytes]:
        """The chained hashes of its full blocks (extended as it grows). None while it scores
        its prompt: it finds no cached prefix (vLLM skips the lookup the same way) and caches
        no block until its first token is out."""
        if self.scores_prompt:
            return []
        if len(self.block_hashes) < self.num_tokens // block_size:
            extend_block_hashes(self.block_hashes, self.all_token_ids, block_size,
                                self.cache_salt)
        return self.block_hashes

    def add_prompt_logprobs(self, first: int, logprobs: Sequence[TokenLogprobs]) -> None:
        """Scores of prompt tokens first, first + 1, ... from one prefill chunk."""
        assert first == len(self.prompt_logprobs) + 1, (
            f"{self.request_id}: prompt logprobs from token {first}, "
            f"{len(self.prompt_logprobs)} scored so far")
        self.prompt_logprobs.extend(logprobs)

    def check_stop(self, token_id: int, max_model_len: int) -> tuple[str, int]:
        """(finish reason, stop token id or -1) after token_id was appended."""
        n = len(self.output_token_ids)
        if n >= self.sampling.min_tokens:
            if not self.sampling.ignore_eos and token_id in self.eos_token_ids:
                return "stop", token_id
            if token_id in self.sampling.stop_token_ids:
                return "stop", token_id
        if n >= self.max_tokens or self.num_tokens >= max_model_len:
            return "length", -1
        return "", -1


def resume(samples: list[Request], resumed: Sequence[ResumedSample]) -> list[Request]:
    """The samples of a resubmitted request that still have to run (a new scheduler took over
    from one that was lost), each holding the tokens it had streamed: its positions, seed and
    max_tokens count them as they did. Raises ValueError for a resume that does not fit."""
    given: dict[int, ResumedSample] = {}
    for r in resumed:
        if not 0 <= r.sample < len(samples) or r.sample in given:
            raise ValueError(f"resumed sample {r.sample}: the request has samples "
                             f"0..{len(samples) - 1}, each resumed once")
        given[r.sample] = r
    out = []
    for j, req in enumerate(samples):
        was = given.get(j)
        if was is not None and was.finished:
            continue
        if was is not None:
            if len(was.output_token_ids) >= req.max_tokens:
                raise ValueError(f"resumed sample {j} has {len(was.output_token_ids)} tokens, "
                                 f"its max_tokens ({req.max_tokens}): it is finished")
            req.output_token_ids = list(was.output_token_ids)
        out.append(req)
    return out
