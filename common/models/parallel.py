"""Tensor parallelism of the Llama family: which rows and columns of each weight a rank of a
group of T holds, and the collectives between them (torch.distributed: gloo for CPU tensors,
NCCL for GPU ones).

    qkv_proj, gate_up_proj   column-parallel: a rank holds its heads' / its share's rows
    o_proj, down_proj        row-parallel: the matching columns; one all-reduce each, so one
                             per attention block and one per MLP block
    embed_tokens, lm_head    vocab-parallel: a rank holds vocab / T rows; the embedding is
                             all-reduced (each token's row is on one rank), the logits
                             all-gathered

Query heads split evenly. KV heads split with them while T divides their number; past it each
KV head is replicated on the T / num_kv_heads ranks whose query heads use it (GQA). A rank's
KV cache holds its own KV heads under the same block ids as every other rank's.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from common.kv_layout import kv_head_split, layer_split


@dataclass(frozen=True)
class TensorParallel:
    rank: int
    size: int
    group: object = None  # a torch.distributed process group; None: the default one

    def __post_init__(self) -> None:
        if not 0 <= self.rank < self.size:
            raise ValueError(f"rank {self.rank} is not in a group of {self.size}")

    def check(self, num_heads: int, num_kv_heads: int, intermediate: int, vocab: int) -> None:
        """Raises ValueError for a model this group cannot split."""
        t = self.size
        if num_heads % t or intermediate % t or vocab % t:
            raise ValueError(f"--tensor-parallel-size {t} must divide the attention heads "
                             f"({num_heads}), the MLP width ({intermediate}) and the "
                             f"vocabulary ({vocab})")
        if num_kv_heads % t and t % num_kv_heads:
            raise ValueError(f"--tensor-parallel-size {t} and the {num_kv_heads} KV heads "
                             "must divide one another")

    def share(self, n: int) -> tuple[int, int]:
        """[start, end) of this rank's even share of n."""
        k = n // self.size
        return self.rank * k, (self.rank + 1) * k

    def kv_heads(self, num_heads: int, num_kv_heads: int) -> tuple[int, int]:
        """[start, end) of the KV heads this rank's query heads use."""
        return kv_head_split(num_kv_heads, self.size, self.rank)

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        dist.all_reduce(x, group=self.group)
        return x

    def all_gather_last(self, x: torch.Tensor) -> torch.Tensor:
        """Every rank's x side by side along the last dimension, in rank order."""
        parts = [torch.empty_like(x) for _ in range(self.size)]
        dist.all_gather(parts, x.contiguous(), group=self.group)
        return torch.cat(parts, dim=-1)


class VocabParallelEmbedding(torch.nn.Module):
    """An embedding whose rows [start, end) of the vocabulary live on this rank."""

    def __init__(self, vocab: int, hidden: int, tp: TensorParallel):
        super().__init__()
        self.tp = tp
        self.start, self.end = tp.share(vocab)
        self.weight = torch.nn.Parameter(torch.empty(self.end - self.start, hidden))

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        mine = (ids >= self.start) & (ids < self.end)
        out = torch.nn.functional.embedding(torch.where(mine, ids - self.start, 0), self.weight)
        out = out * mine.unsqueeze(-1).to(out.dtype)
        return self.tp.all_reduce(out)


@dataclass(frozen=True)
class PipelineParallel:
    """Stage `stage` of `size`: a contiguous run of the layers, the embedding on the first
    stage, the final norm and LM head on the last. Between stages the hidden states and the
    residual stream go point to point to the next stage's rank(s) (`prev`, `next`: global
    ranks of this rank's peers; with tensor parallelism each TP rank talks to its namesake)."""
    stage: int
    size: int
    prev: int = -1
    next: int = -1
    # sends under way: a stage goes on with its next micro-batch while one leaves
    _sending: list = field(default_factory=list, compare=False, repr=False)

    def __post_init__(self) -> None:
        if not 0 <= self.stage < self.size:
            raise ValueError(f"stage {self.stage} is not in a pipeline of {self.size}")

    @property
    def is_first(self) -> bool:
        return self.stage == 0

    @property
    def is_last(self) -> bool:
        return self.stage == self.size - 1

    def layers(self, num_layers: int) -> tuple[int, int]:
        """[start, end) of this stage's layers: an even split, the first stages one more."""
        return layer_split(num_layers, self.size, self.stage)

    def send(self, h: torch.Tensor, residual: torch.Tensor) -> None:
        """Starts sending; flush() waits for every send started."""
        both = torch.stack([h, residual]).contiguous()
        self._sending.append((both, dist.isend(both, self.next)))

    def flush(self) -> None:
        for _, work in self._sending:
            work.wait()
        self._sending.clear()

    def recv(self, num_tokens: int, hidden: int, dtype: torch.dtype,
             device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        both = torch.empty(2, num_tokens, hidden, dtype=dtype, device=device)
        dist.recv(both, self.prev)
        return both[0], both[1]
