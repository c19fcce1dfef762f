"""Attention metadata (built once per step) and the attention backends the model calls.

Token order inside a step's batch:

    [0, num_decodes)              one token per decoding sequence
    [num_decodes, num_tokens)     prefill chunks, one sequence after another
"""
from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass

import torch

from kernels import reference


@dataclass
class PrefillChunk:
    start: int               # first token of the chunk in the batch
    end: int
    num_cached: int          # tokens of this sequence already in the KV cache
    block_table: torch.Tensor  # [num_blocks]


@dataclass
class DecodeGroup:
    """Decode rows of similar context length, so that padding each to the longest wastes at
    most half of a gather (one long context must not make every row read its length)."""
    rows: torch.Tensor | None    # [n] rows of the decode batch; None: all of them, in order
    block_tables: torch.Tensor   # [n, max_blocks of the group]
    seq_lens: torch.Tensor       # [n]


@dataclass
class AttentionMetadata:
    slot_mapping: torch.Tensor         # [num_tokens]
    num_decodes: int
    decode_block_tables: torch.Tensor  # [num_decodes, max_blocks]
    decode_seq_lens: torch.Tensor      # [num_decodes]
    prefills: list[PrefillChunk]
    decode_groups: list[DecodeGroup]

    @classmethod
    def build(cls, decodes: list[tuple[int, list[int]]],
              prefills: list[tuple[int, int, list[int]]], block_size: int) -> "AttentionMetadata":
        """decodes: (num_computed, block_ids) per sequence, one new token each.
        prefills: (num_computed, num_new, block_ids) per sequence."""
        slots: list[int] = []
        for num_computed, block_ids in decodes:
            slots.append(block_ids[num_computed // block_size] * block_size
                         + num_computed % block_size)
        max_blocks = max((len(b) for _, b in decodes), default=0)
        tables = torch.zeros((len(decodes), max_blocks), dtype=torch.long)
        for i, (_, block_ids) in enumerate(decodes):
            tables[i, :len(block_ids)] = torch.tensor(block_ids, dtype=torch.long)
        seq_lens = torch.tensor([n + 1 for n, _ in decodes], dtype=torch.long)
        chunks = []
        start = len(decodes)
        for num_computed, num_new, block_ids in prefills:
            table = torch.tensor(block_ids, dtype=torch.long)
            pos = torch.arange(num_computed, num_computed + num_new)
            slots_t = table[pos // block_size] * block_size + pos % block_size
            slots.extend(slots_t.tolist())
            chunks.append(PrefillChunk(start, start + num_new, num_computed, table))
            start += num_new
        return cls(torch.tensor(slots, dtype=torch.long), len(decodes), tables, seq_lens, chunks,
                   _group_decodes(tables, seq_lens, block_size))


def _group_decodes(tables: torch.Tensor, seq_lens: torch.Tensor,
                   block_size: int) -> list[DecodeGroup]:
    if len(seq_lens) == 0:
        return []
    lens = seq_lens.tolist()
    order = sorted(range(len(lens)), key=lens.__getitem__)
    groups: list[list[int]] = [[order[0]]]
    for i in order[1:]:
        if lens[i] > 2 * lens[groups[-1][0]] + block_size:
            groups.append([])
        groups[-1].append(i)
    if len(groups) == 1:
        return [DecodeGroup(None, tables, seq_lens)]
    out = []
    for g in groups:
        rows = torch.tensor(g, dtype=torch.long)
        max_blocks = -(-max(lens[i] for i in g) // block_size)
        out.append(DecodeGroup(rows, tables[rows, :max_blocks], seq_lens[rows]))
    return out


class AttentionBackend(ABC):
    """Writes the step's new keys/values into the paged cache and attends over it."""

    @abstractmethod
    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor,
                meta: AttentionMetadata, scale: float) -> torch.Tensor:
        """q: [num_tokens, heads, dim]; k, v: [num_tokens, kv_heads, dim] -> [num_tokens, heads, dim]."""


class TorchAttentionBackend(AttentionBackend):
    def forward(self, q, k, v, kv_cache, meta, scale):
        reference.write_kv(k, v, kv_cache, meta.slot_mapping)
        n = meta.num_decodes
        if not meta.prefills and len(meta.decode_groups) == 1:
            return reference.decode_attention(q, kv_cache, meta.decode_block_tables,
                                              meta.decode_seq_lens, scale)
        out = torch.empty_like(q)
        for g in meta.decode_groups:
            if g.rows is None:
                out[:n] = reference.decode_attention(q[:n], kv_cache, g.block_tables, g.seq_lens,
                                                     scale)
            else:
                out[g.rows] = reference.decode_attention(q[g.rows], kv_cache, g.block_tables,
                                                         g.seq_lens, scale)
        for c in meta.prefills:
            out[c.start:c.end] = reference.prefill_attention(
                q[c.start:c.end], k[c.start:c.end], v[c.start:c.end], kv_cache, c.block_table,
                c.num_cached, scale)
        return out


_BACKENDS = {"torch": TorchAttentionBackend}


def create_attention_backend(name: str, device: torch.device | str = "cpu") -> AttentionBackend:
    if name == "auto":
        name = "torch"
    if name not in _BACKENDS:
        raise ValueError(f"unknown attention backend {name!r}; known: auto, {', '.join(_BACKENDS)}")
    return _BACKENDS[name]()
