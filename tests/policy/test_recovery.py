"""Failures: a lost worker, a failed KV transfer and an abort while KV is in flight. Requests
are recomputed with the tokens they have (none streamed twice), and blocks that a send may still
read or write come back only once the sender reports it done."""
from tests.policy.harness import Cluster, token_at


def test_requests_of_a_lost_decode_worker_resume_on_another():
    c = Cluster({"p0": 16, "d0": 16, "d1": 16})
    c.submit("a", list(range(10)), max_tokens=6)
    for _ in range(5):
        c.step()
    req = c.sched.requests["a"]
    lost, streamed = req.decode_worker, c.tokens("a")
    assert lost in ("d0", "d1") and 1 < len(streamed) < 6
    c.lose(lost)
    assert req.status.value == "waiting" and req.all_token_ids == list(range(10)) + streamed
    readmit = c.plan("p0")
    [new] = readmit.new_requests
    # prompt + tokens so far; the prompt's 2 full blocks are prefix hits on the prefill worker
    assert new.all_token_ids == tuple(range(10)) + tuple(streamed)
    assert new.num_computed_tokens == 8
    survivor = "d1" if lost == "d0" else "d0"
    assert c.sched.transfers.get(req.transfer_id).dst.worker_id == survivor
    c.run()
    assert c.tokens("a") == [token_at(10 + i) for i in range(6)]  # nothing twice, no gap
    c.assert_all_free()


def test_a_failed_transfer_is_recomputed_on_the_decode_worker():
    c = Cluster({"p0": 16, "d0": 16})
    c.submit("a", list(range(10)), max_tokens=3)
    c.plan("p0"), c.plan("d0")
    c.run_step("p0"), c.run_step("d0")
    c.plan("p0")
    c.run_step("p0", send_error="connection reset")
    assert c.sched.workers["p0"].kv.num_free_blocks == 16  # the sender is done with them
    req = c.sched.requests["a"]
    assert req.prefill_locally and req.status.value == "waiting"
    plan = c.plan("d0")
    assert plan.finished_request_ids == ["a"]  # the transfer it expected is off
    [new] = plan.new_requests
    assert (new.request_id, new.kv_transfer_id, new.num_computed_tokens) == ("a", "", 0)
    assert [(s.request_id, s.num_tokens) for s in plan.scheduled] == [("a", 11)]
    drop = c.plan("p0")  # the prefill worker forgets it; no second hop
    assert drop.finished_request_ids == ["a"] and not drop.new_requests
    c.run()
    assert c.tokens("a") == [token_at(10), token_at(11), token_at(12)]
    c.assert_all_free()


def test_an_abort_while_kv_is_in_flight_frees_only_after_the_send():
    c = Cluster({"p0": 16, "d0": 16})
    c.hold_sends = True
    c.submit("a", list(range(10)), max_tokens=3)
    while not c.held_sends:
        c.step()
    p, d = c.sched.workers["p0"], c.sched.workers["d0"]
    c.sched.abort("a")
    # the send may be reading P's blocks and writing D's right now
    assert p.kv.num_free_blocks == d.kv.num_free_blocks == 16 - 3
    wid, plan = c.held_sends.pop()
    c.deliver(wid, plan)
    assert p.kv.num_free_blocks == d.kv.num_free_blocks == 16
    c.run()  # the decode worker drops the transfer it expected
    c.assert_all_free()
