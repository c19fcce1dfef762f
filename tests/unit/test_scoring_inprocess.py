"""Prompt logprobs and logit_bias through the scheduler and real workers in this process: the
prompt is scored by whichever worker prefills it (a prefill worker, or a decode worker that
prefills it itself), chunk by chunk, and comes out whole with the first token, equal to
HuggingFace's log_softmax; a prompt to score is never read from the prefix cache, and one
scored again after its worker is lost is scored from its start. logit_bias steers every
token, the first one sampled on the prefill worker included."""
import pytest
import torch

from tests.unit.test_scheduler_inprocess import (  # noqa: F401 (fixtures)
    _by_role,
    _greedy,
    _prompt,
    cluster,
    hf,
)

ATOL = 1e-3  # as test_model_vs_hf.py: fp32 logits of magnitude ~10-30 differ by ~1e-4


def _reference(hf, prompt):
    with torch.no_grad():
        logits = hf(torch.tensor([prompt])).logits[0]
    return torch.log_softmax(logits, dim=-1)  # [len, vocab]: row i predicts token i + 1


def _assert_scores(outputs, hf, prompt, k):
    """The first output carries one score per prompt token after the first; no other does."""
    first, *rest = outputs
    assert all(not o.prompt_logprobs for o in rest)
    scored = first.prompt_logprobs
    ref = _reference(hf, prompt)[:-1]
    assert len(scored) == len(prompt) - 1
    want = ref[torch.arange(len(prompt) - 1), torch.tensor(prompt[1:], dtype=torch.long)]
    torch.testing.assert_close(torch.tensor([s.logprob for s in scored]), want, rtol=0,
                               atol=ATOL)
    for s, row in zip(scored, ref):
        torch.testing.assert_close(torch.tensor([t.logprob for t in s.top]), row.topk(k).values,
                                   rtol=0, atol=ATOL)
        assert s.rank >= 1


@pytest.mark.parametrize("roles", [("prefill", "decode"), ("decode",)])
def test_chunked_prompts_are_scored_wherever_they_prefill(cluster, hf, roles):
    c = cluster([(r, 64) for r in roles], max_num_batched_tokens=8)
    prompts = {"long": _prompt(30, 1), "short": _prompt(5, 2), "one": _prompt(1, 3)}
    for rid, p in prompts.items():
        c.submit(rid, p, max_tokens=4, prompt_logprobs=2)
    c.submit("plain", _prompt(12, 4), max_tokens=4)
    c.run()
    for rid, p in prompts.items():
        _assert_scores(c.outputs[rid], hf, p, 2)
        assert c.tokens(rid) == _greedy(hf, p, 4)
    assert all(not o.prompt_logprobs for o in c.outputs["plain"])
    computed = [w.counters.prompt_tokens_computed for w in c.sched.workers.values()]
    assert sum(computed) == 30 + 5 + 1 + 12  # each prompt once, on whichever worker took it
    c.assert_all_free()


def test_a_prompt_to_score_skips_the_prefix_cache_and_caches_after(cluster, hf):
    c = cluster([("prefill", 64), ("decode", 64)])
    prompt = _prompt(23, 30)  # blocks of 4: 5 full + 3 tokens
    c.submit("warm", prompt, max_tokens=4)
    c.run()
    p = _by_role(c, "prefill")
    computed = p.counters.prompt_tokens_computed
    c.submit("scored", prompt, max_tokens=4, prompt_logprobs=0)
    c.run()
    _assert_scores(c.outputs["scored"], hf, prompt, 0)
    assert c.outputs["scored"][-1].num_cached_tokens == 0
    assert p.counters.prompt_tokens_computed - computed == 23  # every position, recomputed
    c.submit("again", prompt, max_tokens=4)  # the cache still serves requests that do not score
    c.run()
    assert c.outputs["again"][-1].num_cached_tokens == 20
    assert c.tokens("again") == c.tokens("scored") == c.tokens("warm") == _greedy(hf, prompt, 4)
    c.assert_all_free()


def test_samples_all_get_the_scores_of_their_one_prefill(cluster, hf):
    c = cluster([("prefill", 64), ("decode", 64)])
    prompt = _prompt(9, 5)
    c.submit("g", prompt, n=3, max_tokens=3, prompt_logprobs=1)
    c.run()
    for rid in ("g", "g/1", "g/2"):
        _assert_scores(c.outputs[rid], hf, prompt, 1)
    assert _by_role(c, "prefill").counters.prompt_tokens_computed == 9
    c.assert_all_free()


def test_a_prompt_scored_again_after_its_prefill_worker_is_lost(cluster, hf):
    c = cluster([("prefill", 64), ("decode", 64)], max_num_batched_tokens=8)
    prompt = _prompt(30, 6)
    c.submit("a", prompt, max_tokens=4, prompt_logprobs=3)
    while _by_role(c, "prefill").counters.prompt_tokens_computed < 16:
        c.step()  # until two chunks are scored on the prefill worker
    assert not c.outputs["a"]
    pid = _by_role(c, "prefill").worker_id
    c.sched.remove_worker(pid)
    c.lose(pid)
    c.run()  # the decode worker prefills (and scores) it from its start
    _assert_scores(c.outputs["a"], hf, prompt, 3)
    assert c.tokens("a") == _greedy(hf, prompt, 4)
    c.assert_all_free()


@pytest.mark.parametrize("roles", [("prefill", "decode"), ("decode",)])
def test_logit_bias_forces_and_bans_tokens_from_the_first_one(cluster, hf, roles):
    c = cluster([(r, 64) for r in roles])
    prompt = _prompt(10, 7)
    greedy = _greedy(hf, prompt, 1)[0]
    runner_up = int(_reference(hf, prompt)[-1].topk(2).indices[1])
    c.submit("forced", prompt, max_tokens=5, logit_bias=((7, 100.0),))
    c.submit("banned", prompt, max_tokens=1, logit_bias=((greedy, -100.0),))
    c.submit("sampled", prompt, max_tokens=5, temperature=1.0, seed=3,
             logit_bias=((11, 100.0),))
    c.run()
    assert c.tokens("forced") == [7] * 5
    assert c.tokens("banned") == [runner_up]
    assert c.tokens("sampled") == [11] * 5
    if "prefill" in roles:  # the first tokens were sampled there
        assert _by_role(c, "decode").counters.prompt_tokens_computed == 0
    c.assert_all_free()
