"""The decoder's fused element-wise CPU kernels (kernels/csrc/elementwise.cpp) against torch's
ops as kernels.reference and HuggingFace compute them, on the build this CPU takes and the
portable one, 1 and 2 threads: bfloat16 results equal bit for bit (the kernels round where
torch's ops round), float32 ones within a few ulps. Rows that are not a whole number of
vectors, and the strided views the model passes (gate and up halves of one matmul, q and k
inside the qkv output)."""
import pytest
import torch

from common.models.ops import CpuOps, TorchOps
from kernels import reference

DTYPES = [torch.float32, torch.bfloat16]


def _check(out: torch.Tensor, ref: torch.Tensor) -> None:
    if out.dtype == torch.bfloat16:
        assert torch.equal(out, ref), f"{(out != ref).sum().item()} values differ"
    else:
        torch.testing.assert_close(out, ref, rtol=2e-6, atol=2e-6)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("width", [8, 100, 1536])
def test_silu_mul(ops, threads, dtype, width):
    gen = torch.Generator().manual_seed(width)
    gate_up = (torch.randn(37, 2 * width, generator=gen) * 4).to(dtype)
    gate, up = gate_up.chunk(2, dim=-1)  # strided halves, as the MLP passes them
    out = torch.empty(37, width, dtype=dtype)
    ops.silu_mul(gate, up, out)
    _check(out, torch.nn.functional.silu(gate) * up)


