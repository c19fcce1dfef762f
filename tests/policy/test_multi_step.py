"""Multi-step decode (--num-scheduler-steps N): a plan that only decodes runs N decode steps on
the worker, with blocks held for their tokens (exact ids), answering after each step; the
tokens stream as each step ends; a request that ends early gives back what it held; a step
planned ahead holds blocks for the most the running plan may add."""
from tests.policy.harness import Cluster, scheduled, token_at


def _new_blocks(plan):
    return [(d.request_id, d.new_block_ids) for d in plan.cached_requests]


def test_one_plan_runs_several_decode_steps_and_streams_each():
    """Blocks of 4 tokens, 4 steps a plan. a: 5 prompt tokens, 12 to generate."""
    c = Cluster({"d0": 16}, num_scheduler_steps=4, async_scheduling=False)
    c.submit("a", list(range(5)), max_tokens=12)
    prefill = c.plan("d0")
    assert prefill.num_steps == 1  # it prefills: one step
    c.run_step("d0")  # 6 tokens: blocks 0, 1
    plan = c.plan("d0")
    # its 6th token and 3 more steps: 9 tokens' KV, blocks 0-2
    assert plan.num_steps == 4 and scheduled(plan) == [("a", 1)]
    assert _new_blocks(plan) == [("a", (2,))]
    c.run_step("d0")
    # one output per decode step, as each ended
    assert [o.token_ids for o in c.outputs["a"]] == [[token_at(5 + i)] for i in range(5)]
    c.run()
    assert c.tokens("a") == [token_at(5 + i) for i in range(12)]
    assert c.outputs["a"][-1].finish_reason == "length"
    # 11 decoded tokens in 3 plans of at most 4 steps: 4 + 4 + 3 (max_tokens ends it)
    assert [p.num_steps for p in c.plans["d0"] if p.scheduled] == [1, 4, 4, 4]
    assert c.workers["d0"].decoded == 11
    c.assert_all_free()


def test_a_stop_inside_a_plan_ends_the_request_and_frees_its_blocks_after_the_plan():
    c = Cluster({"d0": 16}, num_scheduler_steps=8, async_scheduling=False)
    c.submit("a", list(range(3)), max_tokens=20, stop_token_ids=(token_at(6),))
    c.submit("b", list(range(10, 13)), max_tokens=10)
    c.run_step("d0") if c.plan("d0") else None
    plan = c.plan("d0")
    assert plan.num_steps == 8
    c.run_step("d0")
    assert c.tokens("a") == [token_at(3 + i) for i in range(4)]
    assert c.outputs["a"][-1].finish_reason == "stop"
    assert "a" not in c.sched.requests
    c.run()
    assert c.tokens("b") == [token_at(3 + i) for i in range(10)]
    c.assert_all_free()


def test_blocks_that_run_out_end_a_request_early_in_the_plan():
    """4 blocks: a (3 prompt tokens, 1 block) and b (7, 2 blocks) leave one free block. a's 4
    more steps need a 2nd block (taken); b's its 3rd: none left, so b decodes while its own
    blocks hold its tokens (8 slots: its 8th token's KV) and goes on in the next plan."""
    c = Cluster({"d0": 4}, num_scheduler_steps=5, async_scheduling=False)
    c.submit("a", list(range(3)), max_tokens=6)
    c.submit("b", list(range(10, 17)), max_tokens=6)
    c.run_step("d0") if c.plan("d0") else None
    kv = c.sched.workers["d0"].kv
    assert {r: kv.get_block_ids(r) for r in kv.request_ids()} == {"a": [0], "b": [1, 2]}
    plan = c.plan("d0")
    assert _new_blocks(plan) == [("a", (3,))]
    c.run_step("d0")
    # a: 5 steps (its 4th..8th tokens fit 2 blocks); b: one step (its 8th token's KV)
    assert len(c.tokens("a")) == 6 and len(c.tokens("b")) == 2
    c.run()
    assert c.tokens("b") == [token_at(7 + i) for i in range(6)]
    c.assert_all_free()


def test_a_plan_ahead_holds_blocks_for_the_most_the_running_plan_adds():
    c = Cluster({"d0": 16}, num_scheduler_steps=3)
    c.submit("a", list(range(5)), max_tokens=10)
    c.run_step("d0") if c.plan("d0") else None  # 6 tokens: blocks 0, 1
    first = c.plan("d0")  # 3 steps: KV of tokens 6..8 -> 8 slots, blocks 0-1
    assert first.num_steps == 3 and _new_blocks(first) == []
    ahead = c.plan("d0")
    # the running plan may bring a to 9 tokens: 3 more steps need KV of 9..11 -> 12 slots
    assert ahead.num_steps == 3 and _new_blocks(ahead) == [("a", (2,))]
    c.run_step("d0")
    c.run_step("d0")
    assert c.tokens("a") == [token_at(5 + i) for i in range(7)]
    c.run()
    assert c.tokens("a") == [token_at(5 + i) for i in range(10)]
    c.assert_all_free()


def test_a_speculating_worker_runs_one_step_a_plan():
    c = Cluster({"d0": 16}, speculate={"d0": (2, 2)}, num_scheduler_steps=4)
    c.submit("a", list(range(5)), max_tokens=9)
    c.run()
    assert all(p.num_steps == 1 for p in c.plans["d0"])
    assert c.tokens("a") == [token_at(5 + i) for i in range(9)]
    c.assert_all_free()
