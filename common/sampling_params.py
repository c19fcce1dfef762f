"""How one request samples, and the logprobs it gets back: the vocabulary the gateway, the
scheduler and the workers share. Plain frozen dataclasses; protos/*_codec.py convert them to and
from protobuf at the process boundaries."""
from __future__ import annotations

from dataclasses import dataclass, replace


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 0.0        # 0: greedy
    top_p: float = 1.0              # 1 disables
    top_k: int = 0                  # 0 or -1 disables
    min_p: float = 0.0              # 0 disables
    seed: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0  # 1 disables
    max_tokens: int = 16
    min_tokens: int = 0
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    logprobs: int = -1              # -1: none; 0: the sampled token's; k: and the top k

    def for_sample(self, j: int) -> SamplingParams:
        """Sample j of a request with n > 1: seed + j when a seed is set (sample 0 is the
        request itself)."""
        if j == 0 or self.seed is None:
            return self
        return replace(self, seed=(self.seed + j) % 2**64)


@dataclass(frozen=True)
class TopLogprob:
    token_id: int
    logprob: float


@dataclass(frozen=True)
class TokenLogprobs:
    logprob: float                       # of the sampled token
    top: tuple[TopLogprob, ...] = ()     # the k most likely, best first
