"""Attention metadata (built once per step) and the attention backends the model calls.

Token order inside a step's batch:

    [0, num_decodes)              one token per decoding sequence
    [num_decodes, num_tokens)     prefill chunks, one sequence after another

Backends: `cpu` (kernels/cpu_attention.py: compiled paged attention that reads K/V in place),
`torch` (kernels/reference.py: the readable reference, gathers K/V per step) and `triton`
(kernels/*.py: CUDA tensors, or CPU tensors under TRITON_INTERPRET=1 for tests). `auto` takes
triton on CUDA, else cpu (torch, with a warning, where the cpu kernels cannot be built).
"""
from __future__ import annotations

import logging
import os
from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass, replace

import torch

from common.models.ops import CpuOps, ModelOps, TorchOps, TritonOps
from kernels import reference

log = logging.getLogger(__name__)


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
    # every prefill chunk at once, for a varlen kernel; query_start_loc counts from the first
    # prefill token (batch row num_decodes)
    query_start_loc: torch.Tensor | None = None        # [num_prefills + 1]
    prefill_num_cached: torch.Tensor | None = None     # [num_prefills]
    prefill_block_tables: torch.Tensor | None = None   # [num_prefills, max_blocks], zero-padded
    max_prefill_len: int = 0

    @classmethod
    def build(cls, decodes: list[tuple[int, list[int]]],
              prefills: list[tuple[int, int, list[int]]], block_size: int) -> AttentionMetadata:
        """decodes: (num_computed, block_ids) per sequence, one new token each.
        prefills: (num_computed, num_new, block_ids) per sequence."""
        slots = [slot_of(block_ids, n, block_size) for n, block_ids in decodes]
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
                   _group_decodes(tables, seq_lens, block_size), *_varlen_prefills(chunks))

    def to(self, device: torch.device | str) -> AttentionMetadata:
        """The same metadata with every tensor on `device`: one copy per step, before forward."""
        def move(t):
            return None if t is None else t.to(device, non_blocking=True)
        return replace(
            self, slot_mapping=move(self.slot_mapping),
            decode_block_tables=move(self.decode_block_tables),
            decode_seq_lens=move(self.decode_seq_lens),
            prefills=[replace(c, block_table=move(c.block_table)) for c in self.prefills],
            decode_groups=[replace(g, rows=move(g.rows), block_tables=move(g.block_tables),
                                   seq_lens=move(g.seq_lens)) for g in self.decode_groups],
            query_start_loc=move(self.query_start_loc),
            prefill_num_cached=move(self.prefill_num_cached),
            prefill_block_tables=move(self.prefill_block_tables))


def slot_of(block_ids: list[int], position: int, block_size: int) -> int:
    """The cache slot of a sequence's token at `position`."""
    return block_ids[position // block_size] * block_size + position % block_size


def _varlen_prefills(chunks: list[PrefillChunk]) -> tuple[torch.Tensor, torch.Tensor,
                                                          torch.Tensor, int]:
    """query_start_loc, num_cached, padded block tables and the longest chunk of the prefills."""
    lens = [c.end - c.start for c in chunks]
    starts = torch.zeros(len(chunks) + 1, dtype=torch.long)
    starts[1:] = torch.tensor(lens, dtype=torch.long).cumsum(0)
    num_cached = torch.tensor([c.num_cached for c in chunks], dtype=torch.long)
    tables = torch.zeros((len(chunks), max((len(c.block_table) for c in chunks), default=0)),
                         dtype=torch.long)
    for i, c in enumerate(chunks):
        tables[i, :len(c.block_table)] = c.block_table
    return starts, num_cached, tables, max(lens, default=0)


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

    ops: ModelOps  # the norms, rope and activation that go with this backend

    @abstractmethod
    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor,
                meta: AttentionMetadata, scale: float) -> torch.Tensor:
        """q: [num_tokens, heads, dim]; k, v: [num_tokens, kv_heads, dim]
        -> [num_tokens, heads, dim]."""


class TorchAttentionBackend(AttentionBackend):
    def __init__(self):
        self.ops = TorchOps()

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


