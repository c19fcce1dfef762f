"""Requests through prefill, transfer and decode, and prefix-cache hits on both pools: the exact
blocks each step uses and the exact KV each transfer moves."""
from tests.policy.harness import Cluster, token_at


def test_a_disaggregated_request_moves_prefill_transfer_decode():
    c = Cluster({"p0": 16, "d0": 16})
    c.submit("a", list(range(10)), max_tokens=3)
    admit = c.plan("p0")
    # the prompt's 3 blocks on each side; the decode worker expects all of them
    assert [(n.request_id, n.block_ids, n.num_computed_tokens) for n in admit.new_requests] == \
        [("a", (0, 1, 2), 0)]
    assert [(s.request_id, s.num_tokens) for s in admit.scheduled] == [("a", 10)]
    assert not admit.sends  # the receiver has not registered the transfer yet
    expect = c.plan("d0")
    assert [(r.request_id, r.block_ids) for r in expect.recvs] == [("a", (0, 1, 2))]
    c.run_step("p0")  # prefill: the first token
    assert c.tokens("a") == [token_at(10)]
    c.run_step("d0")  # the receiver now expects the transfer
    send = c.plan("p0")
    assert [(k.src_block_ids, k.dst_block_ids, k.transport) for k in send.sends] == \
        [((0, 1, 2), (0, 1, 2), "shm")]
    c.run_step("p0")  # sends, done: the prompt leaves the prefill worker
    p, d = c.sched.workers["p0"], c.sched.workers["d0"]
    assert p.kv.num_free_blocks == 16 and d.kv.get_block_ids("a") == [0, 1, 2]
    join = c.plan("d0")
    assert [(n.request_id, n.kv_transfer_id != "", n.num_computed_tokens)
            for n in join.new_requests] == [("a", True, 10)]
    assert [(s.request_id, s.num_tokens) for s in join.scheduled] == [("a", 1)]
    c.run()
    assert c.tokens("a") == [token_at(10), token_at(11), token_at(12)]
    assert c.outputs["a"][-1].finish_reason == "length"
    c.assert_all_free()


def test_prefix_hits_on_both_pools_skip_compute_and_transfer():
    """b shares a's first 8 tokens (2 full blocks): the prefill worker computes only b's tail
    and only b's last block travels, into the block the decode worker gives it."""
    c = Cluster({"p0": 16, "d0": 16})
    c.submit("a", list(range(10)), max_tokens=3)
    c.run()
    # freed tails go to the back of the free queues, last block first; the heads stay cached
    p, d = c.sched.workers["p0"], c.sched.workers["d0"]
    assert p.kv.pool.free_block_ids()[-3:] == [2, 1, 0]
    assert d.kv.pool.free_block_ids()[-3:] == [2, 1, 0]
    c.submit("b", list(range(8)) + [50, 51, 52], max_tokens=2)
    admit = c.plan("p0")
    [new] = admit.new_requests
    assert (new.block_ids, new.num_computed_tokens) == ((0, 1, 3), 8)
    assert [(s.request_id, s.num_tokens) for s in admit.scheduled] == [("b", 3)]
    [recv] = c.plan("d0").recvs
    assert recv.block_ids == (3,)  # a's 12 computed tokens took 0-2: the queue's front is 3
    c.run_step("p0")
    c.run_step("d0")
    [send] = c.plan("p0").sends
    assert (send.src_block_ids, send.dst_block_ids) == ((3,), (3,))
    c.run()
    assert c.tokens("b") == [token_at(11), token_at(12)]
    assert c.workers["p0"].prompt_tokens == 10 + 3
    assert c.workers["p0"].sent == 3 + 1 and c.workers["d0"].received == 3 + 1
    c.assert_all_free()


def test_a_short_prompt_bypasses_the_prefill_pool():
    c = Cluster({"p0": 16, "d0": 16}, prefill_bypass_threshold=8)
    c.submit("short", list(range(6)), max_tokens=2)
    c.submit("long", list(range(100, 120)), max_tokens=2)
    d_plan, p_plan = c.plan("d0"), c.plan("p0")
    assert [(s.request_id, s.num_tokens) for s in d_plan.scheduled] == [("short", 6)]
    assert [(s.request_id, s.num_tokens) for s in p_plan.scheduled] == [("long", 20)]
    assert [t.request.request_id for t in c.sched.transfers.by_id.values()] == ["long"]
    c.run()
    assert c.workers["d0"].prompt_tokens == 6 and c.workers["p0"].prompt_tokens == 20
    c.assert_all_free()
