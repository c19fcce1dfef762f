"""Structured outputs on a worker: each guided request's grammar matcher, and the token masks
that hold its samples to its grammar.

The gateway turns every form a client sends (a JSON schema, a regex, choices, EBNF) into one
EBNF text, SamplingParams.grammar; a worker compiles it against the model's vocabulary (once per
text: xgrammar caches compiled grammars) and keeps a matcher per request. A matcher's state is a
function of the grammar and the request's output tokens alone, so a request that reaches a worker
with output tokens (prefill -> decode, a resume after a worker died, a recompute) replays them
into a fresh matcher and goes on where it stood.

    before sampling   each guided row's matcher takes the output tokens it has not seen yet;
                      logits [B, V] of its rows -> -inf where the matcher allows no token
    after sampling    the matcher takes the sampled token; one it refuses fails the request

A matcher that accepted a stop token is done: a request that goes on past it (ignore_eos)
samples freely.

xgrammar and the tokenizer load at the first guided request a worker sees (as vLLM's grammar
backend does), not at start-up: importing them is ~2.5 CPU seconds of a worker's ~5.5, paid by
every worker that never serves one; the first guided request waits for them once.
"""
from __future__ import annotations

import logging
import threading
import time
from pathlib import Path
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    import xgrammar as xgr

log = logging.getLogger(__name__)

CACHE_BYTES = 256 << 20  # compiled grammars kept, across requests


class GrammarError(Exception):
    """A request's output left its grammar (a token its matcher refused), or its grammar does
    not compile."""


class Grammars:
    """Compiles grammars for one model's vocabulary; xgrammar and the tokenizer load on first
    use."""

    def __init__(self, model_dir: str | Path, vocab_size: int):
        self.model_dir = model_dir
        self.vocab_size = vocab_size
        self._compiler: xgr.GrammarCompiler | None = None
        self._failed: OSError | ValueError | None = None  # the tokenizer did not load: it won't
        self._lock = threading.Lock()

    def compiler(self) -> xgr.GrammarCompiler:
        with self._lock:
            if self._failed is not None:
                raise self._failed
            try:
                return self._compiler or self._build()
            except (OSError, ValueError) as e:
                self._failed = e
                raise

    def _build(self) -> xgr.GrammarCompiler:
        import xgrammar as xgr

        from common.models.hf_tokenizer import load_hf_tokenizer
        start = time.monotonic()
        info = xgr.TokenizerInfo.from_huggingface(load_hf_tokenizer(self.model_dir),
                                                  vocab_size=self.vocab_size)
        self._compiler = xgr.GrammarCompiler(info, max_threads=1, cache_limit_bytes=CACHE_BYTES)
        log.info("grammar compiler for %d tokens ready in %.2f s", self.vocab_size,
                 time.monotonic() - start)
        return self._compiler

    def matcher(self, grammar: str, stop_token_ids: list[int]) -> xgr.GrammarMatcher:
        """A fresh matcher; the grammar ends with one of stop_token_ids (the request's eos ids;
        none: the tokenizer's eos). Raises GrammarError for a grammar that does not compile: the
        gateway refuses those, and one that gets here must fail its request, not the step."""
        try:
            compiler = self.compiler()
        except (OSError, ValueError) as e:  # the model's tokenizer does not load
            raise GrammarError(f"no grammar compiler for this model: {e}") from None
        try:
            compiled = compiler.compile_grammar(grammar)
        except RuntimeError as e:  # what xgrammar raises for what it cannot parse or support
            raise GrammarError(f"the request's grammar does not compile: {e}") from None
        import xgrammar as xgr
        return xgr.GrammarMatcher(compiled, override_stop_tokens=stop_token_ids or None)


class Guide:
    """One request's matcher and how many of its output tokens it has taken."""

    def __init__(self, matcher: xgr.GrammarMatcher):
        self.matcher = matcher
        self.seen = 0

    def follow(self, output_token_ids: list[int]) -> None:
        """Takes the output tokens it has not seen; raises GrammarError at one it refuses."""
        for token in output_token_ids[self.seen:]:
            if self.matcher.is_terminated():
                break
            if not self.matcher.accept_token(token):
                raise GrammarError(f"token {token} (output token {self.seen}) does not match "
                                   "the request's grammar")
            self.seen += 1
        self.seen = len(output_token_ids)

    @property
    def constrains(self) -> bool:
        return not self.matcher.is_terminated()

    def valid_prefix(self, drafts: list[int]) -> int:
        """How many leading draft tokens the grammar allows after the tokens it has taken
        (it is left where it was)."""
        n = taken = 0
        for token in drafts:
            if not self.matcher.is_terminated():
                if not self.matcher.accept_token(token):
                    break
                taken += 1
            n += 1
        self._rollback(taken)
        return n

    def fill(self, bitmask: torch.Tensor, row: int, ahead: list[int]) -> bool:
        """Row `row` of bitmask: what the grammar allows after its tokens and then `ahead` (draft
        tokens it allows); False, the row left alone, where it allows anything there."""
        taken = 0
        for token in ahead:
            if self.matcher.is_terminated():
                break
            ok = self.matcher.accept_token(token)
            assert ok, f"draft token {token} was checked against the grammar"
            taken += 1
        constrains = not self.matcher.is_terminated()
        if constrains:
            self.matcher.fill_next_token_bitmask(bitmask, row)
        self._rollback(taken)
        return constrains

    def _rollback(self, n: int) -> None:
        if n:
            self.matcher.rollback(n)


def mask_logits(logits: torch.Tensor, guides: list[Guide | None], vocab_size: int,
                ahead: list[list[int]] | None = None) -> None:
    """logits: [B, >= vocab_size]; row i keeps only what guides[i] allows (None: every token)
    after the tokens it has taken and then ahead[i] (draft tokens before row i's position, when
    given). In place."""
    import xgrammar as xgr
    bitmask = xgr.allocate_token_bitmask(len(guides), vocab_size)  # [B, ceil(V / 32)] int32
    rows = [i for i, g in enumerate(guides)
            if g is not None and g.fill(bitmask, i, ahead[i] if ahead else [])]
    if rows:
        xgr.apply_token_bitmask_inplace(logits, bitmask.to(logits.device),
                                        vocab_size=vocab_size, indices=rows)
