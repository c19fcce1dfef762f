"""Speculative decoding on a worker: draft tokens for decoding requests, verified by the target
model in the step that decodes them.

A decoding request the scheduler gives lookahead slots (ScheduledTokens.num_lookahead) runs as a
short chunk: its last token and up to k drafts, one forward, logits at every position. Position j
samples with the request's own pipeline (penalties, grammar, seed) as if the drafts before it
were accepted tokens, and the step keeps tokens while the draft equals what was sampled:

    drafts       d1  d2  d3           sampled at the positions of  last d1 d2 d3
    sampled      x0  x1  x2  x3       kept: x0 .. xa, a = leading j with x_j == d_{j+1}

With an n-gram draft (a point mass on d) this is rejection sampling exactly: a draft is kept with
probability p(d), and on a rejection the token is drawn from p with d removed, renormalized
(x_j conditioned on x_j != d). Each kept token is what plain decoding samples at its position
from the same logits and the same (seed, position) noise, so greedy and seeded output do not
depend on the drafts, on where a step's run of drafts started, or on a resume elsewhere.

The KV the forward wrote at rejected drafts' positions lies past the request's computed tokens:
the next step overwrites it.

Drafts are not free: each is one more token of the forward, of the logits and of the sampler (on
a CPU, nearly a decode row's cost), and with a draft model one more forward of the draft. How
many a request proposes follows its own acceptance (`DraftLength`): the j-th draft only where,
by the request's recent record, it is kept with probability >= MIN_KEEP and at least twice the
draft's measured cost (a share of a decode step); none for a request whose drafts keep missing,
with a probe of one draft now and then (the dearer a draft, the rarer), so that output which
starts to follow its drafts is noticed. Which drafts are proposed never changes what is
sampled.
"""
from __future__ import annotations

import json
from dataclasses import dataclass

import numpy as np

METHODS = ("ngram", "draft_model")
ACCEPTANCE_METHODS = ("coupled", "rejection_sampler")
MIN_KEEP = 0.3  # the least chance of being kept a draft is proposed with
WEIGHT = 0.3    # of each new draft's outcome in a request's acceptance estimate
RECOVERY = 0.01  # a step without drafts moves the estimate this share back towards 1 ...
PROBE_COST = 0.02  # ... slower (down to a quarter) where a draft costs more than this share
                   # of a decode step


@dataclass(frozen=True)
class SpeculativeConfig:
    """vLLM's --speculative-config keys that apply here."""
    method: str = "ngram"
    num_speculative_tokens: int = 0
    prompt_lookup_min: int = 0  # ngram: shortest suffix matched (0: prompt_lookup_max, or 5)
    prompt_lookup_max: int = 0  # ngram: longest suffix matched (0: prompt_lookup_min, or 5)
    model: str = ""             # draft_model: the draft's checkpoint (same vocabulary)
    acceptance_method: str = "coupled"  # draft_model: or "rejection_sampler" (draft.py)

    def __post_init__(self):
        if self.method not in METHODS:
            raise ValueError(f"--speculative-config: unknown method {self.method!r}; "
                             f"known: {', '.join(METHODS)}")
        if self.acceptance_method not in ACCEPTANCE_METHODS:
            raise ValueError(f"--speculative-config: unknown acceptance_method "
                             f"{self.acceptance_method!r}; known: "
                             f"{', '.join(ACCEPTANCE_METHODS)}")
        if (self.method == "draft_model") != bool(self.model):
            raise ValueError('--speculative-config: a draft model needs "model" (and "model" '
                             "needs the draft_model method)")
        if self.num_speculative_tokens < 1:
            raise ValueError("--speculative-config: num_speculative_tokens must be >= 1")
        lo = self.prompt_lookup_min or self.prompt_lookup_max or 5
        hi = self.prompt_lookup_max or self.prompt_lookup_min or 5
        if lo < 1 or hi < lo:
            raise ValueError("--speculative-config: need 1 <= prompt_lookup_min <= "
                             "prompt_lookup_max")
        object.__setattr__(self, "prompt_lookup_min", lo)
        object.__setattr__(self, "prompt_lookup_max", hi)

    @classmethod
    def parse(cls, text: str) -> SpeculativeConfig | None:
        """The flag's JSON; "" or "{}" or "null": no speculation. Raises ValueError naming what
        is wrong."""
        if not text.strip():
            return None
        try:
            raw = json.loads(text)
        except json.JSONDecodeError as e:
            raise ValueError(f"--speculative-config is not JSON: {e}") from None
        if raw is None or raw == {}:
            return None
        if not isinstance(raw, dict):
            raise ValueError("--speculative-config must be a JSON object")
        raw = dict(raw)
        method = raw.pop("method", "draft_model" if "model" in raw else "ngram")
        if method == "[ngram]":  # vLLM's older spelling
            method = "ngram"
        for key in ("model", "acceptance_method"):
            if key in raw and not isinstance(raw[key], str):
                raise ValueError(f"--speculative-config: {key} must be a string")
        model = raw.pop("model", "")
        acceptance = raw.pop("acceptance_method", "coupled")
        known = {"num_speculative_tokens", "prompt_lookup_min", "prompt_lookup_max"}
        unknown = sorted(set(raw) - known)
        if unknown:
            raise ValueError(f"--speculative-config: unknown keys {unknown}; known: "
                             f"{sorted(known | {'method', 'model', 'acceptance_method'})}")
        for key, value in raw.items():
            if not isinstance(value, int) or isinstance(value, bool):
                raise ValueError(f"--speculative-config: {key} must be an integer")
        return cls(method=method, model=model, acceptance_method=acceptance, **raw)


