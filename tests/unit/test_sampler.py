import math

import pytest
import torch

from common.worker.sampler import (SamplingRequest, Sampler, apply_logit_bias, apply_min_tokens,
                                   apply_penalties, row_seed)
from common.sampling_params import SamplingParams

VOCAB = 16


def make_row(prompt=(1, 2, 3), output=(), eos=(0,), position=None, **params) -> SamplingRequest:
    params.setdefault("logprobs", -1)
    params.setdefault("max_tokens", 16)  # the sampler never reads it
    prompt, output = list(prompt), list(output)
    return SamplingRequest(
        params=SamplingParams(**params),
        prompt_token_ids=prompt,
        output_token_ids=output,
        eos_token_ids=list(eos),
        position=len(prompt) + len(output) if position is None else position,
    )


@pytest.fixture(params=["torch", "cpu-kernel"])
def new_sampler(request):
    """Sampler(vocab, seed) drawing its noise with torch's generators, or in the CPU kernel."""
    if request.param == "torch":
        return Sampler
    from kernels import cpu_attention
    library = cpu_attention.load()
    return lambda vocab, seed=0: Sampler(vocab, seed, cpu_kernels=library)


def random_logits(num_rows: int, vocab: int = VOCAB, seed: int = 0) -> torch.Tensor:
    return torch.randn(num_rows, vocab, generator=torch.Generator().manual_seed(seed)) * 3


def test_min_tokens_alone_leaves_the_input_as_it_was(new_sampler):
    """Without penalties or a bias nothing else copies the logits before min_tokens masks them."""
    logits = random_logits(3)
    before = logits.clone()
    rows = [make_row(min_tokens=4, temperature=t, stop_token_ids=[5]) for t in (0.0, 1.0, 1.0)]
    new_sampler(VOCAB)(logits, rows)
    torch.testing.assert_close(logits, before)


def test_a_coupled_draw_is_the_samplers_own(new_sampler):
    """draw() at salt 0 (a coupled draft's) takes the token __call__ takes: the same noise and
    the same weights, greedy rows included; another salt draws on its own."""
    logits = random_logits(200, vocab=1000, seed=3) / 3
    rows = [make_row(temperature=0.0 if p % 7 == 0 else 1.0, top_p=0.9, seed=p % 3 or None,
                     position=p) for p in range(200)]
    sampler = new_sampler(1000, seed=4)
    drawn = sampler.draw(logits, rows).tolist()
    sampled = new_sampler(1000, seed=4)(logits, rows).token_ids
    assert drawn == sampled
    other = sampler.draw(logits, rows, salt=12345).tolist()
    assert sum(a != b for a, b in zip(other, sampled)) > 100


def test_greedy_is_argmax():
    logits = random_logits(5)
    out = Sampler(VOCAB)(logits, [make_row() for _ in range(5)])
    assert out.token_ids == logits.argmax(dim=-1).tolist()
    assert out.logprobs == [None] * 5


def test_input_logits_not_modified():
    logits = random_logits(4)
    before = logits.clone()
    rows = [make_row(temperature=0.7, top_k=3, repetition_penalty=1.5, frequency_penalty=0.5,
                     min_tokens=4, output=[1, 1], seed=1),
            make_row(), make_row(temperature=1.0, top_p=0.5, min_p=0.1),
            make_row(logit_bias=((3, 2.0),))]
    Sampler(VOCAB)(logits, rows)
    assert torch.equal(logits, before)


@pytest.mark.parametrize("temperature", [0.5, 1.0, 5.0])
def test_top_k_1_is_greedy(temperature):
    logits = random_logits(8)
    rows = [make_row(temperature=temperature, top_k=1) for _ in range(8)]
    assert Sampler(VOCAB)(logits, rows).token_ids == logits.argmax(dim=-1).tolist()


def test_tiny_top_p_is_greedy():
    logits = random_logits(8)
    rows = [make_row(temperature=1.0, top_p=1e-6) for _ in range(8)]
    assert Sampler(VOCAB)(logits, rows).token_ids == logits.argmax(dim=-1).tolist()


def test_mixed_greedy_and_random_rows(new_sampler):
    logits = random_logits(4)
    rows = [make_row(), make_row(temperature=1.0), make_row(), make_row(temperature=1.0, top_k=1)]
    out = new_sampler(VOCAB)(logits, rows).token_ids
    argmax = logits.argmax(dim=-1).tolist()
    assert [out[0], out[2], out[3]] == [argmax[0], argmax[2], argmax[3]]


