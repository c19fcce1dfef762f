"""The decoder's norms, rotary embedding and activation, one implementation per backend.

The attention backend carries its `ModelOps` (`backend.ops`), so choosing a backend chooses
these too: pure torch (bit-identical to HuggingFace) with the torch backends; with the CPU
kernels, the same three fused in one pass each (kernels/csrc/elementwise.cpp: rounding where
torch's ops round, so bfloat16 results equal torch's but for RMSNorm's order of summation);
Triton kernels on CUDA (fused residual-add RMSNorm, in-place rope, fused SiLU-and-mul).
"""
from __future__ import annotations

from abc import ABC, abstractmethod

import torch

from kernels import reference


class ModelOps(ABC):
    @abstractmethod
    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        """x: [..., hidden] -> [..., hidden]."""

    @abstractmethod
    def add_rms_norm(self, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                     eps: float) -> tuple[torch.Tensor, torch.Tensor]:
        """residual = x + residual; returns (rms_norm(residual), residual). The residual passed
        in may be updated in place: the caller must not use it afterwards."""

    @abstractmethod
    def rope_step(self, positions: torch.Tensor, cos_cache: torch.Tensor,
                  sin_cache: torch.Tensor) -> tuple:
        """Built once per step from positions [num_tokens] and the [max_positions, head_dim]
        caches; every layer's `rope` reuses it."""

    @abstractmethod
    def rope(self, q: torch.Tensor, k: torch.Tensor,
             step: tuple) -> tuple[torch.Tensor, torch.Tensor]:
        """Neox rotation of q [num_tokens, heads, dim] and k [num_tokens, kv_heads, dim]; may
        rotate them in place."""

    @abstractmethod
    def silu_mul(self, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        """silu(gate) * up."""


class TorchOps(ModelOps):
    def rms_norm(self, x, weight, eps):
        return reference.rms_norm(x, weight, eps)

    def add_rms_norm(self, x, residual, weight, eps):
        return reference.fused_add_rms_norm(x, residual, weight, eps)

    def rope_step(self, positions, cos_cache, sin_cache):
        return cos_cache[positions], sin_cache[positions]  # [num_tokens, head_dim] each

    def rope(self, q, k, step):
        cos, sin = step
        return reference.apply_rope(q, cos, sin), reference.apply_rope(k, cos, sin)

    def silu_mul(self, gate, up):
        return torch.nn.functional.silu(gate) * up


class CpuOps(TorchOps):
    """The fused CPU kernels of `library` (kernels.cpu_attention.load()) for float32 and
    bfloat16; torch's ops for other dtypes and for layouts the kernels do not take."""

    FUSED = (torch.float32, torch.bfloat16)

    def __init__(self, library):
        self._lib = library

    def _fused(self, first: torch.Tensor, *others: torch.Tensor) -> bool:
        """Whether the kernels take these: one fused dtype, each innermost dim contiguous."""
        return first.dtype in self.FUSED and all(
            t.dtype == first.dtype and t.stride(-1) == 1 for t in (first, *others))

    def rms_norm(self, x, weight, eps):
        if not self._fused(weight) or x.dtype != weight.dtype:
            return super().rms_norm(x, weight, eps)
        rows = x.reshape(-1, x.shape[-1])  # q/k norms: [tokens, heads, dim] as rows of dim
        out = torch.empty(rows.shape, dtype=x.dtype)
        self._lib.rms_norm(rows, None, weight, eps, out)
        return out.view(x.shape)

    def add_rms_norm(self, x, residual, weight, eps):
        if x.dim() != 2 or not self._fused(x, residual, weight):
            return super().add_rms_norm(x, residual, weight, eps)
        out = torch.empty(x.shape, dtype=x.dtype)
        self._lib.rms_norm(x, residual, weight, eps, out)  # residual += x, in place
        return out, residual

    def rope(self, q, k, step):
        cos, sin = step
        if not self._fused(q, k, cos, sin):
            return super().rope(q, k, step)
        self._lib.rope(q, cos, sin)  # in place
        self._lib.rope(k, cos, sin)
        return q, k

    def silu_mul(self, gate, up):
        if gate.dim() != 2 or not self._fused(gate, up):
            return super().silu_mul(gate, up)
        out = torch.empty(gate.shape, dtype=gate.dtype)
        self._lib.silu_mul(gate, up, out)
        return out


class TritonOps(ModelOps):
    def __init__(self):
        # imported here: TRITON_INTERPRET must be set before any @triton.jit is defined, and the
        # torch path must not need triton at all
        from kernels import activation, rms_norm, rotary
        self._activation, self._rms_norm, self._rotary = activation, rms_norm, rotary

    def rms_norm(self, x, weight, eps):
        return self._rms_norm.rms_norm(x, weight, eps)

    def add_rms_norm(self, x, residual, weight, eps):
        return self._rms_norm.fused_add_rms_norm(x, residual, weight, eps)

    def rope_step(self, positions, cos_cache, sin_cache):
        return positions, cos_cache, sin_cache

    def rope(self, q, k, step):
        return self._rotary.rotary(q, k, *step)

    def silu_mul(self, gate, up):
        return self._activation.silu_mul(gate, up)