class CpuAttentionBackend(AttentionBackend):
    """One kernel call for all decode rows and one for all prefill chunks, after one KV write
    for the whole step; both read the paged cache in place (no gather, no padding). The
    extension is built (or found in its on-disk cache) here, before the worker reports ready."""

    def __init__(self):
        from kernels import cpu_attention
        self._kernels = cpu_attention
        self.library = cpu_attention.load()  # the CPU kernels' ops (the sampler's race too)
        self.ops = CpuOps(self.library)

    def forward(self, q, k, v, kv_cache, meta, scale):
        self._kernels.write_kv(k, v, kv_cache, meta.slot_mapping, ops=self.library)
        q = q.contiguous()
        out = torch.empty_like(q)
        n = meta.num_decodes
        if n:
            self._kernels.paged_decode_attention(q[:n], kv_cache, meta.decode_block_tables,
                                                 meta.decode_seq_lens, scale, out=out[:n],
                                                 ops=self.library)
        if meta.prefills:
            self._kernels.paged_prefill_attention(q[n:], kv_cache, meta.prefill_block_tables,
                                                  meta.query_start_loc, meta.prefill_num_cached,
                                                  scale, out=out[n:], ops=self.library)
        return out


class TritonAttentionBackend(AttentionBackend):
    """One launch for all decode rows (the kernel walks each row's own blocks, so decode groups
    are not needed) and one for all prefill chunks, after one KV write for the whole step."""

    def __init__(self):
        from kernels import paged_decode_attention, paged_prefill_attention, reshape_and_cache
        self._decode = paged_decode_attention.paged_decode_attention
        self._prefill = paged_prefill_attention.paged_prefill_attention
        self._write_kv = reshape_and_cache.reshape_and_cache
        self.ops = TritonOps()

    def forward(self, q, k, v, kv_cache, meta, scale):
        # the chunk's keys first: prefill then reads every key through the block table
        self._write_kv(k, v, kv_cache, meta.slot_mapping)
        out = torch.empty_like(q)
        n = meta.num_decodes
        if n:
            self._decode(q[:n], kv_cache, meta.decode_block_tables, meta.decode_seq_lens, scale,
                         out=out[:n])
        if meta.prefills:
            self._prefill(q[n:], kv_cache, meta.prefill_block_tables, meta.query_start_loc,
                          meta.prefill_num_cached, meta.max_prefill_len, scale, out=out[n:])
        return out


_BACKENDS: dict[str, Callable[[], AttentionBackend]] = {
    "cpu": CpuAttentionBackend, "torch": TorchAttentionBackend, "triton": TritonAttentionBackend}


def cpu_kernels(backend: AttentionBackend, device: torch.device | str = "cpu"):
    """The CPU kernels' op library for a worker on the CPU (the sampler races in it, and the
    float32 linears multiply in it on AVX2, whatever the attention backend): the cpu backend's
    own, else built or loaded here; None on a GPU or where they cannot be built (then torch's
    generators draw the sampler's noise, and oneDNN packs the linears)."""
    if torch.device(device).type != "cpu":
        return None
    if isinstance(backend, CpuAttentionBackend):
        return backend.library
    from kernels import cpu_attention
    try:
        return cpu_attention.load()
    except (OSError, RuntimeError, ImportError) as e:
        log.warning("the cpu kernels could not be built (%s): the sampler draws through torch, "
                    "and the float32 linears are packed for oneDNN", e)
        return None


def create_attention_backend(name: str, device: torch.device | str = "cpu") -> AttentionBackend:
    """auto: triton when the model's tensors live on CUDA, else cpu; torch where the cpu kernels
    cannot be built (no C++ compiler), with a warning that says why."""
    on_cuda = torch.device(device).type == "cuda"
    if name == "auto" and not on_cuda:
        try:
            return CpuAttentionBackend()
        except (OSError, RuntimeError, ImportError) as e:
            log.warning("the cpu attention kernels could not be built (%s); falling back to the "
                        "slower torch backend", e)
            return TorchAttentionBackend()
    if name == "auto":
        name = "triton"
    if name not in _BACKENDS:
        raise ValueError(f"unknown attention backend {name!r}; known: auto, {', '.join(_BACKENDS)}")
    if name == "cpu" and on_cuda:
        raise ValueError("the cpu attention backend needs the model and its KV cache on the CPU")
    if name == "triton" and not on_cuda and os.environ.get("TRITON_INTERPRET") != "1":
        raise ValueError("the triton attention backend needs CUDA tensors (or TRITON_INTERPRET=1 "
                         "to interpret the kernels on CPU, for tests)")
    return _BACKENDS[name]()
