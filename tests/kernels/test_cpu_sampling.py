"""The sampler's exponential race on the CPU (kernels/csrc/sampling.cpp) against
kernels.reference.exponential_race, on the build this CPU takes and the portable one, 1 and 2
threads; and the draws it makes follow the distribution. argmax_rows (the greedy rows' token)
against torch.argmax."""
import pytest
import torch

from kernels import cpu_attention, reference


def _keys(n: int, seed: int) -> list[int]:
    gen = torch.Generator().manual_seed(seed)
    high = torch.randint(0, 1 << 32, (n,), generator=gen).tolist()
    low = torch.randint(0, 1 << 32, (n,), generator=gen).tolist()
    return [h << 32 | lo for h, lo in zip(high, low)]  # full 64-bit keys, half past 2^63


@pytest.mark.parametrize("vocab", [1, 15, 1000, 1003, 32000])
def test_equals_reference(ops, threads, vocab):
    """Vocabularies shorter than a vector, not a whole number of vectors or chunks, and a real
    one; unnormalised rows, some with zeros."""
    gen = torch.Generator().manual_seed(vocab)
    rows = 3 if vocab == 32000 else 40
    probs = torch.rand((rows, vocab), generator=gen) ** 4
    probs[::3, ::2] = 0.0
    logits = probs.log()  # zeros to -inf
    keys = _keys(rows, vocab)
    out = cpu_attention.exponential_race(probs, keys, ops=ops)
    assert out.tolist() == reference.exponential_race(probs, keys).tolist()
    # the same weights as logits (shifted: only differences count), exponentiated in the kernel
    out = cpu_attention.exponential_race(logits + 3.0, keys, True, ops=ops)
    assert out.tolist() == reference.exponential_race(logits + 3.0, keys, True).tolist()


@pytest.mark.parametrize("vocab", [15, 1003, 32000])
def test_a_cut_draws_as_logits_masked_below_it(ops, threads, vocab):
    """top_k / top_p / min_p cuts passed to the kernel: the draws of the logits masked to -inf
    below each row's cut, and the reference's; rows cut to their top token, cut nowhere (-inf),
    and cut whole (a cut above the maximum: token 0, as a row all -inf)."""
    gen = torch.Generator().manual_seed(vocab + 1)
    rows = 40
    logits = torch.randn((rows, vocab), generator=gen) * 3
    keys = _keys(rows, vocab + 1)
    kth = logits.sort(dim=-1, descending=True).values
    cut = kth[torch.arange(rows), torch.randint(0, vocab, (rows,), generator=gen)]
    cut[0] = kth[0, 0]  # only the top token survives
    cut[1] = float("-inf")
    cut[2] = kth[2, 0] + 1.0
    out = cpu_attention.exponential_race(logits, keys, True, ops=ops, cut=cut).tolist()
    masked = logits.masked_fill(logits < cut.unsqueeze(1), float("-inf"))
    assert out == cpu_attention.exponential_race(masked, keys, True, ops=ops).tolist()
    assert out == reference.exponential_race(logits, keys, True, cut=cut).tolist()
    assert out[0] == int(logits[0].argmax()) and out[2] == 0
    assert all(logits[i, t] >= cut[i] for i, t in enumerate(out) if i != 2)


def test_a_row_draws_the_same_whatever_shares_its_batch(ops):
    gen = torch.Generator().manual_seed(1)
    probs = torch.rand((16, 500), generator=gen)
    keys = _keys(16, 1)
    together = cpu_attention.exponential_race(probs, keys, ops=ops).tolist()
    alone = [cpu_attention.exponential_race(probs[i:i + 1], keys[i:i + 1], ops=ops)[0]
             for i in range(16)]
    assert together == [int(t) for t in alone]


def test_zero_probabilities_are_never_drawn(ops):
    probs = torch.zeros((500, 64))
    probs[:, 7] = 1e-30  # tiny next to nothing: still the only token with mass
    probs[:, 40] = 2e-30
    out = cpu_attention.exponential_race(probs, _keys(500, 2), ops=ops)
    assert set(out.tolist()) == {7, 40}


@pytest.mark.parametrize("logits", [False, True])
def test_draws_follow_the_distribution(ops, logits):
    p = torch.tensor([0.05, 0.3, 0.0, 0.15, 0.4, 0.1])
    n = 20000
    rows = (p.log() if logits else p).expand(n, -1).contiguous()
    out = cpu_attention.exponential_race(rows, _keys(n, 3), logits, ops=ops)
    counts = torch.bincount(out, minlength=6).double()
    assert counts[2] == 0
    keep = p > 0
    expected = p[keep].double() * n
    chi2 = (((counts[keep] - expected) ** 2) / expected).sum().item()
    assert chi2 < 18.5  # chi-square, 4 degrees of freedom: p ~ 0.001


