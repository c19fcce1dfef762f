"""What a gateway asks of the scheduler, how each request samples, and what streams back: the
vocabulary the gateway, the scheduler and the workers share. Plain frozen dataclasses;
protos/scheduler_codec.py converts them to and from protobuf at the process boundaries (floats
travel as float32, so a value comes back as its nearest float32).
"""
from __future__ import annotations

from dataclasses import dataclass, replace

UINT64 = 2**64


@dataclass(frozen=True)
class SamplingParams:
    max_tokens: int
    temperature: float = 0.0        # 0: greedy
    top_p: float = 1.0              # 1 disables
    top_k: int = 0                  # 0 or -1 disables
    min_p: float = 0.0              # 0 disables
    seed: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0  # 1 disables
    min_tokens: int = 0
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    logprobs: int = -1              # -1: none; 0: the sampled token's; k: and the top k
    prompt_logprobs: int = -1       # -1: none; k: each prompt token's (after the first) + top k
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, bias added to its logit), sorted
    grammar: str = ""  # EBNF (xgrammar's dialect) the output matches, then an eos; "": free

    def __post_init__(self) -> None:
        assert self.seed is None or 0 <= self.seed < UINT64, f"seed {self.seed} is not uint64"
        assert list(self.logit_bias) == sorted(self.logit_bias), "logit_bias must be sorted"

    def for_sample(self, j: int) -> SamplingParams:
        """Sample j of a request with n > 1: seed + j when a seed is set (sample 0 is the
        request itself)."""
        if j == 0 or self.seed is None:
            return self
        return replace(self, seed=(self.seed + j) % UINT64)


@dataclass(frozen=True)
class TopLogprob:
    token_id: int
    logprob: float


@dataclass(frozen=True)
class TokenLogprobs:
    logprob: float                       # of the sampled (or, for a prompt, the given) token
    top: tuple[TopLogprob, ...] = ()     # the k most likely, best first
    rank: int = 0                        # the token's 1-based rank in the vocabulary; 0: unknown


@dataclass(frozen=True)
class ResumedSample:
    """What sample `sample` of a resubmitted request had streamed before its scheduler was
    lost."""
    sample: int
    output_token_ids: tuple[int, ...] = ()
    finished: bool = False


@dataclass(frozen=True)
class GenerateRequest:
    """One prompt and its samples: sample j > 0 runs as sample_ids[j - 1] with seed + j."""
    request_id: str
    prompt_token_ids: tuple[int, ...]
    sampling: SamplingParams
    eos_token_ids: tuple[int, ...] = ()
    priority: int = 0
    cache_salt: str = ""  # "": shares the prefix cache with every unsalted request
    sample_ids: tuple[str, ...] = ()
    resumed: tuple[ResumedSample, ...] = ()  # a resubmission: each sample's tokens so far

    @property
    def request_ids(self) -> tuple[str, ...]:
        """Indexed by sample."""
        return (self.request_id, *self.sample_ids)


@dataclass(frozen=True)
class GenerateOutput:
    """One message of a Generate stream: sample `sample`'s tokens since its previous message;
    logprobs, when asked, has one entry per token id. prompt_logprobs, when asked, comes with
    the first token: one entry per prompt token but the first (which nothing predicts)."""
    token_ids: tuple[int, ...] = ()
    logprobs: tuple[TokenLogprobs, ...] = ()
    prompt_logprobs: tuple[TokenLogprobs, ...] = ()
    finish_reason: str = ""  # "", "stop", "length", "abort", "error"
    num_prompt_tokens: int = 0
    num_cached_tokens: int = 0
    stop_token_id: int = -1  # the token that stopped it, if one did
    error: str = ""
    sample: int = 0