def test_min_p_support():
    logits = torch.tensor([[2.0, 1.9, 1.0, 0.5, 0.0, -1.0, -3.0, 1.5]])
    min_p = 0.3
    probs = logits.softmax(dim=-1)[0]
    allowed = set(torch.nonzero(probs >= min_p * probs.max()).flatten().tolist())
    assert 1 < len(allowed) < logits.shape[1]
    sampler = Sampler(8, seed=123)
    rows = [make_row(temperature=1.0, min_p=min_p)] * 500
    seen = set(sampler(logits.expand(500, -1), rows).token_ids)
    assert seen == allowed


def test_top_k_support():
    logits = random_logits(1, seed=3)
    rows = [make_row(temperature=2.0, top_k=4)] * 500
    seen = set(Sampler(VOCAB, seed=1)(logits.expand(500, -1), rows).token_ids)
    assert seen == set(logits[0].topk(4).indices.tolist())


def test_seeded_row_independent_of_batch(new_sampler):
    target = make_row(temperature=1.0, seed=42, position=17)
    logits = random_logits(6)
    others = [make_row(temperature=1.0), make_row(temperature=0.8, seed=7), make_row(),
              make_row(temperature=1.5, top_k=3)]
    alone = new_sampler(VOCAB, seed=0)(logits[:1], [target]).token_ids[0]
    # the target row in other positions of a different batch, with a differently seeded sampler
    for slot in range(5):
        rows = others[:slot] + [target] + others[slot:]
        batch_logits = torch.cat([logits[1:1 + slot], logits[:1], logits[1 + slot:5]])
        out = new_sampler(VOCAB, seed=slot + 100)(batch_logits, rows).token_ids
        assert out[slot] == alone


def test_seeded_request_resamples_identically(new_sampler):
    logits = random_logits(1, vocab=1000, seed=5) / 10  # flat: many likely tokens
    rows = [make_row(temperature=1.0, seed=2**64 - 1, position=p) for p in range(20)]
    first = [new_sampler(1000)(logits, [r]).token_ids[0] for r in rows]
    again = [new_sampler(1000, seed=9)(logits, [r]).token_ids[0] for r in rows]
    assert first == again


def test_seeded_positions_differ(new_sampler):
    logits = torch.zeros(1, 1000)  # uniform over 1000 tokens
    sampler = new_sampler(1000)
    tokens = [sampler(logits, [make_row(temperature=1.0, seed=3, position=p)]).token_ids[0]
              for p in range(50)]
    assert len(set(tokens)) >= 45  # 50 uniform draws from 1000: expect ~49 distinct
    assert len({row_seed(3, p) for p in range(1000)}) == 1000
    assert row_seed(3, 5) != row_seed(4, 5)


def test_unseeded_sampler_is_reproducible_from_its_seed(new_sampler):
    logits = random_logits(64) / 3
    rows = [make_row(temperature=1.0)] * 64
    assert new_sampler(VOCAB, seed=5)(logits, rows).token_ids == new_sampler(VOCAB, seed=5)(logits, rows).token_ids


def _reference_penalties(logits: torch.Tensor, rows: list[SamplingRequest]) -> torch.Tensor:
    out = logits.clone()
    for i, r in enumerate(rows):
        rep = r.params.repetition_penalty or 1.0
        for t in set(r.prompt_token_ids) | set(r.output_token_ids):
            x = out[i, t].item()
            out[i, t] = x / rep if x > 0 else x * rep
        for t in set(r.output_token_ids):
            out[i, t] -= r.params.frequency_penalty * r.output_token_ids.count(t)
            out[i, t] -= r.params.presence_penalty
    return out


def test_penalties_match_reference():
    logits = random_logits(5)
    rows = [
        make_row(prompt=[1, 2, 2], output=[3, 3, 4], repetition_penalty=1.3),
        make_row(prompt=[5], output=[6, 6, 6, 7], frequency_penalty=0.5),
        make_row(prompt=[5], output=[6, 6, 6, 7], presence_penalty=0.75),
        make_row(prompt=[8, 9], output=[9, 10, 10, 15], repetition_penalty=0.8,
                 frequency_penalty=-0.2, presence_penalty=1.0),
        make_row(prompt=[1, 2, 3], output=[4, 5]),  # no penalties: untouched
    ]
    got = apply_penalties(logits, rows)
    torch.testing.assert_close(got, _reference_penalties(logits, rows), rtol=0, atol=1e-6)
    assert torch.equal(got[4], logits[4])
    # spot-check the rules by hand
    r = 1.3
    for t in (1, 2, 3, 4):
        x = logits[0, t].item()
        assert got[0, t].item() == pytest.approx(x / r if x > 0 else x * r)
    assert got[1, 6].item() == pytest.approx(logits[1, 6].item() - 1.5)
    assert got[2, 6].item() == pytest.approx(logits[2, 6].item() - 0.75)
    assert got[1, 5].item() == logits[1, 5].item()  # frequency: output only, not prompt


