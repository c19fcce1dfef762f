"""The shape of a worker's KV cache blocks, which workers exchanging KV must agree on: known to
the scheduler (compatibility, block size), the workers and the transports. No torch here, so the
scheduler can hold one; `torch_dtype` imports it only when a cache is made.

A worker group (tensor parallel size T, pipeline parallel size P) registers the model's whole
layout with T and P recorded; each of its ranks holds one shard of it (`KVShard`): its stage's
layers and its KV heads, under the same block ids as every other rank. Groups of different shapes
exchange KV shard to shard (kv_transfer/base.py)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

DTYPE_BYTES = {"float32": 4, "float16": 2, "bfloat16": 2}


@dataclass(frozen=True)
class KVLayout:
    num_layers: int
    num_kv_heads: int
    head_dim: int
    block_size: int
    dtype: str  # torch dtype name without the "torch." prefix
    tensor_parallel_size: int = 1    # a worker group's: ranks splitting the KV heads
    pipeline_parallel_size: int = 1  # ... and stages splitting the layers

    def same_model(self, other: KVLayout) -> bool:
        """Whether the two hold the same KV, whatever their group shapes (which may differ
        between workers exchanging KV)."""
        return self.model_layout() == other.model_layout()

    def model_layout(self) -> KVLayout:
        """This layout without the group shape."""
        return KVLayout(self.num_layers, self.num_kv_heads, self.head_dim, self.block_size,
                        self.dtype)

    def shard(self, tp_rank: int = 0, pp_stage: int = 0) -> KVShard:
        """The part of the KV that tensor-parallel rank tp_rank of pipeline stage pp_stage
        holds."""
        layers = layer_split(self.num_layers, self.pipeline_parallel_size, pp_stage)
        heads = kv_head_split(self.num_kv_heads, self.tensor_parallel_size, tp_rank)
        # past the KV heads' number a head is replicated: its first holder sends it
        replicas = max(1, self.tensor_parallel_size // self.num_kv_heads)
        return KVShard(*layers, *heads, sends=tp_rank % replicas == 0)

    def shard_layout(self, shard: KVShard) -> KVLayout:
        """The layout of one cache holding `shard`."""
        return KVLayout(shard.layer_end - shard.layer_start, shard.head_end - shard.head_start,
                        self.head_dim, self.block_size, self.dtype)

    def cache_shape(self, num_blocks: int) -> tuple[int, ...]:
        return (self.num_layers, 2, num_blocks, self.block_size, self.num_kv_heads, self.head_dim)

    @property
    def torch_dtype(self) -> torch.dtype:
        import torch
        dtype = getattr(torch, self.dtype, None)
        assert isinstance(dtype, torch.dtype), f"unknown dtype {self.dtype}"
        return dtype

    @property
    def element_bytes(self) -> int:
        assert self.dtype in DTYPE_BYTES, f"unknown KV dtype {self.dtype}"
        return DTYPE_BYTES[self.dtype]

    @property
    def block_bytes(self) -> int:
        """Bytes of one block across all layers, keys and values."""
        return (2 * self.num_layers * self.block_size * self.num_kv_heads * self.head_dim
                * self.element_bytes)

    def __str__(self) -> str:
        group = "" if self.tensor_parallel_size == self.pipeline_parallel_size == 1 else \
            f", tp={self.tensor_parallel_size}, pp={self.pipeline_parallel_size}"
        return (f"(layers={self.num_layers}, kv_heads={self.num_kv_heads}, "
                f"head_dim={self.head_dim}, block_size={self.block_size}, dtype={self.dtype}"
                f"{group})")


@dataclass(frozen=True)
class KVShard:
    """Layers [layer_start, layer_end) and KV heads [head_start, head_end) of a model's KV: what
    one cache holds. `sends`: whether this shard sends its heads to a peer (a head replicated on
    several ranks of a group goes from the first only)."""
    layer_start: int
    layer_end: int
    head_start: int
    head_end: int
    sends: bool = True

    @staticmethod
    def whole(layout: KVLayout) -> KVShard:
        return KVShard(0, layout.num_layers, 0, layout.num_kv_heads)

    def layers(self, start: int, end: int) -> KVShard:
        """Its cache's layers [start, end), in the model's numbering."""
        return KVShard(self.layer_start + start, self.layer_start + end, self.head_start,
                       self.head_end)

    def part(self, cache, region: KVShard):
        """The view of `cache` (a tensor `[layers, 2, blocks, block_size, heads, head_dim]`
        holding this shard) at the model's layers and heads `region`, which it holds."""
        return cache[region.layer_start - self.layer_start:region.layer_end - self.layer_start,
                     :, :, :, region.head_start - self.head_start:region.head_end - self.head_start]

    def overlap(self, other: KVShard) -> KVShard | None:
        """The layers and heads both hold; None if none."""
        l0, l1 = max(self.layer_start, other.layer_start), min(self.layer_end, other.layer_end)
        h0, h1 = max(self.head_start, other.head_start), min(self.head_end, other.head_end)
        return KVShard(l0, l1, h0, h1) if l0 < l1 and h0 < h1 else None


def shard_of(query: str) -> KVShard:
    """The shard an endpoint's query names: `layers=A-B&heads=C-D` (ValueError if it does
    not)."""
    fields = dict(kv.partition("=")[::2] for kv in query.split("&"))
    ranges = []
    for key in ("layers", "heads"):
        lo, _, hi = fields[key].partition("-") if key in fields else ("", "", "")
        start, end = int(lo), int(hi)
        if not 0 <= start < end:
            raise ValueError(f"empty {key} range")
        ranges += [start, end]
    return KVShard(ranges[0], ranges[1], ranges[2], ranges[3])


def layer_split(num_layers: int, size: int, stage: int) -> tuple[int, int]:
    """[start, end) of pipeline stage `stage` of `size`: an even split, the first stages one
    more."""
    if num_layers < size:
        raise ValueError(f"--pipeline-parallel-size {size} exceeds the model's "
                         f"{num_layers} layers")
    k, extra = divmod(num_layers, size)
    start = stage * k + min(stage, extra)
    return start, start + k + (stage < extra)


def kv_head_split(num_kv_heads: int, size: int, rank: int) -> tuple[int, int]:
    """[start, end) of the KV heads tensor-parallel rank `rank` of `size` holds: an even share
    while size divides their number, else the one head its query heads use (replicated on
    size / num_kv_heads ranks, as GQA requires)."""
    if num_kv_heads >= size:
        k = num_kv_heads // size
        return rank * k, (rank + 1) * k
    head = rank * num_kv_heads // size
    return head, head + 1