def _every_bfloat16(width: int) -> torch.Tensor:
    """Each of bfloat16's 65536 values once (subnormals, infinities and NaNs among them), in
    rows of `width` (the last padded with zeros)."""
    bits = torch.arange(-32768, 32768, dtype=torch.int32).to(torch.int16)
    rows = -(-len(bits) // width)
    bits = torch.cat([bits, torch.zeros(rows * width - len(bits), dtype=torch.int16)])
    return bits.view(torch.bfloat16).reshape(rows, width)


def _equal_or_both_nan(out: torch.Tensor, ref: torch.Tensor) -> None:
    same = (out == ref) | (out.isnan() & ref.isnan())
    assert same.all(), f"{(~same).sum().item()} values differ, at {out[~same][:4].tolist()}"


def test_silu_mul_every_bfloat16(ops):
    """silu(gate) rounds as torch's for every bfloat16 gate: the bfloat16 kernel's faster exp
    (exp_u20) and its rounding in one instruction (AVX512-BF16) change no bit; rows of 1000, so
    that each ends in a part vector."""
    gate = _every_bfloat16(1000)
    out = torch.empty_like(gate)
    for up in (torch.ones_like(gate), torch.randn(gate.shape, generator=torch.Generator()
                                                  .manual_seed(0)).to(torch.bfloat16)):
        ops.silu_mul(gate, up, out)
        _equal_or_both_nan(out, torch.nn.functional.silu(gate) * up)


def test_residual_add_every_bfloat16(ops):
    """x + residual stored for every bfloat16 x (residual 0; the subnormals, which the
    instruction would flush, and NaNs take at::vec's rounding) and its norm, as torch's."""
    x = _every_bfloat16(512)
    residual = torch.zeros_like(x)
    weight = torch.ones(x.shape[1], dtype=torch.bfloat16)
    ref_out, ref_residual = reference.fused_add_rms_norm(x, residual.clone(), weight, 1e-6)
    out = torch.empty_like(x)
    ops.rms_norm(x, residual, weight, 1e-6, out)
    _equal_or_both_nan(residual, ref_residual)
    _equal_or_both_nan(out, ref_out)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("hidden", [24, 72, 512])
def test_add_rms_norm(ops, threads, dtype, hidden):
    gen = torch.Generator().manual_seed(hidden)
    x, residual = (torch.randn(2, 29, hidden, generator=gen) * 3).to(dtype)
    weight = torch.randn(hidden, generator=gen).to(dtype)
    ref_out, ref_residual = reference.fused_add_rms_norm(x, residual.clone(), weight, 1e-6)
    out = torch.empty_like(x)
    ops.rms_norm(x, residual, weight, 1e-6, out)
    assert torch.equal(residual, ref_residual)  # x + residual, in place, rounded as torch's add
    _check(out, ref_out)
    ops.rms_norm(x, None, weight, 1e-5, out)  # no residual: the first layer's norm
    _check(out, reference.rms_norm(x, weight, 1e-5))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("head_dim", [16, 40, 64, 128])
def test_rope_in_place(ops, threads, dtype, head_dim):
    gen = torch.Generator().manual_seed(head_dim)
    tokens, heads, kv_heads = 23, 8, 2
    qkv = torch.randn(tokens, (heads + 2 * kv_heads) * head_dim, generator=gen).to(dtype)
    q = qkv[:, :heads * head_dim].view(tokens, heads, head_dim)
    k = qkv[:, heads * head_dim:(heads + kv_heads) * head_dim].view(tokens, kv_heads, head_dim)
    positions = torch.randint(0, 4096, (tokens,), generator=gen)
    cos, sin = reference.rope_cos_sin(reference.rope_inv_freq(head_dim, 10000.0, None), 4096)
    cos, sin = cos[positions].to(dtype), sin[positions].to(dtype)
    ref_q, ref_k = reference.apply_rope(q, cos, sin), reference.apply_rope(k, cos, sin)
    v_before = qkv[:, (heads + kv_heads) * head_dim:].clone()
    ops.rope(q, cos, sin)
    ops.rope(k, cos, sin)
    _check(q, ref_q)
    _check(k, ref_k)
    assert torch.equal(qkv[:, (heads + kv_heads) * head_dim:], v_before)  # v untouched


def test_bad_inputs_fail_clearly(ops):
    x = torch.randn(4, 8)
    with pytest.raises(RuntimeError, match="float32 or bfloat16"):
        ops.silu_mul(x.half(), x.half(), torch.empty(4, 8, dtype=torch.half))
    with pytest.raises(RuntimeError, match="shape and dtype"):
        ops.silu_mul(x, torch.randn(4, 9), torch.empty(4, 8))
    with pytest.raises(RuntimeError, match="weight"):
        ops.rms_norm(x, None, torch.ones(7), 1e-6, torch.empty(4, 8))
    with pytest.raises(RuntimeError, match="head_dim even"):
        ops.rope(torch.randn(4, 2, 7), torch.randn(4, 7), torch.randn(4, 7))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_cpu_ops_equal_torch_ops(ops, dtype):
    """What the model calls: CpuOps on the kernels (float32, bfloat16) or on torch (others), the
    same results as TorchOps, q/k norms of [tokens, heads, dim] included."""
    gen = torch.Generator().manual_seed(0)
    fused, plain = CpuOps(ops), TorchOps()
    x, residual = (torch.randn(2, 11, 64, generator=gen) * 2).to(dtype)
    weight = torch.randn(64, generator=gen).to(dtype)
    got, got_res = fused.add_rms_norm(x, residual.clone(), weight, 1e-6)
    want, want_res = plain.add_rms_norm(x, residual.clone(), weight, 1e-6)
    _check(got_res, want_res)
    _check(got, want)
    heads = x.view(11, 4, 16)
    torch.testing.assert_close(fused.rms_norm(heads, weight[:16], 1e-6),
                               plain.rms_norm(heads, weight[:16], 1e-6), rtol=2e-6, atol=2e-6)
    gate, up = x.chunk(2, dim=-1)
    _check(fused.silu_mul(gate, up), plain.silu_mul(gate, up))
    cos, sin = (torch.randn(11, 16, generator=gen).to(dtype) for _ in range(2))
    q, k = x.view(11, 4, 16).clone(), residual.view(11, 4, 16)[:, :2].clone()
    want_q, want_k = plain.rope(q.clone(), k.clone(), (cos, sin))
    got_q, got_k = fused.rope(q, k, (cos, sin))
    _check(got_q, want_q)
    _check(got_k, want_k)
