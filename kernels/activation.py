"""SiLU-and-mul: the gated MLP's activation, silu(gate) * up, in one pass over memory.

Reference: `kernels.reference.silu_and_mul`. silu is computed in fp32 and rounded to the input
dtype before the multiply, like torch's `F.silu(gate) * up`.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK = 1024


@triton.jit
def _silu_and_mul_kernel(
    gate_ptr, up_ptr,            # [num_rows, n] each
    out_ptr,                     # [num_rows, n]
    stride_g, stride_u, stride_o, n,
    BLOCK: tl.constexpr,
):
    row, col = tl.program_id(0), tl.program_id(1)
    offs = col * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    g = tl.load(gate_ptr + row * stride_g + offs, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(up_ptr + row * stride_u + offs, mask=mask, other=0.0).to(tl.float32)
    silu = (g / (1.0 + tl.exp(-g))).to(out_ptr.dtype.element_ty).to(tl.float32)
    tl.store(out_ptr + row * stride_o + offs, (silu * u).to(out_ptr.dtype.element_ty), mask=mask)


def silu_mul(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """gate, up: [..., n] -> silu(gate) * up, [..., n]."""
    assert gate.shape == up.shape, f"gate {tuple(gate.shape)} != up {tuple(up.shape)}"
    assert gate.dtype == up.dtype, f"gate {gate.dtype} != up {up.dtype}"
    assert gate.stride(-1) == up.stride(-1) == 1, "rows must be contiguous"
    n = gate.shape[-1]
    g, u = gate.reshape(-1, n), up.reshape(-1, n)          # [num_rows, n]
    out = torch.empty(gate.shape, dtype=gate.dtype, device=gate.device)
    rows = out.view(-1, n)
    if g.shape[0] and n:
        _silu_and_mul_kernel[(g.shape[0], triton.cdiv(n, BLOCK))](
            g, u, rows, g.stride(0), u.stride(0), rows.stride(0), n, BLOCK=BLOCK)
    return out


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """gate_up: [..., 2 * n], gate first -> [..., n]."""
    assert gate_up.shape[-1] % 2 == 0, f"last dim {gate_up.shape[-1]} is not gate + up"
    gate, up = gate_up.chunk(2, dim=-1)
    return silu_mul(gate, up)
