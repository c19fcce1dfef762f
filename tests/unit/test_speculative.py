"""Speculative decoding (n-gram): the config and the proposer alone; the verification's
sampling against the target distribution (chi-square); and the scheduler driving real workers
that speculate, whose greedy tokens must equal HuggingFace's and plain decoding's, seeded ones
plain decoding's, with every block back at the end."""
import collections
import json

import pytest
import torch
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from common.sampling_params import SamplingParams
from common.worker.model_runner import ModelRunner, RequestState, StepStats
from common.worker.sampler import Sampler, SamplingRequest
from common.worker.draft import DRAFT_SALT, rejection_sample
from common.worker.speculative import DraftLength, NgramProposer, SpeculativeConfig
from common.worker.telemetry import _CountersCollector
from tests.unit.test_scheduler_inprocess import _greedy, _prompt, cluster, hf  # noqa: F401

NGRAM = json.dumps({"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1,
                    "prompt_lookup_max": 3})


# ---- config and proposer ---------------------------------------------------------------------

def test_config_takes_vllms_keys_and_defaults():
    cfg = SpeculativeConfig.parse('{"method": "[ngram]", "num_speculative_tokens": 3}')
    assert (cfg.method, cfg.num_speculative_tokens) == ("ngram", 3)
    assert (cfg.prompt_lookup_min, cfg.prompt_lookup_max) == (5, 5)  # vLLM's defaults
    cfg = SpeculativeConfig.parse('{"num_speculative_tokens": 2, "prompt_lookup_max": 4}')
    assert (cfg.prompt_lookup_min, cfg.prompt_lookup_max) == (4, 4)
    cfg = SpeculativeConfig.parse('{"model": "/d", "num_speculative_tokens": 2}')
    assert (cfg.method, cfg.model) == ("draft_model", "/d")
    assert SpeculativeConfig.parse("") is None
    assert SpeculativeConfig.parse("{}") is None


@pytest.mark.parametrize("text, message", [
    ("[1]", "must be a JSON object"),
    ("{", "is not JSON"),
    ('{"num_speculative_tokens": 0}', "num_speculative_tokens must be >= 1"),
    ('{"num_speculative_tokens": 2, "prompt_lookup_min": 4, "prompt_lookup_max": 2}',
     "prompt_lookup_min <= prompt_lookup_max"),
    ('{"num_speculative_tokens": "2"}', "num_speculative_tokens must be an integer"),
    ('{"method": "eagle", "num_speculative_tokens": 2}', "unknown method 'eagle'"),
    ('{"num_speculative_tokens": 2, "foo": 1}', "unknown keys ['foo']"),
    ('{"method": "draft_model", "num_speculative_tokens": 2}', 'a draft model needs "model"'),
    ('{"model": 3, "num_speculative_tokens": 2}', "model must be a string"),
    ('{"model": "/d", "num_speculative_tokens": 2, "acceptance_method": "typical"}',
     "unknown acceptance_method 'typical'"),
])
def test_config_refuses_what_it_cannot_honour(text, message):
    with pytest.raises(ValueError, match=message.replace("[", r"\[").replace("(", r"\(")):
        SpeculativeConfig.parse(text)


def _proposer(lo, hi):
    return NgramProposer(SpeculativeConfig(num_speculative_tokens=8, prompt_lookup_min=lo,
                                           prompt_lookup_max=hi))


def test_proposer_continues_the_longest_suffix_seen_before():
    # suffix [2, 3] occurred at 1..2 (followed by 9, 9) and [7, 2, 3] at 5..7 (followed by 4)
    tokens = [1, 2, 3, 9, 9, 7, 2, 3, 4, 5, 6, 7, 2, 3]
    assert _proposer(1, 3).propose(tokens, 3) == [4, 5, 6]
    assert _proposer(1, 2).propose(tokens, 3) == [4, 5, 6]   # [2, 3]: its latest occurrence
    assert _proposer(1, 3).propose(tokens, 1) == [4]
    assert _proposer(4, 4).propose(tokens, 3) == []          # no 4-token suffix repeats
    assert _proposer(1, 3).propose(tokens[:4], 3) == []      # [9] never came before


