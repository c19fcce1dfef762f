"""Linear layers whose weights are packed once, at load: into panels for the CPU kernels' own
float32 linear (kernels/csrc/linear.cpp) on an AVX2 CPU, else for oneDNN's GEMM.

`nn.Linear` on the CPU hands the weight to the BLAS in its checkpoint layout, and the BLAS
copies it into its blocked layout on every call: for a decode step's few rows that copy costs
about as much as the multiplication. Packing each weight once into oneDNN's layout removes it.
On 2 AVX2 cores (float32, hidden 512, vocab 32000) the matmuls of a 64-sequence decode step
took 45 ms packed against 66 ms through `nn.Linear`; 16 sequences 16 against 31 ms; a
2048-token prefill on one core 2.5 against 2.7 s.

oneDNN's kernels for a few rows read the weights at well under the core's read rate. The
panel kernel streams each weight once for up to 6 rows: on 2 Zen 1 cores (AVX2, the 56M
benchmark model's linears, benchmarks/linears.py) a forward's linears took 0.80-0.84x oneDNN's
time at 1-16 rows on one thread, 0.94-0.97x at 32-64 and the same at 256 or more. Its sums run
in position order, one chain per output, so a row's result does not depend on the rows beside
it.

Sums run in another order than the BLAS's, so results differ from `nn.Linear` in the last bits
(relative 1e-6 in float32), as any two GEMM libraries do.
"""
from __future__ import annotations

import torch
from torch import nn

from common.models.attention import AttentionBackend, cpu_kernels

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


def panel_library(dtype: torch.dtype, backend: AttentionBackend,
                  device: torch.device | str = "cpu"):
    """The CPU kernels' op library (`cpu_kernels`: the attention backend's own, else loaded)
    where its panel linears serve `dtype` here: float32 on a CPU whose build is AVX2, where
    they were measured against oneDNN. None elsewhere (oneDNN's AVX-512 kernels were not
    measured against them), and where the kernels cannot be built (`cpu_kernels` warns; then
    oneDNN packs)."""
    if dtype != torch.float32:
        return None
    from kernels import cpu_attention
    if cpu_attention.cpu_isa() != "AVX2":
        return None
    return cpu_kernels(backend, device)


class PackedLinear(nn.Module):
    """`nn.Linear`'s forward over a weight packed once: into panels for the panel kernel of
    `library` (the CPU kernels' ops, float32) where given, else for oneDNN. Holds no unpacked
    copy."""

    def __init__(self, linear: nn.Linear, batch_hint: int = BATCH_HINT, library=None):
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.library = library
        with torch.no_grad():
            if library is not None:
                from kernels import cpu_attention
                self._kernels = cpu_attention
                self.packed = cpu_attention.pack_linear_weight(linear.weight, ops=library)
            else:
                self.packed = torch.ops.mkldnn._reorder_linear_weight(linear.weight.detach(),
                                                                       batch_hint)
        self.bias = None if linear.bias is None else linear.bias.detach()

    @property
    def kernel(self) -> str:
        return "oneDNN" if self.library is None else "panels"

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.library is not None:
            return self._kernels.packed_linear(x, self.packed, self.out_features, self.bias,
                                               ops=self.library)
        return torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, "none", [], "")

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, " \
               f"bias={self.bias is not None}, packed for {self.kernel}"


def pack_linears(model: nn.Module, library=None) -> int:
    """Replaces every `nn.Linear` inside `model` with its `PackedLinear` (into panels for
    `library`'s kernel where given, else for oneDNN); returns how many. A weight the linear
    shares with another module (tied embeddings) stays there as it was; the linear multiplies
    by its own packed copy."""
    targets = [(parent, name, child) for parent in model.modules()
               for name, child in parent.named_children() if isinstance(child, nn.Linear)]
    for parent, name, child in targets:
        setattr(parent, name, PackedLinear(child, library=library))
    return len(targets)


def panel_kernels(model: nn.Module):
    """The op library whose panel kernel multiplies the model's linears, or None where none
    does (oneDNN's, or unpacked)."""
    return next((m.library for m in model.modules()
                 if isinstance(m, PackedLinear) and m.library is not None), None)
