"""Samples of one prompt (n > 1): prefilled once, the full prompt blocks shared (reference
counted), the partial last one copied for each sample before the step that first decodes it."""
from tests.policy.harness import Cluster, scheduled, token_at


def test_samples_share_full_blocks_and_copy_the_partial_one():
    c = Cluster({"d0": 8})
    c.submit("s", list(range(6)), max_tokens=3, n=3)  # 6 tokens: block 0 full, block 1 partial
    prefill = c.plan("d0")
    [new] = prefill.new_requests
    assert (new.block_ids, [f.request_id for f in new.forks]) == ((0, 1), ["s/1", "s/2"])
    c.run_step("d0")
    assert [c.tokens(r) for r in ("s", "s/1", "s/2")] == [[token_at(6)]] * 3
    kv = c.sched.workers["d0"].kv
    # each sample: block 0 shared, a fresh block for its copy of block 1, which the scheduler
    # holds until the copies have run
    assert {r: kv.get_block_ids(r) for r in ("s", "s/1", "s/2")} == {
        "s": [0, 1], "s/1": [0, 2], "s/2": [0, 3]}
    assert kv.pool.ref_cnt[:4] == [3, 3, 1, 1]
    plan = c.plan("d0")
    assert [(b.src, b.dst, b.request_id, b.leader_id) for b in plan.copies] == [
        (1, 2, "s/1", "s"), (1, 3, "s/2", "s")]
    assert [(n.request_id, n.block_ids, n.num_computed_tokens) for n in plan.new_requests] == [
        ("s/1", (0, 2), 6), ("s/2", (0, 3), 6)]
    assert scheduled(plan) == [("s", 1), ("s/1", 1), ("s/2", 1)]
    c.run_step("d0")
    assert kv.pool.ref_cnt[:4] == [3, 1, 1, 1]  # the copies ran: the holds are gone
    c.run()
    for r in ("s", "s/1", "s/2"):
        assert c.tokens(r) == [token_at(6), token_at(7), token_at(8)], r
    c.assert_all_free()


def test_a_sample_aborted_before_its_first_token_leaves_the_others_alone():
    c = Cluster({"p0": 8, "d0": 8})
    c.submit("s", list(range(6)), max_tokens=2, n=2)
    c.sched.abort("s/1")
    c.run()
    assert c.tokens("s") == [token_at(6), token_at(7)] and c.tokens("s/1") == []
    c.assert_all_free()
