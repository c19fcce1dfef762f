"""The shape of a worker's KV cache blocks, which workers exchanging KV must agree on: known to
the scheduler (compatibility, block size), the workers and the transports. No torch here, so the
scheduler can hold one; `torch_dtype` imports it only when a cache is made."""
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
        return (f"(layers={self.num_layers}, kv_heads={self.num_kv_heads}, "
                f"head_dim={self.head_dim}, block_size={self.block_size}, dtype={self.dtype})")