def test_penalties_change_greedy_choice():
    logits = torch.zeros(1, VOCAB)
    logits[0, 3] = 1.0
    logits[0, 4] = 0.9
    row = make_row(output=[3], presence_penalty=0.5)
    assert Sampler(VOCAB)(logits, [row]).token_ids == [4]


def test_min_tokens_masks_eos_and_stop_ids():
    logits = torch.zeros(2, VOCAB)
    logits[:, 0] = 10.0  # eos
    logits[:, 5] = 9.0  # stop id
    logits[:, 6] = 8.0
    rows = [make_row(output=[1], eos=[0], min_tokens=3, stop_token_ids=[5], ignore_eos=True),
            make_row(output=[1, 2, 3], eos=[0], min_tokens=3, stop_token_ids=[5])]
    masked = apply_min_tokens(logits.clone(), rows)
    assert masked[0, 0] == float("-inf") and masked[0, 5] == float("-inf")
    assert torch.equal(masked[1], logits[1])
    assert Sampler(VOCAB)(logits, rows).token_ids == [6, 0]


def test_logprobs_from_raw_logits():
    logits = random_logits(4)
    rows = [make_row(logprobs=0), make_row(logprobs=3, temperature=0.7, repetition_penalty=2.0,
                                           output=[1, 2]),
            make_row(logprobs=-1), make_row(logprobs=VOCAB + 5, temperature=1.0, seed=1)]
    out = Sampler(VOCAB)(logits, rows)
    ref = torch.log_softmax(logits, dim=-1)
    assert out.logprobs[2] is None
    for i in (0, 1, 3):
        lp = out.logprobs[i]
        assert lp.logprob == pytest.approx(ref[i, out.token_ids[i]].item(), abs=1e-5)
    assert len(out.logprobs[0].top) == 0
    assert len(out.logprobs[3].top) == VOCAB
    top = out.logprobs[1].top
    assert [t.token_id for t in top] == ref[1].topk(3).indices.tolist()
    values = [t.logprob for t in top]
    assert values == sorted(values, reverse=True)
    torch.testing.assert_close(torch.tensor(values), ref[1].topk(3).values)


def test_padded_vocab_never_sampled():
    logits = torch.zeros(3, VOCAB + 4)
    logits[:, VOCAB:] = 100.0
    rows = [make_row(), make_row(temperature=1.0), make_row(temperature=1.0, seed=3)]
    assert all(t < VOCAB for t in Sampler(VOCAB)(logits, rows).token_ids)


@pytest.mark.parametrize("seeded", ["no", "yes", "half"])
def test_distribution_matches_softmax(seeded, new_sampler):
    logits = torch.tensor([1.0, 0.5, 0.0, -0.5, -1.0, 2.0])
    probs = logits.softmax(dim=-1)
    n = 4000
    if seeded == "yes":  # a per-row generator per position: samples should still follow softmax
        rows = [make_row(temperature=1.0, seed=11, position=p) for p in range(n)]
    elif seeded == "half":  # the unseeded rows' noise drawn apart from the seeded rows'
        rows = [make_row(temperature=1.0, seed=11, position=p) if p % 2 else
                make_row(temperature=1.0) for p in range(n)]
    else:
        rows = [make_row(temperature=1.0)] * n
    tokens = new_sampler(6, seed=7)(logits.expand(n, -1), rows).token_ids
    counts = torch.bincount(torch.tensor(tokens), minlength=6).double()
    expected = probs.double() * n
    chi2 = ((counts - expected) ** 2 / expected).sum().item()
    assert chi2 < 20.5  # chi-square, 5 degrees of freedom: p ~ 0.001


def test_temperature_sharpens(new_sampler):
    logits = torch.tensor([1.0, 0.0, -1.0, 0.5])
    n = 2000
    rows = [make_row(temperature=0.25)] * n
    tokens = torch.tensor(new_sampler(4, seed=1)(logits.expand(n, -1), rows).token_ids)
    expected = (logits / 0.25).softmax(dim=-1)[0].item()
    assert math.isclose((tokens == 0).double().mean().item(), expected, abs_tol=0.04)


def test_logit_bias_adds_to_its_rows_logits_only():
    logits = random_logits(3)
    rows = [make_row(logit_bias=((0, -1.5), (7, 3.0), (VOCAB + 2, 9.0))), make_row(),
            make_row(logit_bias=((7, 0.25),))]
    biased = apply_logit_bias(logits.clone(), rows)
    want = logits.clone()
    want[0, 0] -= 1.5
    want[0, 7] += 3.0
    want[2, 7] += 0.25
    assert torch.equal(biased, want)  # the id past the vocabulary is ignored