def test_proposer_stops_at_the_end_of_the_sequence():
    assert _proposer(1, 1).propose([5, 6, 5], 4) == [6, 5]
    assert _proposer(2, 2).propose([1, 1, 1], 4) == [1]  # [1, 1] at 0..1, then one token
    assert _proposer(1, 2).propose([3], 4) == []
    assert _proposer(1, 2).propose([1, 2, 1], 0) == []


# ---- verification ----------------------------------------------------------------------------

def _verify(sampler, logits, drafts, params, output=(7,)):
    """One request verifying `drafts` from these logits (one row per position): the tokens the
    step keeps, as ModelRunner.execute keeps them."""
    r = RequestState("r", [1, 2, *output], 2, 2 + len(output) - 1, [0], params, eos_token_ids=[])
    rows = [ModelRunner._sampling_row(r, params, drafts[:j]) for j in range(len(drafts) + 1)]
    tokens = sampler(logits, rows).token_ids
    return tuple(tokens[:ModelRunner._accept(r, drafts, tokens, StepStats())])


def test_accepted_then_resampled_tokens_follow_the_target_distribution():
    """Draft [d0, d1] for two positions of a 6-token vocabulary: the outcomes of a step are
    (t) for t != d0, (d0, t) for t != d1 and (d0, d1, t); their probabilities under the target
    are p0(t), p0(d0) p1(t) and p0(d0) p1(d1) p2(t)."""
    gen = torch.Generator().manual_seed(3)
    logits = torch.randn(3, 6, generator=gen) * 1.5
    p = logits.softmax(-1)
    drafts = [int(p[0].argsort()[-2]), int(p[1].argmax())]  # likely, but not certain
    sampler = Sampler(6, seed=11)
    params = SamplingParams(temperature=1.0, max_tokens=100)
    draws = 6000
    seen = collections.Counter(_verify(sampler, logits, drafts, params) for _ in range(draws))
    expected = {}
    for t in range(6):
        if t != drafts[0]:
            expected[(t,)] = p[0, t].item()
        if t != drafts[1]:
            expected[(drafts[0], t)] = (p[0, drafts[0]] * p[1, t]).item()
        expected[(drafts[0], drafts[1], t)] = (p[0, drafts[0]] * p[1, drafts[1]] * p[2, t]).item()
    assert set(seen) <= set(expected)
    outcomes = sorted(expected)
    observed = [seen[o] for o in outcomes]
    pvalue = _chisquare_pvalue(observed, [expected[o] * draws for o in outcomes])
    assert pvalue > 1e-3, (observed, pvalue)
    accepted_first = sum(n for o, n in seen.items() if len(o) > 1) / draws
    assert abs(accepted_first - p[0, drafts[0]].item()) < 0.03


def _chisquare_pvalue(observed, expected):
    """Pearson's test: P(chi2 with len - 1 degrees of freedom >= the statistic)."""
    o, e = torch.tensor(observed, dtype=torch.float64), torch.tensor(expected, dtype=torch.float64)
    statistic = ((o - e) ** 2 / e).sum()
    dof = torch.tensor((len(observed) - 1) / 2, dtype=torch.float64)
    return torch.special.gammaincc(dof, statistic / 2).item()


def test_greedy_verification_keeps_drafts_up_to_the_first_miss_and_the_target_token_there():
    logits = torch.full((4, 8), -5.0)
    for row, best in enumerate([3, 4, 6, 2]):
        logits[row, best] = 5.0
    sampler = Sampler(8)
    greedy = SamplingParams(temperature=0.0, max_tokens=100)
    assert _verify(sampler, logits, [3, 4, 5], greedy) == (3, 4, 6)
    assert _verify(sampler, logits, [3, 4, 6], greedy) == (3, 4, 6, 2)  # all, and the bonus
    assert _verify(sampler, logits, [1, 4, 6], greedy) == (3,)
    # a stop token inside the accepted run ends the step there
    stop = SamplingParams(temperature=0.0, max_tokens=100, stop_token_ids=(4,))
    assert _verify(sampler, logits, [3, 4, 6], stop) == (3, 4)
    # ... unless min_tokens holds it back (then it is masked: the target samples another)
    held = SamplingParams(temperature=0.0, max_tokens=100, stop_token_ids=(4,), min_tokens=5)
    assert _verify(sampler, logits, [3, 4, 6], held)[:2] == (3, logits[1, :4].argmax().item())