class NgramProposer:
    """Prompt lookup: the longest suffix of the sequence (prompt_lookup_max tokens down to
    prompt_lookup_min) that occurred before, and the tokens that followed its latest
    occurrence."""

    def __init__(self, cfg: SpeculativeConfig):
        self.min_n = cfg.prompt_lookup_min
        self.max_n = cfg.prompt_lookup_max

    def propose(self, token_ids: list[int], k: int) -> list[int]:
        """Up to k drafts to follow token_ids; [] when no suffix occurred before."""
        n_tokens = len(token_ids)
        if k < 1 or n_tokens <= self.min_n:
            return []
        tokens = np.asarray(token_ids, dtype=np.int64)
        # occurrences ending before the last token: the match must have a token after it
        ends = np.flatnonzero(tokens[:-1] == tokens[-1])
        for n in range(min(self.max_n, n_tokens - 1), self.min_n - 1, -1):
            cand = ends[ends >= n - 1]
            same = np.ones(len(cand), dtype=bool)
            for back in range(1, n):
                same &= tokens[cand - back] == tokens[n_tokens - 1 - back]
            hits = cand[same]
            if len(hits):
                start = int(hits[-1]) + 1
                return tokens[start:start + k].tolist()
        return []


class DraftLength:
    """A request's estimate of the chance that its next draft is kept (starting at 1: every
    request is tried), and the number of drafts that estimate is worth."""

    def __init__(self) -> None:
        self.acceptance = 1.0

    def drafts(self, k: int, cost: float = 0.0) -> int:
        """Drafts worth proposing, at most k: while acceptance ** j >= max(MIN_KEEP, 2 cost),
        cost: what one draft costs, as a share of a decode step. None for a request with a poor
        record; each such step moves its estimate back towards 1."""
        need = max(MIN_KEEP, 2 * cost)
        n, keep = 0, self.acceptance
        while n < k and keep >= need:
            n += 1
            keep *= self.acceptance
        if n == 0:
            rate = RECOVERY * min(1.0, max(0.25, PROBE_COST / cost)) if cost > 0 else RECOVERY
            self.acceptance += rate * (1 - self.acceptance)
        return n

    def observe(self, proposed: int, accepted: int) -> None:
        """A step verified `proposed` drafts and kept the first `accepted`: outcomes up to the
        first rejected one (those after it say nothing)."""
        for _ in range(accepted):
            self.acceptance += WEIGHT * (1 - self.acceptance)
        if accepted < proposed:
            self.acceptance -= WEIGHT * self.acceptance
