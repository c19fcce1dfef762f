"""The decode batch: preemption takes the least important request (priority, then arrival) and
returns its blocks at once; steps planned ahead decode the same batch with the blocks the
running step's tokens need."""
from tests.policy.harness import Cluster, scheduled, token_at


def test_preemption_takes_the_least_important_request():
    """5 blocks of 4 tokens: three 4-token prompts take one each, and their 5th tokens need
    one more each with 2 free. Most important first (priority, then arrival): the one that
    runs short is the least important, preempted although it came first; its block goes back
    to the pool at once (no step of it runs)."""
    c = Cluster({"d0": 5}, async_scheduling=False)
    c.submit("late_but_urgent", list(range(4)), max_tokens=8, priority=0)
    c.submit("early_but_idle", list(range(10, 14)), max_tokens=8, priority=5)
    c.submit("middle", list(range(20, 24)), max_tokens=8, priority=1)
    c.run_step("d0") if c.plan("d0") else None  # all three prefill: blocks 0, 1, 2
    kv = c.sched.workers["d0"].kv
    assert {r: kv.get_block_ids(r) for r in kv.request_ids()} == {
        "late_but_urgent": [0], "early_but_idle": [1], "middle": [2]}
    plan = c.plan("d0")
    assert scheduled(plan) == [("late_but_urgent", 1), ("middle", 1)]
    assert [(d.request_id, d.new_block_ids) for d in plan.cached_requests] == [
        ("late_but_urgent", (3,)), ("middle", (4,))]
    assert plan.finished_request_ids == ["early_but_idle"]
    assert c.sched.num_preemptions == 1
    assert c.sched.requests["early_but_idle"].num_preemptions == 1
    assert kv.pool.free_block_ids() == [1]
    c.run_step("d0")
    c.run()
    for rid, start in (("late_but_urgent", 4), ("early_but_idle", 4), ("middle", 4)):
        assert c.tokens(rid) == [token_at(start + i) for i in range(8)], rid
    c.assert_all_free()


def test_steps_planned_ahead_decode_the_same_batch():
    c = Cluster({"d0": 16})
    c.submit("a", list(range(7)), max_tokens=6)
    c.submit("b", list(range(10, 13)), max_tokens=2)
    c.run_step("d0") if c.plan("d0") else None  # prefill both: a in [0, 1], b in [2]
    first = c.plan("d0")  # computes a's 8th token: still block 1
    assert scheduled(first) == [("a", 1), ("b", 1)] and not first.cached_requests
    # while `first` runs: b ends by length with it; a's 9th token needs a third block, taken
    # ahead of time from the free queue's front
    ahead = c.plan("d0")
    assert scheduled(ahead) == [("a", 1)]
    assert [(d.request_id, d.new_block_ids) for d in ahead.cached_requests] == [("a", (3,))]
    assert c.plan("d0") is None  # one step ahead at most
    c.run_step("d0")
    c.run_step("d0")
    assert c.tokens("b") == [token_at(3), token_at(4)]
    c.run()
    assert c.tokens("a") == [token_at(7 + i) for i in range(6)]
    c.assert_all_free()


def test_nothing_is_planned_ahead_while_other_work_waits():
    c = Cluster({"d0": 16})
    c.submit("a", list(range(6)), max_tokens=6)
    c.run_step("d0") if c.plan("d0") else None
    assert c.plan("d0") is not None  # decodes a
    c.submit("b", list(range(10, 13)), max_tokens=2)  # waiting: the next plan admits it
    assert c.sched.schedule_ahead("d0") is None
    c.run()
    c.assert_all_free()