def test_bad_input_is_refused(ops):
    probs = torch.rand((2, 10))
    out = torch.empty(2, dtype=torch.long)
    with pytest.raises(RuntimeError, match="keys"):
        ops.exponential_race(probs, torch.zeros(3, dtype=torch.long), False, None, out)
    with pytest.raises(RuntimeError, match="float32"):
        ops.exponential_race(probs.double(), torch.zeros(2, dtype=torch.long), False, None,
                             out)
    with pytest.raises(RuntimeError, match="cut"):
        ops.exponential_race(probs, torch.zeros(2, dtype=torch.long), False, torch.zeros(2),
                             out)


@pytest.mark.parametrize("fill", [float("-inf"), float("inf")])
def test_rows_without_finite_logits(ops, fill):
    """A +inf logit is certain (the first of them); a row masked whole draws token 0."""
    logits = torch.full((2, 40), float("-inf"))
    logits[1, 9] = logits[1, 30] = fill
    out = cpu_attention.exponential_race(logits, [5, 6], True, ops=ops).tolist()
    assert out == [0, 9 if fill > 0 else 0]


@pytest.mark.parametrize("n", [1, 7, 8, 15, 16, 17, 1003, 32000])
def test_argmax_rows_equals_torch(ops, threads, n):
    """Random rows, rows of ties (the first maximum wins, in the vector part and the tail), rows
    masked whole (-inf: token 0), an +inf among finite values, and NaNs (torch counts a NaN as
    the largest: its first one wins, wherever it lies)."""
    gen = torch.Generator().manual_seed(n)
    x = torch.randn((24, n), generator=gen)
    x[1] = 0.0  # every token ties
    x[2] = torch.randint(0, 3, (n,), generator=gen).float()  # ties among the largest
    x[3] = float("-inf")
    x[4, n // 2] = float("inf")
    x[5, n - 1] = float("nan")  # in the tail where there is one
    x[6, n // 3] = float("nan")
    x[6, n - 1] = float("nan")
    x[7, :] = float("nan")
    x[8, n // 2] = x[8].max() + 1.0
    x[8, n - 1] = x[8, n // 2]  # the maximum twice: the first
    x[9, 0] = x[9].max() + 1.0
    x[10, n - 1] = x[10].max() + 1.0
    out = cpu_attention.argmax_rows(x, ops=ops)
    assert out.tolist() == x.argmax(dim=-1).tolist()


def test_argmax_rows_refuses_bad_input(ops):
    out = torch.empty(2, dtype=torch.long)
    with pytest.raises(RuntimeError, match="float32"):
        ops.argmax_rows(torch.rand((2, 10)).double(), out)
    with pytest.raises(RuntimeError, match="n > 0"):
        ops.argmax_rows(torch.rand((2, 0)), out)
    with pytest.raises(RuntimeError, match="out"):
        ops.argmax_rows(torch.rand((3, 10)), out)


@pytest.mark.parametrize("n", [1, 7, 8, 17, 1003, 32000])
def test_divide_rows_equals_torch(ops, threads, n):
    """The sampler's temperatures: each quotient the bits of torch's `x / d[:, None]`, in the
    vector part and the tail, for rows that are slices of wider ones too; infinities and NaNs
    as torch has them."""
    gen = torch.Generator().manual_seed(n)
    wide = torch.randn((9, n + 5), generator=gen) * 30
    x = wide[:, :n]
    x[1, n - 1] = float("inf")
    x[2, 0] = float("-inf")
    x[3, n // 2] = float("nan")
    d = torch.tensor([0.7, 1.3, 0.05, 2.0, 1e-3, 0.99, 1.0, 1.7, 3.3])
    out = cpu_attention.divide_rows(x, d, ops=ops)
    assert out.is_contiguous()
    torch.testing.assert_close(out, x / d.unsqueeze(1), rtol=0, atol=0, equal_nan=True)


def test_divide_rows_refuses_bad_input(ops):
    with pytest.raises(RuntimeError, match="float32"):
        ops.divide_rows(torch.rand((2, 10)).double(), torch.ones(2), torch.empty(2, 10))
    with pytest.raises(RuntimeError, match="d: float32"):
        ops.divide_rows(torch.rand((2, 10)), torch.ones(3), torch.empty(2, 10))
    with pytest.raises(RuntimeError, match="out"):
        ops.divide_rows(torch.rand((2, 10)), torch.ones(2), torch.empty(2, 9))
