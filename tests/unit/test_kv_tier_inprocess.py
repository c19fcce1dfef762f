"""The second KV tier with real workers in this process: a prefix the cache evicted comes back
from the tier instead of being recomputed, and the tokens stay HuggingFace's greedy ones."""
import pytest

from common.worker.telemetry import WorkerTelemetry
from services.scheduler.block_hash import extend_block_hashes
from tests.unit.test_scheduler_inprocess import _greedy, _prompt, cluster, hf  # noqa: F401

PROMPT = _prompt(23, 30)  # blocks of 4: 5 full + 3 tokens


def _by_role(c, role):
    return next(w for w in c.sched.workers.values() if w.role == role)


def _first_then_evicted(c) -> list[int]:
    """Serves PROMPT ("first"), then a prompt as long as a 12-block cache ("other"), which
    evicts every block of first's wherever it ran; returns PROMPT."""
    c.submit("first", PROMPT, max_tokens=6)
    c.run()
    c.submit("other", _prompt(45, 31), max_tokens=2)
    c.run()
    return PROMPT


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
    metrics = WorkerTelemetry(worker, w.worker_id, first).registry
    prompt = _prompt(23, 30)                      # blocks of 4: 5 full + 3 tokens
    c.submit("first", prompt, max_tokens=6)
    c.run()
    assert worker.counters.prompt_tokens_computed == 23  # its blocks may be stored ahead
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
    # the worker's metrics: one step loaded, its bytes, and the stores before
    load = {"direction": "load"}
    assert metrics.get_sample_value("pdserve:kv_tier_copy_seconds_count", load) == 1
    assert metrics.get_sample_value("pdserve:kv_tier_copy_bytes_total", load) == \
        5 * worker.cache.layout.block_bytes
    stored = sum(metrics.get_sample_value("pdserve:kv_tier_copy_bytes_total",
                                          {"direction": d}) or 0 for d in ("store", "store_ahead"))
    assert stored == worker.counters.tier_blocks_stored * worker.cache.layout.block_bytes
    assert metrics.get_sample_value("pdserve:worker_kv_tier_blocks_loaded_total",
                                    {"worker_id": w.worker_id, "role": first}) == 5
    c.assert_all_free()


def test_without_a_tier_the_evicted_prefix_is_recomputed(cluster, hf):  # noqa: F811
    """The same traffic as above on a worker without a tier: the baseline the tier saves."""
    c = cluster([("decode", 12)])
    w = _by_role(c, "decode")
    worker = c.workers[w.worker_id]
    prompt = _first_then_evicted(c)
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


def _computed(c, wid):
    return c.workers[wid].counters.prompt_tokens_computed


@pytest.fixture
def host_pair(cluster):  # noqa: F811
    """Two decode workers of one host sharing one tier (colocated), one sequence each."""
    c = cluster([("decode", 12), ("decode", 12)], max_num_seqs=1,
                worker_kw={"kv_offloading_blocks": 32, "kv_offloading_backend": "host"})
    a, b = c.workers
    assert c.workers[a].tier.path == c.workers[b].tier.path
    assert c.sched.workers[a].kv.tier is c.sched.workers[b].kv.tier
    return c, a, b


def test_a_prefix_one_worker_computed_another_loads_from_the_host_tier(host_pair, hf):  # noqa: F811
    c, a, b = host_pair
    prompt = _first_then_evicted(c)  # evicted first's blocks on a: stored
    assert (_computed(c, a), _computed(c, b)) == (23 + 45, 0)
    assert c.workers[a].counters.tier_blocks_stored >= 5
    c.submit("busy", _prompt(5, 32), max_tokens=30)  # keeps a full: b takes the next one
    c.step()
    c.submit("again", prompt, max_tokens=6)
    c.run()
    assert c.tokens("again") == c.tokens("first") == _greedy(hf, prompt, 6)
    assert c.outputs["again"][-1].num_cached_tokens == 20
    assert _computed(c, b) == 3 and c.workers[b].counters.tier_blocks_loaded == 5
    c.assert_all_free()


def test_a_worker_gone_mid_store_leaves_no_block_another_can_read(host_pair, hf):  # noqa: F811
    """a's plan that stores first's blocks never runs (a dies): the tier forgets those slots,
    so b recomputes the prompt rather than read blocks a may have half written; the segment
    lives on with b."""
    c, a, b = host_pair
    prompt = _prompt(23, 30)
    c.submit("first", prompt, max_tokens=6)
    while not (c.outputs["first"] and c.finish_reason("first")):
        c.step()
    plan = c.sched.schedule(a)  # drops first, storing its blocks ahead: sent, never run
    assert len(plan.tier_stores_ahead) >= 5
    tier = c.sched.workers[b].kv.tier
    assert tier.find(_hashes(prompt)[:5], b) == []  # pending: not b's to read yet
    c.sched.remove_worker(a)
    c.workers.pop(a).close()
    assert len(tier) == 0
    assert c.workers[b].tier.path.exists()
    c.submit("again", prompt, max_tokens=6)
    c.run()
    assert c.tokens("again") == _greedy(hf, prompt, 6)
    assert _computed(c, b) == 23 and c.workers[b].counters.tier_blocks_loaded == 0
    c.assert_all_free()


def test_a_decode_worker_loads_from_the_host_tier_what_would_cross(cluster, hf):  # noqa: F811
    """Prefill and decode worker of one host share a tier: when both caches evicted a prompt,
    the prefill worker loads its prefix from the tier and so does the decode worker, so only
    the last, partial block crosses between them."""
    c = cluster([("prefill", 12), ("decode", 12)], prefill_bypass_threshold=0,
                worker_kw={"kv_offloading_blocks": 32, "kv_offloading_backend": "host"})
    p, d = (_by_role(c, r).worker_id for r in ("prefill", "decode"))
    prompt = _first_then_evicted(c)  # evicted first's blocks on both
    sent = c.workers[p].counters.kv_blocks_sent
    c.submit("again", prompt, max_tokens=6)
    c.run()
    assert c.tokens("again") == c.tokens("first") == _greedy(hf, prompt, 6)
    assert c.workers[p].counters.kv_blocks_sent - sent == 1
    assert c.workers[p].counters.tier_blocks_loaded == 5
    assert c.workers[d].counters.tier_blocks_loaded == 5
    c.assert_all_free()


def test_loads_planned_for_a_worker_that_then_has_nothing_else_still_run(cluster):  # noqa: F811
    """A transfer into the decode worker plans loads from its tier there; its request is
    aborted before the decode worker's next plan. That plan still goes out, with the loads
    alone, and the slots they pinned are free again once it has answered."""
    c = cluster([("prefill", 64), ("decode", 12)], prefill_bypass_threshold=0,
                worker_kw={"kv_offloading_blocks": 32})
    p, d = (_by_role(c, r).worker_id for r in ("prefill", "decode"))
    prompt = _first_then_evicted(c)  # evicted first's blocks on d
    c.submit("again", prompt, max_tokens=6)
    plan = c.sched.schedule(p)
    dkv = c.sched.workers[d].kv
    assert dkv.has_tier_copies  # the blocks d lacks of it come from d's tier, not p
    assert plan.sends == [] and dkv.tier._pins
    c.sched.abort("again")
    for out in c.sched.update(p, c.workers[p].execute(plan)):
        c.outputs[out.request_id].append(out)
    assert c.sched.has_work(d)
    c.run()
    assert not dkv.has_tier_copies and not dkv.tier._pins and not dkv.tier._events
    c.assert_all_free()
