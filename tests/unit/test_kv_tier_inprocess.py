"""The second KV tier with real workers in this process: a prefix the cache evicted comes back
from the tier instead of being recomputed, and the tokens stay HuggingFace's greedy ones."""
import pytest

from services.scheduler.block_hash import extend_block_hashes
from tests.unit.test_scheduler_inprocess import _greedy, _prompt, cluster, hf  # noqa: F401


def _by_role(c, role):
    return next(w for w in c.sched.workers.values() if w.role == role)


@pytest.mark.parametrize("roles", [
    [("decode", 12)],                     # colocated: the decode worker prefills and loads
    [("prefill", 12), ("decode", 64)],    # the prefill worker loads, then sends the KV
], ids=["colocated", "disaggregated"])
def test_an_evicted_prefix_comes_back_from_the_tier(cluster, hf, roles):  # noqa: F811
    c = cluster(roles, worker_kw={"kv_offloading_blocks": 32}, max_num_batched_tokens=64,
                prefill_bypass_threshold=0)
    first = roles[0][0]
    w = _by_role(c, first)
    worker = c.workers[w.worker_id]
    prompt = _prompt(23, 30)                      # blocks of 4: 5 full + 3 tokens
    c.submit("first", prompt, max_tokens=6)
    c.run()
    computed = worker.counters.prompt_tokens_computed
    assert computed == 23 and worker.counters.tier_blocks_stored == 0
    # another prompt as long as the cache: every block of first's is evicted, into the tier
    c.submit("other", _prompt(45, 31), max_tokens=2)
    c.run()
    assert w.kv.find_prefix(_hashes(prompt), 23) == []
    assert worker.counters.tier_blocks_stored >= 5
    computed = worker.counters.prompt_tokens_computed
    c.submit("again", prompt, max_tokens=6)
    c.run()
    assert c.tokens("again") == c.tokens("first") == _greedy(hf, prompt, 6)
    assert c.outputs["again"][-1].num_cached_tokens == 20
    assert worker.counters.prompt_tokens_computed - computed == 3  # only the partial block
    assert worker.counters.tier_blocks_loaded == 5
    assert w.kv.num_tier_hit_tokens == 20
    c.assert_all_free()


def test_without_a_tier_the_evicted_prefix_is_recomputed(cluster, hf):  # noqa: F811
    """The same traffic as above on a worker without a tier: the baseline the tier saves."""
    c = cluster([("decode", 12)])
    w = _by_role(c, "decode")
    worker = c.workers[w.worker_id]
    prompt = _prompt(23, 30)
    c.submit("first", prompt, max_tokens=6)
    c.run()
    c.submit("other", _prompt(45, 31), max_tokens=2)
    c.run()
    computed = worker.counters.prompt_tokens_computed
    c.submit("again", prompt, max_tokens=6)
    c.run()
    assert c.tokens("again") == _greedy(hf, prompt, 6)
    assert c.outputs["again"][-1].num_cached_tokens == 0
    assert worker.counters.prompt_tokens_computed - computed == 23
    assert w.kv.tier is None and worker.counters.tier_blocks_loaded == 0


def _hashes(prompt):
    out: list[bytes] = []
    extend_block_hashes(out, prompt, 4, "")
    return out
