"""A pipeline group's step in micro-batches: stage s computes micro-batch j + 1 while stage s + 1
computes micro-batch j, so the stages overlap within one step instead of waiting for each other.

The step's tokens split into contiguous runs of about equal size, in the order the step lays
them out (decodes, then prefill chunks); a chunk that straddles a boundary splits into two
chunks of the same request, the second attending to the KV the first wrote on every stage
before it (as chunked prefill does across steps). Every rank of the group makes the same split
from the same plan, so each stage receives what the one before sends."""
from __future__ import annotations

from dataclasses import dataclass, field

MIN_TOKENS = 8  # below this a micro-batch costs more in per-layer overhead than it overlaps


@dataclass
class MicroBatch:
    start: int  # [start, end) of the step's tokens
    end: int
    decodes: list[tuple[int, list[int]]] = field(default_factory=list)  # (computed, blocks)
    chunks: list[tuple[int, int, list[int]]] = field(default_factory=list)  # (computed, n, blocks)


def split(decodes: list[tuple[int, list[int]]], chunks: list[tuple[int, int, list[int]]],
          parts: int) -> list[MicroBatch]:
    """At most `parts` micro-batches of at least MIN_TOKENS tokens each (one if the step is
    smaller), in the step's token order."""
    total = len(decodes) + sum(n for _, n, _ in chunks)
    parts = max(1, min(parts, total // MIN_TOKENS))
    target = -(-total // parts)
    out = [MicroBatch(0, 0)]

    def room() -> int:
        if out[-1].end - out[-1].start >= target:
            out.append(MicroBatch(out[-1].end, out[-1].end))
        return target - (out[-1].end - out[-1].start)

    for d in decodes:
        room()
        out[-1].decodes.append(d)
        out[-1].end += 1
    for computed, n, blocks in chunks:
        done = 0
        while done < n:
            take = min(n - done, room())
            out[-1].chunks.append((computed + done, take, blocks))
            out[-1].end += take
            done += take
    return out
