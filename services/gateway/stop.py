"""Stop strings: matched by the gateway on the growing text (the scheduler only sees tokens).

While streaming, the tail of the text that could still become a stop string is held back:

    text:  [ released ......... | pending: a proper prefix of some stop string ]

so released text never contains a stop string nor the beginning of one that later completes.
"""

from __future__ import annotations

from collections.abc import Sequence


class StopMatcher:
    """Invariant: once `matched` is set, every later `feed` returns ""; the text released before
    and at the match is the text up to (and, with include_in_output, including) the stop string."""

    def __init__(self, stops: Sequence[str], include_in_output: bool = False) -> None:
        self._stops = tuple(stop for stop in stops if stop)
        self._include = include_in_output
        self._pending = ""
        self.matched: str | None = None

    def __bool__(self) -> bool:
        return bool(self._stops)

    def feed(self, text: str, check: bool = True) -> str:
        """Add `text`; return what is safe to emit. `check=False` defers matching (min_tokens)."""
        if self.matched is not None:
            return ""
        if not self._stops:
            return text
        buf = self._pending + text
        if check:
            hit = self._first_match(buf)
            if hit is not None:
                index, stop = hit
                self.matched, self._pending = stop, ""
                return buf[: index + len(stop)] if self._include else buf[:index]
        hold = self._longest_partial(buf)
        self._pending = buf[len(buf) - hold :]
        return buf[: len(buf) - hold]

    def flush(self) -> str:
        """At the end of the sequence: the held-back tail was not a stop string after all."""
        out, self._pending = self._pending, ""
        return out if self.matched is None else ""

    def _first_match(self, buf: str) -> tuple[int, str] | None:
        best: tuple[int, str] | None = None
        for stop in self._stops:
            index = buf.find(stop)
            if index >= 0 and (best is None or index < best[0]):
                best = (index, stop)
        return best

    def _longest_partial(self, buf: str) -> int:
        """Length of the longest suffix of `buf` that is a proper prefix of a stop string."""
        longest = 0
        for stop in self._stops:
            for size in range(min(len(stop) - 1, len(buf)), longest, -1):
                if buf.endswith(stop[:size]):
                    longest = size
                    break
        return longest