def test_seeded_verification_samples_what_plain_decoding_samples_at_each_position():
    gen = torch.Generator().manual_seed(5)
    logits = torch.randn(4, 50, generator=gen)
    sampler = Sampler(50)
    params = SamplingParams(temperature=1.0, seed=42, max_tokens=100)
    plain = []
    for j in range(4):  # one position at a time, each after the tokens sampled before it
        row = SamplingRequest(params, [1, 2], [7, *plain], [], position=3 + j)
        plain.append(sampler(logits[j:j + 1], [row]).token_ids[0])
    # drafts that are right up to some position keep exactly plain decoding's tokens
    for right in range(4):
        drafts = plain[:right] + [(plain[right] + 1) % 50] * (3 - right) if right < 3 \
            else plain[:3]
        kept = _verify(sampler, logits, drafts, params)
        assert list(kept) == plain[:len(kept)] and len(kept) == min(right + 1, 4)


# ---- the scheduler driving real workers that speculate ----------------------------------------

def _repetitive(n, seed):
    """A prompt repeating a short random phrase: prompt lookup finds its continuations."""
    phrase = _prompt(5, seed)
    return (phrase * (n // 5 + 1))[:n]


def _spec_counters(c):
    return [w.counters for w in c.sched.workers.values() if w.role == "decode"]


@pytest.mark.parametrize("roles", [[("prefill", 64), ("decode", 64)], [("decode", 64)]])
def test_greedy_speculation_equals_hf_and_frees_every_block(cluster, hf, roles):
    c = cluster(roles, worker_kw={"speculative_config": NGRAM})
    prompts = {"rep": _repetitive(23, 1), "rand": _prompt(9, 2), "rep2": _repetitive(12, 3)}
    for rid, p in prompts.items():
        c.submit(rid, p, max_tokens=20)
    c.run()
    for rid, p in prompts.items():
        assert c.tokens(rid) == _greedy(hf, p, 20), rid
        assert c.finish_reason(rid) == "length"
    c.assert_all_free()
    (d,) = _spec_counters(c)
    assert d.spec_accepted_tokens > 0 and d.spec_drafts > 0
    assert d.spec_draft_tokens >= d.spec_accepted_tokens == sum(d.spec_accepted_per_pos)
    # fewer decode steps than tokens: several tokens came out of one step
    assert sum(len(o.token_ids) > 1 for rid in prompts for o in c.outputs[rid])


BIAS = [(t, 30.0) for t in (5, 17, 300, 1200)]  # outputs of few tokens: lookup finds runs


def _greedy_biased(hf, prompt, n, **kw):
    out = hf.generate(torch.tensor([prompt]), max_new_tokens=n, do_sample=False,
                      sequence_bias={(t,): b for t, b in BIAS}, **kw)
    return out[0, len(prompt):].tolist()


def test_runs_of_accepted_drafts_equal_hf_and_a_stop_token_ends_one(cluster, hf):
    prompt = _prompt(12, 1)
    c = cluster([("decode", 64)], worker_kw={"speculative_config": NGRAM})
    c.submit("free", prompt, max_tokens=40, logit_bias=BIAS)
    # 1200 stops it from its 15th token on (masked before, as min_tokens does in HF)
    c.submit("stops", prompt, max_tokens=40, logit_bias=BIAS, stop_token_ids=[1200],
             min_tokens=15)
    c.run()
    assert c.tokens("free") == _greedy_biased(hf, prompt, 40, min_new_tokens=40)
    assert c.tokens("stops") == _greedy_biased(hf, prompt, 40, min_new_tokens=15,
                                               eos_token_id=1200)
    assert c.finish_reason("stops") == "stop" and c.tokens("stops")[-1] == 1200
    # tokens came in steps of several, the stop token with others before it
    assert sum(len(o.token_ids) > 1 for o in c.outputs["free"]) >= 5
    assert len(c.outputs["stops"][-1].token_ids) > 1
    (d,) = _spec_counters(c)
    assert d.spec_accepted_tokens > 10
    c.assert_all_free()
    # the worker's /metrics, under vLLM's names
    (worker,) = c.workers.values()
    registry = CollectorRegistry()
    registry.register(_CountersCollector(worker, "w", "decode"))
    samples = {(s.name, s.labels.get("position")): s.value
               for family in text_string_to_metric_families(generate_latest(registry).decode())
               for s in family.samples}
    assert samples[("pdserve:spec_decode_num_accepted_tokens_total", None)] == \
        d.spec_accepted_tokens
    assert samples[("pdserve:spec_decode_num_draft_tokens_total", None)] == d.spec_draft_tokens
    assert samples[("pdserve:spec_decode_num_drafts_total", None)] == d.spec_drafts
    assert [samples[("pdserve:spec_decode_num_accepted_tokens_per_pos_total", str(j))]
            for j in range(4)] == list(d.spec_accepted_per_pos) + [0] * (
                4 - len(d.spec_accepted_per_pos))


def test_preemption_mid_request_keeps_greedy_tokens(cluster, hf):
    # 8 decode blocks of 4 tokens: three 12-token prompts growing to 24 cannot all fit
    c = cluster([("prefill", 64), ("decode", 8)], worker_kw={"speculative_config": NGRAM})
    prompts = {f"p{i}": _prompt(12, 20 + i) for i in range(3)}
    for rid, p in prompts.items():
        c.submit(rid, p, max_tokens=12, logit_bias=BIAS)
    c.run()
    assert c.sched.num_preemptions > 0
    for rid, p in prompts.items():
        assert c.tokens(rid) == _greedy_biased(hf, p, 12, min_new_tokens=12), rid
    c.assert_all_free()
    assert _spec_counters(c)[0].spec_accepted_tokens > 0


def _run(cluster, roles, spec, prompts, lose_decode_after=0, **kw):
    c = cluster(roles, worker_kw={"speculative_config": NGRAM} if spec else None)
    for rid, p in prompts.items():
        c.submit(rid, p, **kw)
    for _ in range(lose_decode_after):
        c.step()
    if lose_decode_after:
        victim = next(w for w in c.sched.workers.values() if w.role == "decode" and w.decoding)
        c.sched.remove_worker(victim.worker_id)
        c.lose(victim.worker_id)
    c.run()
    c.assert_all_free()
    return c


def _outputs(c, rids):
    return {rid: (c.tokens(rid), [lp for o in c.outputs[rid] for lp in o.logprobs])
            for rid in rids}


def _assert_same(spec, plain):
    for rid, (tokens, logprobs) in plain.items():
        assert spec[rid][0] == tokens, rid
        for a, b in zip(spec[rid][1], logprobs, strict=True):
            assert a.logprob == pytest.approx(b.logprob, rel=1e-4, abs=1e-4)
            assert [t.token_id for t in a.top] == [t.token_id for t in b.top]


@pytest.mark.parametrize("roles", [[("prefill", 64), ("decode", 64)], [("decode", 64)]])
def test_seeded_samples_with_logprobs_equal_plain_decodings(cluster, roles):
    prompts = {"rep": _repetitive(17, 4), "rand": _prompt(8, 5)}
    kw = dict(max_tokens=16, n=3, temperature=0.7, seed=9, logprobs=2, logit_bias=BIAS)
    rids = [f"{rid}{s}" for rid in prompts for s in ("", "/1", "/2")]
    plain = _outputs(_run(cluster, roles, False, prompts, **kw), rids)
    c = _run(cluster, roles, True, prompts, **kw)
    _assert_same(_outputs(c, rids), plain)
    assert _spec_counters(c)[0].spec_accepted_tokens > 0


def test_a_lost_decode_worker_resumes_with_the_same_tokens(cluster, hf):
    roles = [("prefill", 64), ("decode", 64), ("decode", 64)]
    prompts = {f"r{i}": _repetitive(14, 30 + i) for i in range(3)}
    kw = dict(max_tokens=18, temperature=0.9, seed=4, logprobs=0, logit_bias=BIAS)
    plain = _outputs(_run(cluster, roles, False, prompts, **kw), prompts)
    c = _run(cluster, roles, True, prompts, lose_decode_after=6, **kw)
    _assert_same(_outputs(c, prompts), plain)
    greedy = _run(cluster, roles, True, prompts, lose_decode_after=6, max_tokens=18,
                  logit_bias=BIAS)
    for rid, p in prompts.items():
        assert greedy.tokens(rid) == _greedy_biased(hf, p, 18, min_new_tokens=18), rid
    assert sum(d.spec_accepted_tokens for d in _spec_counters(greedy)) > 0


def test_guided_requests_verify_only_drafts_their_grammar_allows(cluster):
    """Under a grammar each position's mask is the grammar's state after the drafts before it;
    output equals plain decoding's, and drafts the grammar refuses are never verified."""
    import xgrammar as xgr
    grammar = str(xgr.Grammar.from_regex(r"([12][ab])+"))  # what follows depends on state
    prompts = {"g": _repetitive(15, 7)}
    kw = dict(max_tokens=24, grammar=grammar, temperature=0.8, seed=3, logprobs=0)
    roles = [("decode", 64)]
    plain = _outputs(_run(cluster, roles, False, prompts, **kw), prompts)
    c = _run(cluster, roles, True, prompts, **kw)
    _assert_same(_outputs(c, prompts), plain)
    (d,) = _spec_counters(c)
    assert d.spec_accepted_tokens > 0


def test_aborts_and_finishes_mid_run_leave_every_block_free(cluster):
    c = cluster([("prefill", 64), ("decode", 24)], worker_kw={"speculative_config": NGRAM})
    for i in range(4):
        c.submit(f"r{i}", _prompt(10 + i, 40 + i), max_tokens=30, logit_bias=BIAS)
    for _ in range(8):
        c.step()
    assert c.sched.abort("r1").finish_reason == "abort"
    for _ in range(3):
        c.step()
    assert c.sched.abort("r2").finish_reason == "abort"
    c.run()
    assert [c.finish_reason(r) for r in ("r0", "r3")] == ["length", "length"]
    assert len(c.tokens("r0")) == 30 and len(c.tokens("r1")) < 30
    c.assert_all_free()
    assert _spec_counters(c)[0].spec_accepted_tokens > 0


def test_draft_length_follows_each_requests_acceptance():
    d = DraftLength()
    assert d.drafts(4) == 4  # every request is tried
    d.observe(4, 4)
    assert d.acceptance == 1.0 and d.drafts(3) == 3
    d.observe(4, 0)  # the first draft rejected: 0.7
    assert d.acceptance == pytest.approx(0.7) and d.drafts(4) == 3  # 0.7 ** 4 < 0.3
    d.observe(4, 1)  # kept one (0.79), then a rejection: 0.553
    assert d.acceptance == pytest.approx(0.553) and d.drafts(4) == 2
    assert d.drafts(4, cost=0.2) == 1  # a draft costing 0.2 of a step must be kept >= 0.4
    d.observe(2, 0)
    d.observe(2, 0)
    assert d.acceptance == pytest.approx(0.553 * 0.7 ** 2)  # 0.271: no draft is worth it
    steps = 0
    while d.drafts(4) == 0:  # each step without drafts: 1% of the way back to 1
        steps += 1
    assert steps == 5 and d.drafts(4) == 1  # 0.271 -> 0.307: one draft, a probe
    d.observe(1, 0)
    steps = 0
    while d.drafts(4, cost=0.2) == 0:  # a dear draft: probes four times rarer
        steps += 1
    assert steps == 108


# ---- draft-model speculation -------------------------------------------------------------------

def test_rejection_sampling_keeps_the_target_distribution_at_each_position():
    """Fixed target p and draft q at two positions (6 tokens): the first kept token follows p_1,
    the second (after an accepted first draft) p_2, and a draft is accepted with probability
    sum_x min(p_1(x), q_1(x)) (chi-square and a tolerance, fixed seeds)."""
    gen = torch.Generator().manual_seed(8)
    sampler = Sampler(6, seed=5)
    rows = [SamplingRequest(SamplingParams(temperature=1.0, max_tokens=100), [1], [], [], 2 + j)
            for j in range(2)]
    p = sampler.distribution(torch.randn(2, 6, generator=gen) * 1.5, rows)
    q = sampler.distribution(torch.randn(2, 6, generator=gen) * 1.5, rows)
    draws = 8000
    first, second = collections.Counter(), collections.Counter()
    for _ in range(draws):
        drafts = [int(sampler.race(q[j:j + 1], rows[j:j + 1], DRAFT_SALT)[0]) for j in range(2)]
        kept = rejection_sample(sampler, p, q, drafts, rows)
        first[kept[0]] += 1
        if len(kept) > 1:
            second[kept[1]] += 1
    for counts, dist in ((first, p[0]), (second, p[1])):
        n = sum(counts.values())
        pvalue = _chisquare_pvalue([counts[t] for t in range(6)], (dist * n).tolist())
        assert pvalue > 1e-3, (counts, dist, pvalue)
    accept = torch.minimum(p[0], q[0]).sum().item()
    assert abs(sum(second.values()) / draws - accept) < 0.03


def _draft_cluster(cluster, roles, draft_dir, k=3, method="coupled"):
    spec = json.dumps({"model": str(draft_dir), "num_speculative_tokens": k,
                       "acceptance_method": method})
    return cluster(roles, worker_kw={"speculative_config": spec})


@pytest.fixture(scope="module")
def other_draft(tmp_path_factory):
    """A random model of the same vocabulary that the tiny llama almost never agrees with."""
    from common.models.tiny import make_tiny_model
    return make_tiny_model(tmp_path_factory.mktemp("draft") / "llama", arch="llama", seed=1)


@pytest.mark.parametrize("method", ["coupled", "rejection_sampler"])
@pytest.mark.parametrize("roles", [[("prefill", 64), ("decode", 64)], [("decode", 64)]])
def test_a_draft_model_keeps_greedy_tokens_equal_to_hf(cluster, hf, tiny_llama, other_draft,
                                                        roles, method):
    prompts = {"a": _prompt(9, 50), "b": _prompt(30, 51)}
    for draft, accepting in ((tiny_llama, True), (other_draft, False)):
        c = _draft_cluster(cluster, roles, draft, method=method)
        for rid, p in prompts.items():
            c.submit(rid, p, max_tokens=16)
        c.run()
        for rid, p in prompts.items():
            assert c.tokens(rid) == _greedy(hf, p, 16), (rid, draft)
        c.assert_all_free()
        (d,) = _spec_counters(c)
        if accepting:  # the target as its own draft: every draft kept
            assert d.spec_accepted_tokens == d.spec_draft_tokens > 0
            # k = 3 drafts and the target's next token; rejection sampling verifies a 4th draft
            # instead of sampling that token
            assert max(len(o.token_ids) for rid in prompts for o in c.outputs[rid]) == 4
        else:
            assert d.spec_accepted_tokens < d.spec_draft_tokens / 2


@pytest.mark.parametrize("method", ["coupled", "rejection_sampler"])
def test_draft_speculation_after_a_lost_worker_keeps_greedy_and_seeded_tokens(
        cluster, hf, tiny_llama, other_draft, method):
    """A decode worker dies mid-request: greedy tokens still equal HF's. Coupled drafts keep
    seeded output (temperature > 0, logprobs too) equal to plain decoding's, lost worker or
    not; rejection sampling keeps it equal run after run (each draw keyed by seed and position),
    not across the loss, nor whatever a draft costs on this host (it drafts by its acceptance
    alone)."""
    roles = [("prefill", 64), ("decode", 64), ("decode", 64)]
    prompts = {f"r{i}": _prompt(12, 60 + i) for i in range(3)}
    spec = json.dumps({"model": str(other_draft if method == "coupled" else tiny_llama),
                       "num_speculative_tokens": 3, "acceptance_method": method})

    def run(lose, speculate=True, draft_cost=None, **kw):
        c = cluster(roles, worker_kw={"speculative_config": spec} if speculate else None)
        if draft_cost is not None:  # as measured on a host where a draft is dear
            for w in c.workers.values():
                def execute(plan, sub_step=0, w=w, step=w.execute):
                    w.runner.draft_cost = draft_cost
                    return step(plan, sub_step)
                w.execute = execute
        for rid, p in prompts.items():
            c.submit(rid, p, max_tokens=16, **kw)
        if lose:  # once a decode worker has decoded a few tokens of a request
            def decoding(w):
                return w.role == "decode" and any(len(r.output_token_ids) > 2 for r in w.decoding)
            while not any(decoding(w) for w in c.sched.workers.values()):
                c.step()
            victim = next(w for w in c.sched.workers.values() if decoding(w))
            c.sched.remove_worker(victim.worker_id)
            c.lose(victim.worker_id)
        c.run()
        c.assert_all_free()
        if speculate:
            assert sum(d.spec_draft_tokens for d in _spec_counters(c)) > 0
        return c

    greedy = run(True)
    for rid, p in prompts.items():
        assert greedy.tokens(rid) == _greedy(hf, p, 16), rid
    seeded = dict(temperature=0.8, seed=7, logprobs=1)
    once = _outputs(run(False, **seeded), prompts)
    _assert_same(_outputs(run(False, **seeded), prompts), once)
    if method == "coupled":
        _assert_same(_outputs(run(True, **seeded), prompts), once)
        _assert_same(_outputs(run(False, speculate=False, **seeded), prompts), once)
    else:  # a draft dearer than half a step would never pay, yet seeded tokens keep drafting
        _assert_same(_outputs(run(False, draft_cost=0.6, **seeded), prompts), once)


def test_a_draft_model_through_preemption_and_a_stop_token_keeps_greedy_tokens(cluster, hf,
                                                                               tiny_llama):
    """Tight decode blocks preempt requests whose drafts hold lookahead slots; a stop token
    ends one inside a run of kept drafts (the target as its own draft keeps every one)."""
    c = _draft_cluster(cluster, [("prefill", 64), ("decode", 10)], tiny_llama, k=3)
    prompts = {f"p{i}": _prompt(9, 90 + i) for i in range(3)}
    for rid, p in prompts.items():
        c.submit(rid, p, max_tokens=14)
    greedy = _greedy(hf, prompts["p0"], 14)
    c.submit("stops", prompts["p0"], max_tokens=14, stop_token_ids=[greedy[6]])
    c.run()
    assert c.sched.num_preemptions > 0
    for rid, p in prompts.items():
        assert c.tokens(rid) == _greedy(hf, p, 14), rid
    assert c.tokens("stops") == greedy[:greedy.index(greedy[6]) + 1]
    assert c.finish_reason("stops") == "stop"
    c.assert_all_free()


def test_guided_requests_verify_what_their_grammar_allows_of_a_coupled_drafts(cluster,
                                                                             other_draft):
    """A draft that knows nothing of the grammar: its drafts are cut where the grammar refuses
    them; output equals plain decoding's."""
    import xgrammar as xgr
    grammar = str(xgr.Grammar.from_regex(r"([12][ab])+"))
    prompts = {"g": _prompt(10, 95), "h": _prompt(7, 96)}
    kw = dict(max_tokens=20, grammar=grammar, temperature=0.8, seed=3, logprobs=0)
    roles = [("decode", 64)]
    plain = _outputs(_run(cluster, roles, False, prompts, **kw), prompts)
    spec = json.dumps({"model": str(other_draft), "num_speculative_tokens": 3})
    c = cluster(roles, worker_kw={"speculative_config": spec})
    for rid, p in prompts.items():
        c.submit(rid, p, **kw)
    c.run()
    c.assert_all_free()
    _assert_same(_outputs(c, prompts), plain)