@pytest.mark.parametrize("params", [{}, {"temperature": 1.0}, {"temperature": 0.8, "seed": 3},
                                    {"temperature": 1.0, "top_k": 2}])
def test_bias_100_forces_a_token_and_minus_100_bans_the_likeliest(params):
    logits = random_logits(8, seed=11)
    least = logits.argmin(dim=-1).tolist()
    greedy = logits.argmax(dim=-1).tolist()
    forced = [make_row(logit_bias=((t, 100.0),), **params) for t in least]
    assert Sampler(VOCAB)(logits, forced).token_ids == least
    banned = [make_row(logit_bias=((t, -100.0),), **params) for t in greedy]
    out = Sampler(VOCAB)(logits, banned)
    assert all(t != g for t, g in zip(out.token_ids, greedy))
    if not params:  # greedy: the runner-up
        assert out.token_ids == logits.topk(2).indices[:, 1].tolist()


def test_logit_bias_leaves_logprobs_raw_and_comes_before_penalties():
    logits = torch.tensor([[1.0, 2.0, 0.5, -1.0]])
    row = make_row(prompt=(0,), logit_bias=((0, 1.5),), repetition_penalty=2.0, logprobs=2)
    out = Sampler(4)(logits, [row])
    # vLLM v1's order: bias (1.0 + 1.5 = 2.5), then the penalty on a positive logit (/ 2)
    assert out.token_ids == [1]
    row = make_row(prompt=(3,), logit_bias=((0, 1.5),), repetition_penalty=2.0, logprobs=2)
    out = Sampler(4)(logits, [row])
    assert out.token_ids == [0]
    assert out.logprobs[0].logprob == pytest.approx(torch.log_softmax(logits, -1)[0, 0].item())
    assert [t.token_id for t in out.logprobs[0].top] == [1, 0]


def _sorted_top_k_top_p_min_p(logits, top_k, top_p, min_p):
    """The plain reference: one ascending sort, cut from the least likely end."""
    vocab = logits.shape[1]
    logits_sort, order = logits.sort(dim=-1, descending=False)  # most likely last
    kth = logits_sort.gather(1, (vocab - top_k).unsqueeze(1))
    logits_sort.masked_fill_(logits_sort < kth, float("-inf"))
    cum = logits_sort.softmax(dim=-1).cumsum(dim=-1)
    drop = cum <= 1 - top_p.unsqueeze(1)
    drop[:, -1] = False
    logits_sort.masked_fill_(drop, float("-inf"))
    probs_sort = logits_sort.softmax(dim=-1)
    logits_sort.masked_fill_(probs_sort < min_p.unsqueeze(1) * probs_sort[:, -1:], float("-inf"))
    return torch.empty_like(logits).scatter_(1, order, logits_sort)


@pytest.mark.parametrize("scale", [0.05, 1.0, 6.0])  # flat (nuclei past the candidates), peaked
def test_top_k_top_p_min_p_keep_what_a_full_sort_keeps(scale):
    from common.worker.sampler import TOP_P_CANDIDATES, apply_top_k_top_p_min_p
    gen = torch.Generator().manual_seed(int(scale * 100))
    rows, vocab = 48, 3000
    logits = torch.randn((rows, vocab), generator=gen) * scale
    top_k = torch.randint(1, vocab + 1, (rows,), generator=gen)
    top_k[::3] = vocab  # no top_k on a third of the rows
    top_k[1::6] = torch.randint(1, TOP_P_CANDIDATES // 2, (len(top_k[1::6]),), generator=gen)
    top_p = torch.rand((rows,), generator=gen) * 0.98 + 0.01
    top_p[2::4] = 1.0
    min_p = torch.rand((rows,), generator=gen) * 0.3
    min_p[::2] = 0.0
    got = apply_top_k_top_p_min_p(logits, top_k, top_p, min_p)
    want = _sorted_top_k_top_p_min_p(logits, top_k, top_p, min_p)
    assert torch.equal(got.isinf(), want.isinf())
    assert torch.equal(got[~got.isinf()], logits[~got.isinf()])
    for k_, p_, m_ in [(top_k, None, None), (None, top_p, None), (None, None, min_p)]:
        full = [torch.full((rows,), vocab), torch.ones(rows), torch.zeros(rows)]
        args = [a if a is not None else f for a, f in zip((k_, p_, m_), full)]
        assert torch.equal(apply_top_k_top_p_min_p(logits, k_, p_, m_).isinf(),
                           _sorted_top_k_top_p_min_p(logits, *args).isinf())
