"""Decode steps replayed from CUDA graphs: one graph per batch-size bucket, captured at start-up.

A decode-only step launches a few kernels per layer, each doing microseconds of work, so on a GPU
the Python and launch overhead of the eager forward is most of the step. The whole decode forward
is captured once per bucket over static input buffers; a step copies its inputs into the first
rows of the smallest bucket that holds it and replays that graph. Rows past the real batch are
padding that the kernels skip: slot -1 (the KV write writes nothing) and length 0 (attention
writes zeros).

    buckets   1 2 4 8 16 24 32 40 48 56 64 80 96 112 128 160 192 224 256 ...
    step of 5 decodes  -> bucket 8: rows 0-4 real, 5-7 padding

Prefill and mixed steps (their shapes vary with every chunk), steps larger than the largest
bucket, and steps that stream KV layer by layer run eagerly. `--enforce-eager` turns graphs off.
"""
from __future__ import annotations

import bisect
import logging
import time

import numpy as np
import torch

from common.models.attention import AttentionMetadata, slot_of
from common.models.llama import LlamaForCausalLM

log = logging.getLogger(__name__)

MAX_BATCH = 256  # the scheduler's default --max-num-seqs


def batch_buckets(max_batch: int) -> list[int]:
    """Bucket sizes up to max_batch: fine steps for small batches, where most decode time is."""
    out, size = [], 1
    while size < max_batch:
        out.append(size)
        step = 1 if size < 8 else 8 if size < 64 else 16 if size < 128 else 32
        size = size * 2 if size < 8 else size + step
    return out + [max_batch]


class DecodeGraphs:
    """The decode forward over static buffers, per bucket: captured as a CUDA graph on a GPU (or
    run eagerly over the same padded buffers, where `capture` is False)."""

    def __init__(self, model: LlamaForCausalLM, kv_caches: list[torch.Tensor], block_size: int,
                 max_model_len: int, max_batch: int = MAX_BATCH):
        self.model = model
        self.kv_caches = kv_caches
        self.block_size = block_size
        self.buckets = batch_buckets(max_batch)
        self.max_blocks = -(-max_model_len // block_size)
        device = kv_caches[0].device
        n = self.buckets[-1]
        self.ids = torch.zeros(n, dtype=torch.long, device=device)
        self.positions = torch.zeros(n, dtype=torch.long, device=device)
        self.slots = torch.full((n,), -1, dtype=torch.long, device=device)
        self.tables = torch.zeros((n, self.max_blocks), dtype=torch.long, device=device)
        self.seq_lens = torch.zeros(n, dtype=torch.long, device=device)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.outputs: dict[int, torch.Tensor] = {}
        self.replays = 0  # steps served from a graph

    def fits(self, num_decodes: int, max_blocks: int) -> bool:
        return 0 < num_decodes <= self.buckets[-1] and max_blocks <= self.max_blocks

    def capture(self) -> None:
        """One graph per bucket, largest first, all in one memory pool (a smaller bucket's
        activations fit in what the larger one's took)."""
        start = time.monotonic()
        pool = None
        stream = torch.cuda.Stream()
        for bucket in reversed(self.buckets):
            stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(stream):  # warm-up: compiles and autotunes outside capture
                self._forward(bucket)
            torch.cuda.current_stream().wait_stream(stream)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                self.outputs[bucket] = self._forward(bucket)
            pool = graph.pool()
            self.graphs[bucket] = graph
        torch.cuda.synchronize()
        log.info("captured %d decode CUDA graphs (batch 1..%d) in %.1f s", len(self.graphs),
                 self.buckets[-1], time.monotonic() - start)

    def run(self, ids: list[int], decodes: list[tuple[int, list[int]]]) -> torch.Tensor:
        """Hidden states [len(ids), hidden] of one decode token per sequence; decodes as
        AttentionMetadata.build takes them: (num_computed, block_ids) per sequence."""
        n = len(ids)
        bucket = self.buckets[bisect.bisect_left(self.buckets, n)]
        # only the columns this step's rows use: a row's columns past its own length are never
        # read (its length bounds the kernel), nor are a padding row's (length 0)
        width = max(len(row) for _, row in decodes)
        table = np.zeros((bucket, width), dtype=np.int64)
        for i, (_, row) in enumerate(decodes):
            table[i, :len(row)] = row
        positions = [p for p, _ in decodes]
        slots = [slot_of(row, p, self.block_size) for p, row in decodes]
        pad = bucket - n
        host = torch.tensor([ids + [0] * pad, positions + [0] * pad, slots + [-1] * pad,
                             [p + 1 for p in positions] + [0] * pad], dtype=torch.long)
        table_t = torch.from_numpy(table)
        if self.ids.is_cuda:
            host, table_t = host.pin_memory(), table_t.pin_memory()
        for dst, src in zip((self.ids, self.positions, self.slots, self.seq_lens), host):
            dst[:bucket].copy_(src, non_blocking=True)
        self.tables[:bucket, :width].copy_(table_t, non_blocking=True)
        graph = self.graphs.get(bucket)
        if graph is None:
            out = self._forward(bucket)
        else:
            graph.replay()
            out = self.outputs[bucket]
            self.replays += 1
        return out[:n]

    def _forward(self, bucket: int) -> torch.Tensor:
        meta = AttentionMetadata(
            slot_mapping=self.slots[:bucket], num_decodes=bucket,
            decode_block_tables=self.tables[:bucket], decode_seq_lens=self.seq_lens[:bucket],
            prefills=[], decode_groups=[])
        return self.model(self.ids[:bucket], self.positions[:bucket], self.kv_caches, meta)
