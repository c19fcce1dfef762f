"""Lookahead slots for a decode worker that speculates: exact blocks for the drafts, none past
max_tokens, none taken by preemption; a step planned ahead holds blocks for the most the running
step may add; a step's several tokens go out up to one that stops the request; every block comes
back."""
from tests.policy.harness import Cluster, token_at


def _scheduled(plan):
    return [(s.request_id, s.num_tokens, s.num_lookahead) for s in plan.scheduled]


def _new_blocks(plan):
    return [(d.request_id, d.new_block_ids) for d in plan.cached_requests]


def test_drafts_get_slots_and_a_step_may_bring_several_tokens():
    """Blocks of 4 tokens, k = 3, every draft right. a: 7 prompt tokens, 10 to generate."""
    c = Cluster({"d0": 16}, speculate={"d0": (3, 3)})
    c.submit("a", list(range(7)), max_tokens=10)
    prefill = c.plan("d0")
    assert _scheduled(prefill) == [("a", 7, 0)]  # no drafts while it prefills
    c.run_step("d0")  # 8 tokens: blocks 0, 1
    first = c.plan("d0")
    # its 8th token and 3 drafts: 11 slots, a third block
    assert _scheduled(first) == [("a", 1, 3)] and _new_blocks(first) == [("a", (2,))]
    ahead = c.plan("d0")
    # planned while `first` runs, which may add 4 tokens (12): 3 more drafts need 15 slots
    assert _scheduled(ahead) == [("a", 1, 3)] and _new_blocks(ahead) == [("a", (3,))]
    c.run_step("d0")
    assert [o.token_ids for o in c.outputs["a"]] == [[token_at(7)], [token_at(8 + i)
                                                                     for i in range(4)]]
    c.run_step("d0")  # 4 more: 9 of 10
    last = c.plan("d0")
    # one token left: no draft; its 16th token's KV fits the blocks held for the drafts
    assert _scheduled(last) == [("a", 1, 0)] and _new_blocks(last) == []
    c.run()
    assert c.tokens("a") == [token_at(7 + i) for i in range(10)]
    assert c.outputs["a"][-1].finish_reason == "length"
    assert c.workers["d0"].decoded == 9  # the prefill's token is not decoded
    c.assert_all_free()


def test_drafts_never_preempt_and_take_only_free_blocks():
    """3 blocks of 4 tokens, k = 4. After prefill a holds 5 tokens in block 0, b 4 in block 1.
    a's 5th token needs block 2, the last free one, and its drafts a 3rd: it decodes without
    drafts; b's 4th token fits block 1 and its drafts would need another: none either. Nobody
    is preempted for drafts."""
    c = Cluster({"d0": 3}, speculate={"d0": (4, 0)}, async_scheduling=False)
    c.submit("a", list(range(4)), max_tokens=6)
    c.submit("b", list(range(10, 13)), max_tokens=6)
    c.run_step("d0") if c.plan("d0") else None  # a: block 0 (5 tokens: 2 blocks), b: block 1
    kv = c.sched.workers["d0"].kv
    assert {r: kv.get_block_ids(r) for r in kv.request_ids()} == {"a": [0], "b": [1]}
    plan = c.plan("d0")
    # a's 5th token needs block 2 (the last); its drafts would need a 3rd: none for them. b's
    # 4th token fits its block, drafts past it would need another: none either
    assert _scheduled(plan) == [("a", 1, 0), ("b", 1, 0)]
    assert _new_blocks(plan) == [("a", (2,))]
    assert c.sched.num_preemptions == 0
    c.run_step("d0")
    c.run()
    assert c.tokens("a") == [token_at(4 + i) for i in range(6)]
    c.assert_all_free()


def test_a_stop_inside_a_step_drops_the_tokens_after_it():
    c = Cluster({"d0": 16}, speculate={"d0": (4, 4)})
    c.submit("a", list(range(5)), max_tokens=20, stop_token_ids=(token_at(8),))
    c.run()
    assert c.tokens("a") == [token_at(5 + i) for i in range(4)]
    out = c.outputs["a"][-1]
    assert (out.finish_reason, out.stop_token_id) == ("stop", token_at(8))
    assert len(out.token_ids) > 1  # it came in one step with the tokens before it
    c.assert_all_free()


def test_disaggregated_decode_worker_speculates_after_the_transfer():
    c = Cluster({"p0": 16, "d1": 16}, speculate={"d1": (2, 1)})
    c.submit("a", list(range(6)), max_tokens=9)
    c.run()
    assert c.tokens("a") == [token_at(6 + i) for i in range(9)]
    # the prefill worker's first token, then steps of 2 tokens (one draft right each)
    assert [len(o.token_ids) for o in c.outputs["a"]] == [1, 2, 2, 2, 2]
    assert not any(s.num_lookahead for p in c.plans["p0"] for s in p.scheduled)
    c.assert_all_free()
