"""The float32 linear over packed panels (kernels/csrc/linear.cpp), on the build this CPU takes
and the portable one, 1 and 2 threads: the packed layout exactly; each output within the error
bound of a float32 dot product of its length against float64; a row's result the same bit for
bit whatever the rows beside it and the thread count; strided rows, biases, widths that are not
a whole number of panels, and the checks on what it is given."""
import pytest
import torch

from kernels import cpu_attention

EPS = torch.finfo(torch.float32).eps


def _weights(n: int, k: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, k, generator=g), torch.randn(n, generator=g)


def test_pack_layout(ops):
    w, _ = _weights(37, 11, 0)
    packed = cpu_attention.pack_linear_weight(w, ops=ops)
    width = packed.shape[2]
    assert width in (16, 32)  # two float vectors of the build
    assert packed.shape == (-(-37 // width), 11, width)
    for p in range(packed.shape[0]):
        for j in range(width):
            col = packed[p, :, j]
            if p * width + j < 37:
                assert torch.equal(col, w[p * width + j])
            else:
                assert torch.equal(col, torch.zeros(11))


def _bounded(out: torch.Tensor, x: torch.Tensor, w: torch.Tensor,
             b: torch.Tensor | None) -> None:
    """out within the rounding bound of float32 sums of k products (and the bias): k eps times
    the sum of the terms' magnitudes, the bound for any order of summation."""
    x64, w64 = x.double(), w.double()
    ref = x64 @ w64.T
    mag = x64.abs() @ w64.abs().T
    if b is not None:
        ref, mag = ref + b.double(), mag + b.double().abs()
    bound = (x.shape[-1] + 1) * EPS * mag + 1e-30
    err = (out.double() - ref).abs()
    assert (err <= bound).all(), f"{(err > bound).sum().item()} outputs past the bound, " \
                                 f"the worst {(err / bound).max().item():.2f}x"


@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("n,k", [(1, 5), (16, 64), (150, 97), (520, 512)])
@pytest.mark.parametrize("rows", [1, 2, 5, 6, 7, 13, 96, 97, 200])
def test_packed_linear_within_the_bound(ops, threads, rows, n, k, bias):
    w, b = _weights(n, k, rows * 1000 + n)
    b = b if bias else None
    x = torch.randn(rows, k, generator=torch.Generator().manual_seed(rows))
    packed = cpu_attention.pack_linear_weight(w, ops=ops)
    out = cpu_attention.packed_linear(x, packed, n, b, ops=ops)
    assert out.shape == (rows, n) and out.dtype == torch.float32
    _bounded(out, x, w, b)


def test_strided_rows_and_leading_dims(ops):
    w, b = _weights(40, 24, 1)
    packed = cpu_attention.pack_linear_weight(w, ops=ops)
    wide = torch.randn(9, 3 * 24, generator=torch.Generator().manual_seed(2))
    x = wide[:, 24:48]  # rows strided by 72, as the model's slices of fused projections
    out = cpu_attention.packed_linear(x, packed, 40, b, ops=ops)
    assert torch.equal(out, cpu_attention.packed_linear(x.contiguous(), packed, 40, b, ops=ops))
    _bounded(out, x, w, b)
    x3 = x.contiguous().view(3, 3, 24)
    assert torch.equal(cpu_attention.packed_linear(x3, packed, 40, b, ops=ops),
                       out.view(3, 3, 40))
    # a transposed view: columns not contiguous, copied first
    xt = torch.randn(24, 9, generator=torch.Generator().manual_seed(3)).T
    _bounded(cpu_attention.packed_linear(xt, packed, 40, b, ops=ops), xt, w, b)
    assert cpu_attention.packed_linear(torch.empty(0, 24), packed, 40, b, ops=ops).shape == (0, 40)


def test_a_row_is_the_same_in_every_batch(ops):
    """Each output is one chain of multiply-adds in position order, so a row computes the same
    bits alone, at any place among others (across the 6-row passes and the 96-row chunks),
    and on 1 or 2 threads."""
    w, b = _weights(300, 200, 4)
    packed = cpu_attention.pack_linear_weight(w, ops=ops)
    x = torch.randn(211, 200, generator=torch.Generator().manual_seed(5))
    before = torch.get_num_threads()
    try:
        outs = []
        for threads in (1, 2):
            torch.set_num_threads(threads)
            outs.append(cpu_attention.packed_linear(x, packed, 300, b, ops=ops))
        assert torch.equal(outs[0], outs[1])
        for i in (0, 5, 6, 95, 96, 97, 210):
            alone = cpu_attention.packed_linear(x[i:i + 1], packed, 300, b, ops=ops)
            assert torch.equal(alone[0], outs[0][i]), i
        window = cpu_attention.packed_linear(x[90:103], packed, 300, b, ops=ops)
        assert torch.equal(window, outs[0][90:103])
    finally:
        torch.set_num_threads(before)


def test_checks(ops):
    w, b = _weights(20, 8, 6)
    packed = cpu_attention.pack_linear_weight(w, ops=ops)
    x = torch.randn(3, 8)
    out = torch.empty(3, 20)
    with pytest.raises(RuntimeError, match="packed: a weight from this build"):
        ops.packed_linear(x, w, None, out)  # not packed
    with pytest.raises(RuntimeError, match=r"x: a CPU float32 \[rows, 8\]"):
        ops.packed_linear(torch.randn(3, 9), packed, None, out)
    with pytest.raises(RuntimeError, match=r"x: a CPU float32"):
        ops.packed_linear(x.double(), packed, None, out)
    with pytest.raises(RuntimeError, match="out: a CPU float32"):
        ops.packed_linear(x, packed, None, torch.empty(3, 40))  # wider than the weight
    with pytest.raises(RuntimeError, match="out: a CPU float32"):
        ops.packed_linear(x, packed, None, torch.empty(3, 20, dtype=torch.float64))
    with pytest.raises(RuntimeError, match="bias: a contiguous CPU float32"):
        ops.packed_linear(x, packed, torch.randn(19), out)
    with pytest.raises(RuntimeError, match="bias: a contiguous CPU float32"):
        ops.packed_linear(x, packed, torch.randn(40)[::2], out)
    with pytest.raises(RuntimeError, match="weight: a CPU float32"):
        ops.pack_linear_weight(w.to(torch.bfloat16))
