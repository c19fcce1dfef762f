"""Linear layers whose weights are packed once, at load, for oneDNN's GEMM on the CPU.

`nn.Linear` on the CPU hands the weight to the BLAS in its checkpoint layout, and the BLAS
copies it into its blocked layout on every call: for a decode step's few rows that copy costs
about as much as the multiplication. Packing each weight once into oneDNN's layout removes it.
On 2 AVX2 cores (float32, hidden 512, vocab 32000) the matmuls of a 64-sequence decode step
took 45 ms packed against 66 ms through `nn.Linear`; 16 sequences 16 against 31 ms; a
2048-token prefill on one core 2.5 against 2.7 s.

Sums run in oneDNN's order rather than the BLAS's, so results differ from `nn.Linear` in the
last bits (relative 1e-6 in float32), as any two GEMM libraries do.
"""
from __future__ import annotations

import torch
from torch import nn

# oneDNN picks its blocked layout for a typical row count: a decode batch
BATCH_HINT = 64


def packs(dtype: torch.dtype, device: torch.device | str = "cpu") -> bool:
    """Whether packed linears serve this dtype here: float32 on any CPU oneDNN runs on,
    bfloat16 only where the CPU multiplies it natively (elsewhere oneDNN refuses or emulates)."""
    if torch.device(device).type != "cpu" or not torch.backends.mkldnn.is_available():
        return False
    if dtype == torch.float32:
        return True
    if dtype == torch.bfloat16:
        from kernels.cpu_attention import has_fast_bf16_gemm
        return has_fast_bf16_gemm()
    return False


class PackedLinear(nn.Module):
    """`nn.Linear`'s forward over a weight packed for oneDNN; holds no unpacked copy."""

    def __init__(self, linear: nn.Linear, batch_hint: int = BATCH_HINT):
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        with torch.no_grad():
            self.packed = torch.ops.mkldnn._reorder_linear_weight(linear.weight.detach(),
                                                                   batch_hint)
        self.bias = None if linear.bias is None else linear.bias.detach()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, "none", [], "")

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, " \
               f"bias={self.bias is not None}, packed for oneDNN"


def pack_linears(model: nn.Module) -> int:
    """Replaces every `nn.Linear` inside `model` with its `PackedLinear`; returns how many.
    A weight the linear shares with another module (tied embeddings) stays there as it was;
    the linear multiplies by its own packed copy."""
    targets = [(parent, name, child) for parent in model.modules()
               for name, child in parent.named_children() if isinstance(child, nn.Linear)]
    for parent, name, child in targets:
        setattr(parent, name, PackedLinear(child))
    return len(targets)
