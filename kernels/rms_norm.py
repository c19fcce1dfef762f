"""RMSNorm, and RMSNorm fused with the residual add that precedes it in a decoder layer.

References: `kernels.reference.rms_norm` and `kernels.reference.fused_add_rms_norm`. One program
per row; the row is normalized in fp32 and rounded to the input dtype before the weight multiply,
like HuggingFace (a product of two 16-bit floats is exact in fp32, so rounding once after the fp32
multiply gives the 16-bit multiply's result).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _rms_norm_kernel(
    x_ptr,                       # [num_rows, hidden]
    residual_ptr,                # [num_rows, hidden], updated in place (HAS_RESIDUAL)
    weight_ptr,                  # [hidden]
    out_ptr,                     # [num_rows, hidden]
    stride_x, stride_r, stride_o, eps,
    HIDDEN: tl.constexpr, BLOCK: tl.constexpr, HAS_RESIDUAL: tl.constexpr,
):
    row = tl.program_id(0)
    offs = tl.arange(0, BLOCK)
    mask = offs < HIDDEN
    x = tl.load(x_ptr + row * stride_x + offs, mask=mask, other=0.0)
    if HAS_RESIDUAL:
        # residual = x + residual, rounded to the model dtype like the unfused add
        r = tl.load(residual_ptr + row * stride_r + offs, mask=mask, other=0.0)
        x = (x.to(tl.float32) + r.to(tl.float32)).to(r.dtype)
        tl.store(residual_ptr + row * stride_r + offs, x, mask=mask)
    xf = x.to(tl.float32)
    rstd = tl.rsqrt(tl.sum(xf * xf, 0) / HIDDEN + eps)
    normed = (xf * rstd).to(out_ptr.dtype.element_ty).to(tl.float32)
    w = tl.load(weight_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + row * stride_o + offs, (normed * w).to(out_ptr.dtype.element_ty), mask=mask)


def _launch(x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor,
            eps: float) -> torch.Tensor:
    hidden = x.shape[-1]
    assert weight.shape == (hidden,), f"weight {tuple(weight.shape)} for rows of {hidden}"
    assert weight.dtype == x.dtype, f"weight {weight.dtype} != x {x.dtype}"
    assert x.stride(-1) == 1 and weight.stride(0) == 1, "rows must be contiguous"
    rows = x.reshape(-1, hidden)                           # [num_rows, hidden]
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    res = rows
    if residual is not None:
        assert residual.shape == x.shape and residual.dtype == x.dtype, (
            f"residual {tuple(residual.shape)} {residual.dtype} vs x {tuple(x.shape)} {x.dtype}")
        assert residual.is_contiguous(), "the residual is updated in place"
        res = residual.view(-1, hidden)
    if rows.shape[0] == 0:
        return out
    block = triton.next_power_of_2(hidden)
    _rms_norm_kernel[(rows.shape[0],)](
        rows, res, weight, out, rows.stride(0), res.stride(0), hidden, eps,
        HIDDEN=hidden, BLOCK=block, HAS_RESIDUAL=residual is not None,
        num_warps=min(16, max(1, block // 512)),
    )
    return out


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x: [..., hidden] -> [..., hidden]."""
    return _launch(x, None, weight, eps)


def fused_add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                       eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """residual = x + residual (in place); returns (rms_norm(residual), residual)."""
    return _launch(x, residual, weight, eps), residual
