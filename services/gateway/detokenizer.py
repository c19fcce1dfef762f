"""Incremental detokenization: token ids in, text deltas out, never half a character.

vLLM's prefix_offset / read_offset scheme, on token ids:

    ids:  [ context ... | prefix_offset ........ read_offset | new tokens ... ]
                          `---- text already emitted ----'
    delta = decode(ids[prefix_offset:])[len(decode(ids[prefix_offset:read_offset])):]

A delta is held back while the window's text ends in U+FFFD (a multi-byte character split over
byte-level BPE tokens whose last bytes have not arrived). Decoding a window rather than single
tokens also keeps decoders that drop a leading space (sentencepiece's Metaspace) correct: the
context holds a few prompt tokens so the first generated token is not "first".
"""

from __future__ import annotations

from collections.abc import Sequence

from services.gateway.tokenizer import Tokenizer

REPLACEMENT_CHAR = "\ufffd"
# vLLM v1's bounds for the prompt suffix that primes the window.
MIN_CONTEXT_TOKENS = 4
MAX_CONTEXT_TOKENS = 24
# Ids before prefix_offset are never read again; drop them once this many pile up.
TRIM_AT = 256


class IncrementalDetokenizer:
    """Invariant: "".join(add(t) for t in ids) + flush() == tokenizer.decode(ids) whenever the
    context ends on a character boundary (always true of a prompt that was decoded cleanly), and
    no delta from `add` ends in U+FFFD unless the text itself does."""

    def __init__(
        self,
        tokenizer: Tokenizer,
        prompt_ids: Sequence[int] = (),
        skip_special_tokens: bool = True,
    ) -> None:
        self._tokenizer = tokenizer
        self._skip_special = skip_special_tokens
        self._ids = _clean_context(tokenizer, prompt_ids, skip_special_tokens)
        self._prefix_offset = 0
        self._read_offset = len(self._ids)
        self._prefix_text = self._decode(self._ids)

    def add(self, token_id: int) -> str:
        """The text that `token_id` completes; "" while a character is still incomplete."""
        self._ids.append(token_id)
        return self._advance(final=False)

    def flush(self) -> str:
        """At the end of a sequence: release whatever is held back, even a partial character."""
        return self._advance(final=True)

    def _advance(self, final: bool) -> str:
        if self._read_offset == len(self._ids):
            return ""
        text = self._decode(self._ids[self._prefix_offset :])
        if len(text) <= len(self._prefix_text) or (
            not final and text.endswith(REPLACEMENT_CHAR)
        ):
            return ""
        delta = text[len(self._prefix_text) :]
        self._prefix_offset, self._read_offset = self._read_offset, len(self._ids)
        self._prefix_text = self._decode(self._ids[self._prefix_offset : self._read_offset])
        if self._prefix_offset >= TRIM_AT:
            del self._ids[: self._prefix_offset]
            self._read_offset -= self._prefix_offset
            self._prefix_offset = 0
        return delta

    def _decode(self, ids: Sequence[int]) -> str:
        return self._tokenizer.decode(ids, skip_special_tokens=self._skip_special) if ids else ""


def _clean_context(
    tokenizer: Tokenizer, prompt_ids: Sequence[int], skip_special_tokens: bool
) -> list[int]:
    """The shortest prompt suffix (MIN..MAX tokens) that decodes without U+FFFD, else nothing.

    A suffix starting or ending inside a character would corrupt the first delta.
    """
    if len(prompt_ids) <= MIN_CONTEXT_TOKENS:
        suffix = list(prompt_ids)
        text = tokenizer.decode(suffix, skip_special_tokens=skip_special_tokens)
        return suffix if REPLACEMENT_CHAR not in text else []
    for n in range(MIN_CONTEXT_TOKENS, min(len(prompt_ids), MAX_CONTEXT_TOKENS) + 1):
        suffix = list(prompt_ids[-n:])
        text = tokenizer.decode(suffix, skip_special_tokens=skip_special_tokens)
        if REPLACEMENT_CHAR not in text:
            return suffix
    return []


def text_offsets(
    tokenizer: Tokenizer, token_ids: Sequence[int], skip_special_tokens: bool
) -> list[int]:
    """Where each token's text starts in tokenizer.decode(token_ids), as the generated tokens'
    offsets are counted: a token that starts a character split over several gets that
    character's start, and so does the rest of it."""
    detok = IncrementalDetokenizer(tokenizer, (), skip_special_tokens)
    offsets, length = [], 0
    for token_id in token_ids:
        offsets.append(length)
        length += len(detok.add(token_id))
    return offsets
