"""Requests through prefill, transfer and decode, and prefix-cache hits on both pools: the exact
blocks each step uses and the exact KV each transfer moves."""
import math

import pytest

from services.scheduler.prefill import ShortLoad
from services.scheduler.request import Status
from services.scheduler.worker_state import PrefillSpeed, Step
from tests.policy.harness import Cluster, scheduled, token_at


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


def _scheduled(plan):
    return scheduled(plan) if plan else []


def test_a_free_prefill_worker_takes_short_prompts_too():
    """Nothing is busy: the short prompt goes the disaggregated way, sparing the decode batch."""
    c = Cluster({"p0": 16, "d0": 16}, prefill_bypass_threshold=8)
    c.submit("short", list(range(6)), max_tokens=2)
    assert c.plan("d0") is None
    assert _scheduled(c.plan("p0")) == [("short", 6)]
    c.run()
    assert c.workers["d0"].prompt_tokens == 0 and c.workers["p0"].prompt_tokens == 6
    c.assert_all_free()


def test_a_short_prompt_does_not_wait_for_a_busy_prefill_worker():
    c = Cluster({"p0": 16, "d0": 16}, prefill_bypass_threshold=8)
    c.submit("long", list(range(100, 120)), max_tokens=2)
    assert _scheduled(c.plan("p0")) == [("long", 20)]  # p0's step runs: p0 is busy
    c.submit("short", list(range(6)), max_tokens=2)
    d_plan = c.plan("d0")
    assert _scheduled(d_plan) == [("short", 6)]
    # blocks 0-4 wait for long's KV
    assert [(n.request_id, n.block_ids) for n in d_plan.new_requests] == [("short", (5, 6))]
    assert [t.request.request_id for t in c.sched.transfers.by_id.values()] == ["long"]
    c.run()
    assert c.workers["d0"].prompt_tokens == 6 and c.workers["p0"].prompt_tokens == 20
    assert c.tokens("short") == [token_at(6), token_at(7)]
    c.assert_all_free()


def test_a_follow_up_prefills_where_its_conversation_is_cached():
    """The decode worker holds the first turn's blocks: the second turn's short tail is
    computed there, though the prefill worker is free (no recompute of 12 tokens, no KV hop)."""
    c = Cluster({"p0": 16, "d0": 16}, prefill_bypass_threshold=8)
    first = list(range(13))
    c.submit("turn1", first, max_tokens=8)
    c.run()
    assert c.workers["p0"].prompt_tokens == 13
    reply = c.tokens("turn1")
    # 22 tokens: 16 cached on d0 (prompt and reply), 12 on p0 (the prompt's full blocks)
    c.submit("turn2", first + reply[:7] + [500, 501], max_tokens=2)
    assert c.plan("p0") is None
    d_plan = c.plan("d0")
    assert [(n.request_id, n.num_computed_tokens) for n in d_plan.new_requests] == [("turn2", 16)]
    assert _scheduled(d_plan) == [("turn2", 6)]
    c.run()
    assert c.workers["p0"].prompt_tokens == 13 and c.workers["d0"].prompt_tokens == 6
    c.assert_all_free()


def test_a_decode_worker_prefills_at_most_its_step_share():
    """Busy prefill worker, short prompts: the decode worker's steps carry at most its step
    share (8 prompt tokens) beside its decodes, filled in arrival order."""
    c = Cluster({"p0": 32, "d0": 32}, prefill_bypass_threshold=8, decode_prefill_tokens=8)
    c.submit("long", list(range(100, 140)), max_tokens=1)
    c.plan("p0")
    for rid, first in (("a", 0), ("b", 200), ("c", 300), ("d", 400), ("e", 500)):
        c.submit(rid, list(range(first, first + 7)), max_tokens=2)
    steps = []
    for _ in range(5):
        steps.append(_scheduled(c.plan("d0")))
        c.run_step("d0")
    assert steps == [[("a", 7), ("b", 1)],
                     [("a", 1), ("b", 6), ("c", 2)],
                     [("b", 1), ("c", 5), ("d", 3)],
                     [("c", 1), ("d", 4), ("e", 4)],
                     [("d", 1), ("e", 3)]]
    c.run()
    assert c.workers["d0"].prompt_tokens == 35 and c.workers["p0"].prompt_tokens == 40
    c.assert_all_free()


def test_steps_that_prefill_measure_their_workers_prefill_speed():
    """From the plan leaving to its result: 20 prompt tokens in 80 ms, then 8 in 16 ms (a step
    of fewer than MIN_TIMED_PREFILL prompt tokens is not timed), smoothed 0.2 : 0.8."""
    c = Cluster({"p0": 32, "d0": 32}, max_num_batched_tokens=20, max_num_partial_prefills=1)
    c.submit("a", list(range(100, 120)), max_tokens=1)
    c.plan("p0")
    c.now += 0.080
    c.run_step("p0")
    p = c.sched.workers["p0"]
    assert p.prefill_speed.seconds_per_token == pytest.approx(0.004)
    c.submit("b", list(range(200, 216)), max_tokens=1)
    c.submit("c", list(range(300, 308)), max_tokens=1)
    c.plan("p0")  # b (16 tokens) and c's first 4: 20 prompt tokens
    c.now += 0.040
    c.run_step("p0")
    assert p.prefill_speed.seconds_per_token == pytest.approx(0.2 * 0.002 + 0.8 * 0.004)
    before = p.prefill_speed.seconds_per_token
    c.plan("p0")  # c's last 4 tokens: too few to time
    c.now += 1.0
    c.run_step("p0")
    assert p.prefill_speed.seconds_per_token == before


def test_a_prefill_speed_is_kept_per_thread_count_too():
    """20 tokens in 20 ms on two threads, then 20 in 80 ms on one: 1 and 4 ms a token by
    thread count, 0.2 * 4 + 0.8 * 1 over both; a thread count not seen yet gets the latter."""
    speed = PrefillSpeed()
    assert speed.on(2) == 0.0
    speed.observe(20, 0.020, threads=2)
    speed.observe(20, 0.080, threads=1)
    assert speed.by_threads == pytest.approx({2: 0.001, 1: 0.004})
    assert speed.seconds_per_token == pytest.approx(0.2 * 0.004 + 0.8 * 0.001)
    assert (speed.on(2), speed.on(1)) == pytest.approx((0.001, 0.004))
    assert speed.on(3) == pytest.approx(speed.seconds_per_token)


def test_a_speed_over_a_horizon_of_tokens_weighs_each_step_by_its_tokens():
    """A hold's steps as its context grows, the batch's 100 ms in each: 100 prompt tokens in
    300 ms, then 50 in 250 ms, then 20 in 250 ms (3, 5 and 12.5 ms a token). Over a horizon of
    1000 tokens each older step's sums decay by e^(-tokens after it / 1000): the speed is the
    decayed seconds over the decayed tokens, where a speed smoothed over steps (0.2 : 0.8)
    follows the last, smallest steps."""
    speed = PrefillSpeed(horizon_tokens=1000)
    steps = [(100, 0.300), (50, 0.250), (20, 0.250)]
    for tokens, seconds in steps:
        speed.observe(tokens, seconds, threads=1)
    k20, k70 = math.exp(-20 / 1000), math.exp(-70 / 1000)
    want = (0.300 * k70 + 0.250 * k20 + 0.250) / (100 * k70 + 50 * k20 + 20)
    assert speed.seconds_per_token == pytest.approx(want)  # 4.8 ms a token
    assert speed.by_threads == pytest.approx({1: want})
    assert speed.on(2) == pytest.approx(want)
    stepwise = PrefillSpeed()
    for tokens, seconds in steps:
        stepwise.observe(tokens, seconds)
    assert stepwise.seconds_per_token == pytest.approx(
        0.2 * 0.0125 + 0.8 * (0.2 * 0.005 + 0.8 * 0.003))  # 6.2 ms
    long_ago = PrefillSpeed(horizon_tokens=1000)
    long_ago.observe(100, 1.0)
    long_ago.observe(10_000, 20.0)  # 2 ms a token, 10 horizons after the first step
    assert long_ago.seconds_per_token == pytest.approx(0.002, rel=1e-3)
    told = PrefillSpeed(horizon_tokens=1000, seconds_per_token=0.004)  # set, no steps behind
    told.observe(100, 0.2)
    keep = math.exp(-100 / 1000)
    assert told.seconds_per_token == pytest.approx((0.4 * keep + 0.2) / (100 * keep + 100))


def test_decode_only_steps_are_timed_from_the_later_of_their_plan_and_the_answer_before():
    """A step planned at 1.00 s and answered at 1.05 s took 50 ms; the next one, planned
    ahead at 1.02 s while the first ran, ran from 1.05 s to 1.15 s: 100 ms, smoothed 0.2 :
    0.8. A step that prefills is not timed here, but the one after it starts at its answer."""
    c = Cluster({"p0": 32, "d0": 32})
    d = c.sched.workers["d0"]
    d.step_answered(Step(1, {"a"}, decodes_only=True, planned_at=1.00), 1.05)
    assert d.decode_step_seconds == pytest.approx(0.050)
    d.step_answered(Step(2, {"a"}, decodes_only=True, planned_at=1.02), 1.15)
    assert d.decode_step_seconds == pytest.approx(0.2 * 0.100 + 0.8 * 0.050)
    before = d.decode_step_seconds
    d.step_answered(Step(3, {"a", "b"}, prefill_tokens=40, planned_at=1.15), 1.40)
    assert d.decode_step_seconds == before
    d.step_answered(Step(4, {"a", "b"}, decodes_only=True, planned_at=1.20), 1.45)
    assert d.decode_step_seconds == pytest.approx(0.2 * 0.050 + 0.8 * before)
    assert d.computed_at == 1.45
    d.step_answered(Step(5, recvs=["t"], planned_at=1.50), 1.51)  # computes nothing
    assert d.computed_at == 1.45


def test_a_step_on_all_cores_that_a_peer_crowded_counts_for_no_thread_count():
    """p0 and d0 share cores 0 and 1. x (20 tokens) on p0's two threads alone in 20 ms: 1 ms a
    token on 2. y (20 tokens) on both again, but d0 computes a short prompt meanwhile, and y
    takes 40 ms: only the speed over all steps takes it in."""
    c = Cluster({"p0": 64, "d0": 64}, cpu_cores=(0, 1), prefill_bypass_threshold=4)
    p0 = c.sched.workers["p0"]
    c.submit("x", list(range(100, 120)), max_tokens=1)
    assert c.plan("p0").num_threads == 2
    c.now += 0.020
    c.run_step("p0")
    assert p0.prefill_speed.by_threads == pytest.approx({2: 0.001})
    c.submit("y", list(range(200, 220)), max_tokens=1)
    assert c.plan("p0").num_threads == 2
    c.submit("z", list(range(300, 304)), max_tokens=1)
    assert _scheduled(c.plan("d0")) == [("z", 4)]  # no prefill worker free: d0 takes it
    c.now += 0.010
    c.run_step("d0")
    c.now += 0.030
    c.run_step("p0")
    assert p0.prefill_speed.by_threads == pytest.approx({2: 0.001})
    assert p0.prefill_speed.seconds_per_token == pytest.approx(0.2 * 0.002 + 0.8 * 0.001)
    c.run()
    c.assert_all_free()


def test_a_long_prompt_on_the_decode_worker_takes_small_chunks_after_short_ones():
    """The decode worker's step share is 8 prompt tokens; a long prompt's chunk takes at most 3
    (--decode-long-prefill-tokens), and while it holds one its steps carry 3 prompt tokens in
    all, short prompts first."""
    c = Cluster({"p0": 32, "d0": 32}, prefill_bypass_threshold=4, decode_prefill_tokens=8,
                decode_long_prefill_tokens=3)
    c.submit("long1", list(range(100, 120)), max_tokens=1)
    c.plan("p0")
    c.submit("long2", list(range(200, 212)), max_tokens=1)
    c.submit("short", list(range(300, 304)), max_tokens=1)
    assert _scheduled(c.plan("d0")) == [("long2", 3), ("short", 4)]
    c.run_step("d0")
    c.submit("short2", list(range(400, 404)), max_tokens=1)
    assert _scheduled(c.plan("d0")) == [("short2", 3)]
    c.run_step("d0")
    assert _scheduled(c.plan("d0")) == [("short2", 1), ("long2", 2)]
    c.run_step("d0")
    assert _scheduled(c.plan("d0")) == [("long2", 3)]
    c.run()
    assert c.workers["d0"].prompt_tokens == 12 + 4 + 4
    c.assert_all_free()


def test_steps_beside_a_long_prompt_are_sized_to_the_decode_step_target():
    """While d0 holds a long prompt its first step carries --decode-long-prefill-tokens (16);
    each later one the tokens that fit in --decode-step-target-ms (100) at the pace of the step
    before: 16 in 50 ms -> 32; 32 in 160 ms -> 20; a step of 20 that took a second -> the floor
    of 16; one of 16 in a millisecond -> the --decode-prefill-tokens ceiling of 64."""
    c = Cluster({"p0": 128, "d0": 256}, prefill_bypass_threshold=4, decode_prefill_tokens=64,
                decode_long_prefill_tokens=16, decode_step_target_ms=100)
    c.submit("long1", list(range(1000, 1200)), max_tokens=1)
    c.plan("p0")
    c.submit("long2", list(range(2000, 2156)), max_tokens=1)
    chunks = []
    for seconds in (0.050, 0.160, 1.0, 0.001, 0.001):
        chunks.append(_scheduled(c.plan("d0")))
        c.now += seconds
        c.run_step("d0")
    assert chunks == [[("long2", 16)], [("long2", 32)], [("long2", 20)], [("long2", 16)],
                      [("long2", 64)]]
    assert c.sched.workers["d0"].held_step_tokens == {0: 64}  # threads not managed: 0
    assert _scheduled(c.plan("d0")) == [("long2", 8)]
    c.now += 5.0  # the prompt's last 8 tokens: too few to time, the size stays
    c.run_step("d0")
    assert c.sched.workers["d0"].held_step_tokens == {0: 64}
    c.run()
    assert c.workers["d0"].prompt_tokens == 156 and c.workers["p0"].prompt_tokens == 200
    c.assert_all_free()


def test_the_steps_beside_a_held_prompt_have_their_own_speed():
    """A step of d0's with a short prompt's 16 tokens (p0 busy with long1) that took 32 ms
    counts for d0's prefill speed alone; its steps beside long2, which it holds, for both."""
    c = Cluster({"p0": 128, "d0": 256}, prefill_bypass_threshold=20, decode_prefill_tokens=64,
                decode_long_prefill_tokens=16, decode_step_target_ms=100, price_holds=False)
    c.submit("long1", list(range(1000, 1200)), max_tokens=1)
    c.plan("p0")
    c.submit("short", list(range(3000, 3016)), max_tokens=1)
    assert _scheduled(c.plan("d0")) == [("short", 16)]
    c.now += 0.032
    c.run_step("d0")
    d0 = c.sched.workers["d0"]
    assert (d0.prefill_speed.seconds_per_token, d0.held_speed.seconds_per_token) == \
        pytest.approx((0.002, 0.0))
    c.submit("long2", list(range(2000, 2156)), max_tokens=1)
    assert _scheduled(c.plan("d0")) == [("long2", 16)]
    c.now += 0.080
    c.run_step("d0")
    assert d0.held_speed.by_threads == pytest.approx({0: 0.005})
    assert d0.prefill_speed.seconds_per_token == pytest.approx(0.2 * 0.005 + 0.8 * 0.002)
    c.run()
    c.assert_all_free()


def test_a_decode_step_target_of_zero_keeps_the_long_prompt_chunk_fixed():
    c = Cluster({"p0": 128, "d0": 256}, prefill_bypass_threshold=4, decode_prefill_tokens=64,
                decode_long_prefill_tokens=16, decode_step_target_ms=0)
    c.submit("long1", list(range(1000, 1200)), max_tokens=1)
    c.plan("p0")
    c.submit("long2", list(range(2000, 2200)), max_tokens=1)
    for _ in range(3):
        assert _scheduled(c.plan("d0")) == [("long2", 16)]
        c.now += 0.001
        c.run_step("d0")
    c.run()
    c.assert_all_free()


@pytest.mark.parametrize("decode_ms_per_token, margin, taken", [
    (3.0, 1, False), (1.5, 1, True), (1.5, 2, False), (0.9, 2, True)])
def test_a_decode_worker_takes_a_long_prompt_only_if_done_much_sooner_there(
        decode_ms_per_token, margin, taken):
    """p0 computes a token in 1 ms and has long1's 20 tokens to go (8 in its running step);
    long2 (20 tokens) would be done there in 40 ms. The decode worker, at 3 ms a token, would
    take 60 ms: it leaves long2 to p0. At 1.5 ms (30 ms) it takes it, unless it must be done
    in half p0's time (margin 2: 60 > 40); at 0.9 ms (18 ms, 36 with the margin) it does."""
    c = Cluster({"p0": 32, "d0": 32}, prefill_bypass_threshold=4, decode_prefill_tokens=8,
                max_num_batched_tokens=8, max_num_partial_prefills=1, decode_hold_margin=margin)
    c.sched.workers["p0"].prefill_speed.seconds_per_token = 0.001
    c.sched.workers["d0"].prefill_speed.seconds_per_token = decode_ms_per_token / 1000
    c.submit("long1", list(range(100, 120)), max_tokens=1)
    assert _scheduled(c.plan("p0")) == [("long1", 8)]
    c.submit("long2", list(range(200, 220)), max_tokens=1)
    assert _scheduled(c.plan("d0")) == ([("long2", 8)] if taken else [])
    assert c.sched.num_long_prefills_on_decode == taken
    c.run()
    assert c.workers["d0"].prompt_tokens == (20 if taken else 0)
    assert c.workers["p0"].prompt_tokens == (20 if taken else 40)
    c.assert_all_free()


def test_a_long_prompt_behind_a_busy_prefill_worker_is_chunked_on_the_decode_worker():
    """Every prefill worker busy: the decode worker takes the second long prompt in chunks of
    its step share, one long prompt at a time; without --saturated-prefill-bypass it waits."""
    for bypass in (True, False):
        c = Cluster({"p0": 32, "d0": 32}, prefill_bypass_threshold=4, decode_prefill_tokens=8,
                    saturated_prefill_bypass=bypass)
        c.submit("long1", list(range(100, 120)), max_tokens=1)
        c.plan("p0")
        c.submit("long2", list(range(200, 220)), max_tokens=1)
        c.submit("long3", list(range(300, 320)), max_tokens=1)
        if not bypass:
            assert _scheduled(c.plan("d0")) == []  # it only expects long1's KV
            continue
        assert _scheduled(c.plan("d0")) == [("long2", 8)]
        c.run_step("d0")
        assert _scheduled(c.plan("d0")) == [("long2", 8)]  # long3 is not started beside it
        c.run()
        assert c.workers["d0"].prompt_tokens == 20 and c.workers["p0"].prompt_tokens == 40
        c.assert_all_free()


def test_a_decode_hold_margin_below_one_is_refused():
    from services.scheduler.config import SchedulerConfig
    with pytest.raises(ValueError, match="--decode-hold-margin must be >= 1"):
        SchedulerConfig(decode_hold_margin=0.5)
    assert SchedulerConfig().decode_hold_margin == 1.0  # the default: whenever done sooner


def test_a_negative_tpot_slo_is_refused():
    from services.scheduler.config import SchedulerConfig
    with pytest.raises(ValueError, match="--tpot-slo-ms must be >= 0"):
        SchedulerConfig(tpot_slo_ms=-1)
    assert SchedulerConfig().tpot_slo_ms == 30.0  # 0 prices every second held


def _long_prompt_on_the_decode_worker(workers=None, **config):
    """p0 prefills long1 (20 tokens, 8 a step); d0 takes long2 (96 tokens) beside it and plans
    two chunks of 8 while p0 plans long1's second; the clock then says d0 took 48 ms for those
    16 tokens (3 ms a token). p0 runs at 1 ms a token."""
    c = Cluster(workers or {"p0": 64, "d0": 64}, prefill_bypass_threshold=4,
                decode_prefill_tokens=8, max_num_batched_tokens=8, max_num_partial_prefills=1,
                **{"prefill_take_back": True, **config})
    c.sched.workers["p0"].prefill_speed.seconds_per_token = 0.001
    c.submit("long1", list(range(100, 120)), max_tokens=2)
    assert _scheduled(c.plan("p0")) == [("long1", 8)]
    c.submit("long2", list(range(200, 296)), max_tokens=2)
    assert _scheduled(c.plan("d0")) == [("long2", 8)]
    c.run_step("d0")
    assert _scheduled(c.plan("d0")) == [("long2", 8)]
    c.now = 0.048
    c.run_step("p0")
    assert _scheduled(c.plan("p0")) == [("long1", 8)]
    c.run_step("p0")
    return c


def test_a_prefill_worker_with_nothing_left_takes_over_a_long_prompt_from_the_kv_sent_to_it():
    """When p0 plans long1's last chunk, d0 at 3 ms a token would finish long2's other 80
    tokens in 240 ms, p0 from the 16 d0 computed in 80: d0 first sends those 4 blocks into
    p0's prefix cache (a fill: blocks reserved under the fill's id, the recv registered in
    p0's step, the send ordered in d0's next plan, which also goes on with long2). Once they
    are there, p0 takes long2 over (80 + 7 ms: d0 computed 7 more meanwhile, 216 ms from there
    at its pace): long2 starts on p0 at token 16 on the filled blocks, p0 computes its other
    80 tokens, and its KV goes to d0 without the 5 blocks d0 computed (its prefix cache holds
    them). The tokens are the ones d0 would have sampled; every block is free after."""
    c = _long_prompt_on_the_decode_worker()
    p0 = c.sched.workers["p0"]
    queried = p0.kv.num_queried_tokens
    fill = c.plan("p0")
    assert _scheduled(fill) == [("long1", 4)]
    assert [(r.request_id, r.block_ids) for r in fill.recvs] == [("long2/fill6", (5, 6, 7, 8))]
    assert p0.kv.get_block_ids("long2/fill6") == [5, 6, 7, 8]
    assert p0.kv.num_queried_tokens == queried  # a fill is no prefix-cache lookup
    assert c.sched.num_long_prefills_taken_back == 0
    c.run_step("p0")  # p0 expects the fill now
    c.run_step("d0")
    send = c.plan("d0")
    assert _scheduled(send) == [("long1", 1), ("long2", 7)]  # long1 joins, long2 goes on
    assert [(k.transfer_id, k.request_id, k.src_block_ids, k.dst_block_ids)
            for k in send.sends] == [("long2/fill6", "long2", (5, 6, 7, 8), (5, 6, 7, 8))]
    c.now = 0.072
    c.run_step("d0")  # the fill lands: p0 caches its 4 blocks
    assert p0.kv.find_prefix(c.sched.requests["long2"].hashes(4), 96) == [5, 6, 7, 8]
    assert not p0.kv.holds("long2/fill6")
    take = c.plan("p0")
    assert c.sched.num_long_prefills_taken_back == 1
    assert take.finished_request_ids == ["long1", "long2/fill6"]
    assert [(n.request_id, n.block_ids[:5], len(n.block_ids), n.num_computed_tokens)
            for n in take.new_requests] == [("long2", (5, 6, 7, 8, 9), 24, 16)]
    assert _scheduled(take) == [("long2", 8)]
    c.run()
    assert c.tokens("long2") == [token_at(96), token_at(97)]
    assert c.workers["p0"].prompt_tokens == 20 + 80
    assert c.workers["d0"].prompt_tokens == 23
    assert c.workers["d0"].sent == 4  # the fill
    assert c.workers["d0"].received == 5 + 24 - 5  # long1, and long2 but what d0 computed
    c.assert_all_free()


@pytest.mark.parametrize("pace_ms, margin, enabled, takes", [
    (1.5, 1, True, True), (0.9, 1, True, False), (0.9, 2, True, True), (1.5, 1, False, False)])
def test_a_prefill_worker_takes_over_only_what_it_would_finish_sooner(pace_ms, margin, enabled,
                                                                      takes):
    """long2's other 80 tokens: 80 ms on p0 from the 16 d0 would send, 80 x pace_ms on d0,
    which keeps it while done in 1/--decode-hold-margin of p0's time. Without
    --prefill-take-back (the default) d0 keeps what it took."""
    c = _long_prompt_on_the_decode_worker(decode_hold_margin=margin, prefill_take_back=enabled)
    c.now = 0.016 * pace_ms
    plan = c.plan("p0")
    assert _scheduled(plan) == [("long1", 4)]
    assert bool(plan.recvs) == takes
    assert c.sched.workers["p0"].kv.get_block_ids("long2/fill6") == ([5, 6, 7, 8] if takes else [])
    c.run()
    assert c.tokens("long2") == [token_at(96), token_at(97)]
    c.assert_all_free()


def test_after_a_failed_fill_the_prefill_worker_starts_over_and_counts_the_work_thrown_away():
    """The fill's send fails: p0's reserved blocks go back uncached. Then p0 would take long2
    from its start, and once more the 23 tokens d0 computed: 119 ms against d0's 73 tokens at
    3 ms a token (219 ms); it takes long2 back, computes all 96 tokens, and d0 receives all
    but the 5 blocks it computed."""
    c = _long_prompt_on_the_decode_worker()
    p0 = c.sched.workers["p0"]
    assert [r.block_ids for r in c.plan("p0").recvs] == [(5, 6, 7, 8)]
    c.run_step("p0")
    c.run_step("d0")
    assert c.plan("d0").sends
    c.now = 0.069
    c.run_step("d0", send_error="refused")
    assert not p0.kv.holds("long2/fill6") and not p0.kv.find_prefix(
        c.sched.requests["long2"].hashes(4), 96)
    take = c.plan("p0")
    assert [(n.request_id, n.num_computed_tokens) for n in take.new_requests] == [("long2", 0)]
    assert not take.recvs and c.sched.num_long_prefills_taken_back == 1
    c.run()
    assert c.tokens("long2") == [token_at(96), token_at(97)]
    assert c.workers["p0"].prompt_tokens == 20 + 96
    assert c.workers["d0"].received == 5 + 24 - 5
    c.assert_all_free()


def test_without_prefix_caching_the_prefill_worker_takes_a_prompt_over_from_its_start():
    """No prefix cache to fill: p0 would compute long2 from its start, and once more the 16
    tokens d0 computed (112 ms), against d0's 80 tokens at 3 ms (240 ms): it takes long2 back in
    the same plan, at token 0."""
    c = _long_prompt_on_the_decode_worker(enable_prefix_caching=False)
    plan = c.plan("p0")
    assert not plan.recvs and c.sched.num_long_prefills_taken_back == 1
    assert _scheduled(plan) == [("long1", 4), ("long2", 4)]
    assert [(n.request_id, n.num_computed_tokens) for n in plan.new_requests] == [("long2", 0)]
    c.run()
    assert c.tokens("long2") == [token_at(96), token_at(97)]
    c.assert_all_free()


def test_an_idle_prefill_worker_takes_over_once_the_decode_workers_pace_falls():
    """p0 has finished long1 and nothing waits: it has no work while d0, at 0.5 ms a token,
    would finish long2's last 77 tokens (39 ms) sooner than p0 the 80 after the 5 blocks d0
    would send (80 ms). Once d0's pace falls to 2 ms a token (154 ms) p0 has work again: a
    step that only expects the fill."""
    c = Cluster({"p0": 64, "d0": 64}, prefill_bypass_threshold=4, decode_prefill_tokens=8,
                max_num_batched_tokens=8, max_num_partial_prefills=1, prefill_take_back=True)
    p0 = c.sched.workers["p0"]
    p0.prefill_speed.seconds_per_token = 0.001
    c.submit("long1", list(range(100, 108)), max_tokens=2)
    assert _scheduled(c.plan("p0")) == [("long1", 8)]
    c.submit("long2", list(range(200, 300)), max_tokens=2)
    assert _scheduled(c.plan("d0")) == [("long2", 8)]
    for _ in range(3):  # long1 sent to d0; long2 goes on there, 8 tokens a step
        c.step()
    assert c.sched.requests["long2"].num_computed_tokens == 23
    c.now = 0.0115
    assert not c.sched.has_work("p0") and not c.sent["p0"]
    c.now = 0.046
    assert c.sched.has_work("p0")
    fill = c.plan("p0")
    assert not fill.scheduled and [r.block_ids for r in fill.recvs] == [(2, 3, 4, 5, 6)]
    c.run()
    assert c.sched.num_long_prefills_taken_back == 1
    assert c.tokens("long2") == [token_at(100), token_at(101)]
    c.assert_all_free()


@pytest.mark.parametrize("lost", ["sender", "receiver"])
def test_a_fill_ends_with_either_worker_lost_and_the_prompt_completes(lost):
    """The sender (d0) lost before it sends: the fill's blocks on p0 go back uncached, and long2
    starts again on p0 for d1. The receiver (p0) lost while d0's send is under way: d0's blocks
    stay held until it reports the send done, and long2 goes on on d0."""
    c = _long_prompt_on_the_decode_worker({"p0": 64, "d0": 64, "d1": 64})
    assert c.plan("p0").recvs
    c.run_step("p0")
    if lost == "sender":
        c.lose("d0")
        assert not c.sched.workers["p0"].kv.holds("long2/fill6")
    else:
        c.run_step("d0")
        c.hold_sends = True
        c.plan("d0")
        c.run_step("d0")
        assert c.held_sends
        c.lose("p0")
        d0 = c.sched.workers["d0"]
        assert d0.kv.pool.ref_cnt[5] == 2  # long2's, and the fill's until the send is done
        c.hold_sends = False
        for wid, plan in c.held_sends:
            c.deliver(wid, plan)
        c.held_sends.clear()
        assert d0.kv.pool.ref_cnt[5] == 1
    c.run()
    assert c.tokens("long2") == [token_at(96), token_at(97)]
    assert c.tokens("long1") == [token_at(20), token_at(21)]
    c.assert_all_free()


def test_a_fill_outlives_its_request_aborted_meanwhile():
    """long2 aborted while its fill is under way: the fill still lands in p0's prefix cache
    (blocks free and cached), and every block is free after."""
    c = _long_prompt_on_the_decode_worker()
    hashes = c.sched.requests["long2"].hashes(4)
    assert c.plan("p0").recvs
    c.run_step("p0")
    c.sched.abort("long2")
    c.run()
    assert c.workers["d0"].sent == 4
    assert c.sched.workers["p0"].kv.find_prefix(hashes, 96) == [5, 6, 7, 8]
    c.assert_all_free()


def _decoding_on_d0(cpu_cores=(0, 1), **config):
    """p0 and d0 share cores 0 and 1; `a` (4 tokens) prefills on p0 and decodes on d0."""
    return _a_decodes(Cluster({"p0": 32, "d0": 32}, cpu_cores=cpu_cores,
                              prefill_bypass_threshold=4, decode_prefill_tokens=8,
                              decode_long_prefill_tokens=3, **config))


def _a_decodes(c):
    """`a` (4 tokens) prefilled on p0, decoding on d0, p0 left with nothing to do and d0 with
    no step planned ahead."""
    c.submit("a", list(range(100, 104)), max_tokens=12)
    while c.sched.requests["a"].status is not Status.DECODING or c.sched.has_work("p0"):
        c.step()
    while c.sent["d0"]:  # the step planned ahead
        c.run_step("d0")
    return c


def test_a_decode_worker_sharing_cores_takes_a_long_prompt_beside_its_batch():
    """With a batch to step and cores shared with p0, d0 takes long2 although p0 is free: on
    both cores while p0 has nothing to compute, in held chunks beside `a`; long3, arriving
    while d0 holds long2, goes to p0, and the cores split one each."""
    c = _decoding_on_d0()
    c.submit("long2", list(range(200, 212)), max_tokens=1)
    assert c.plan("p0") is None  # nothing for p0: long2 is left to d0
    take = c.plan("d0")
    assert (take.num_threads, _scheduled(take)) == (2, [("a", 1), ("long2", 3)])
    assert [(n.request_id, n.block_ids) for n in take.new_requests] == [("long2", (2, 3, 4))]
    assert c.sched.num_long_prefills_on_decode == 1
    c.run_step("d0")
    c.submit("long3", list(range(300, 312)), max_tokens=1)
    start = c.plan("p0")
    assert (start.num_threads, _scheduled(start)) == (1, [("long3", 12)])
    step = c.plan("d0")
    assert (step.num_threads, _scheduled(step)) == (1, [("a", 1), ("long2", 3)])
    c.run()
    assert c.workers["d0"].prompt_tokens == 12 and c.workers["p0"].prompt_tokens == 4 + 12
    c.assert_all_free()


def _a_decodes_while_p0_chunks_long1(shorts=0, **config):
    """p0 started long1 (40 tokens, in chunks of at most 8) beside `a` (4 tokens) before d0
    had a batch; `a` now decodes on d0 and long1 is partial on p0. `shorts` 4-token prompts
    (one token each) came and went before `a`."""
    c = Cluster({"p0": 64, "d0": 32}, prefill_bypass_threshold=4, decode_prefill_tokens=8,
                max_num_batched_tokens=8, max_num_partial_prefills=1, **config)
    _shorts_come_and_go(c, shorts, 4, 1)
    c.submit("a", list(range(100, 104)), max_tokens=12)
    c.submit("long1", list(range(400, 440)), max_tokens=1)
    assert _scheduled(c.plan("p0")) == [("a", 4), ("long1", 4)]
    while c.sched.requests["a"].status is not Status.DECODING:
        c.step()
    assert c.sched.requests["long1"].status is Status.PREFILLING
    return c


def test_a_busy_prefill_worker_lends_no_cores_so_the_saturated_bypass_decides():
    """p0 chunks long1 (it started it beside `a` before d0 had a batch); d0, decoding `a`, would
    compute long2 at 10 ms a token (120 ms) where p0, at 1 ms, gets through the rest of long1
    and long2 in less: d0 leaves long2 to p0."""
    c = _a_decodes_while_p0_chunks_long1(cpu_cores=(0, 1))
    c.sched.workers["p0"].prefill_speed.seconds_per_token = 0.001
    c.sched.workers["d0"].prefill_speed.seconds_per_token = 0.01
    c.submit("long2", list(range(200, 212)), max_tokens=1)
    c.run()
    assert c.workers["d0"].prompt_tokens == 0 and c.workers["p0"].prompt_tokens == 4 + 40 + 12
    assert c.sched.num_long_prefills_on_decode == 0
    c.assert_all_free()


@pytest.mark.parametrize("case", ["off", "no batch", "cores not shared", "holds one"])
def test_a_decode_worker_leaves_a_long_prompt_to_a_free_prefill_worker(case):
    """Without --shared-cores-prefill-bypass, with no batch to step beside it, on cores of its
    own, or holding a long prompt already, d0 leaves a long prompt to the free p0."""
    if case == "no batch":
        c = Cluster({"p0": 32, "d0": 32}, cpu_cores=(0, 1), prefill_bypass_threshold=4)
    elif case == "cores not shared":
        c = _decoding_on_d0(cpu_cores=())
    else:
        c = _decoding_on_d0(shared_cores_prefill_bypass=case != "off")
    if case == "holds one":
        c.submit("long1", list(range(400, 412)), max_tokens=1)
        assert ("long1", 3) in _scheduled(c.plan("d0"))
        c.run_step("d0")
    c.submit("long2", list(range(200, 212)), max_tokens=1)
    assert ("long2", 12) in _scheduled(c.plan("p0"))
    c.run()
    assert c.workers["p0"].prompt_tokens == (12 if case == "no batch" else 16)
    c.assert_all_free()


def test_a_prompt_the_prefill_worker_caches_more_of_stays_there():
    """p0 caches long0's 3 blocks; d0 cached them too but evicted them for `filler`. With `a`
    decoding on d0 and p0 free, `again` (long0 and 8 more tokens) is 8 tokens to compute on p0
    and all 20 on d0: p0 takes it."""
    c = Cluster({"p0": 64, "d0": 16}, cpu_cores=(0, 1), prefill_bypass_threshold=4,
                decode_prefill_tokens=8)
    long0 = list(range(500, 512))
    c.submit("long0", long0, max_tokens=1)
    c.run()
    c.submit("filler", list(range(600, 656)), max_tokens=1)
    c.run()
    _a_decodes(c)
    c.submit("again", long0 + list(range(700, 708)), max_tokens=1)
    p0, d0 = c.sched.workers["p0"], c.sched.workers["d0"]
    hashes = c.sched.requests["again"].hashes(4)
    assert (p0.kv.num_hit_blocks(hashes, 20), d0.kv.num_hit_blocks(hashes, 20)) == (3, 0)
    assert _scheduled(c.plan("p0")) == [("again", 8)]
    c.run()
    assert c.workers["d0"].prompt_tokens == 0
    c.assert_all_free()


def _shorts_come_and_go(c, count, tokens, max_tokens):
    """`count` short prompts of `tokens` tokens, each generating max_tokens, come and finish."""
    for i in range(count):
        c.submit(f"short{i}", list(range(1000 + 10 * i, 1000 + 10 * i + tokens)),
                 max_tokens=max_tokens)
    c.run(1000)


def _priced(share_ms, step_ms, earlier_long=0, shorts=(0, 0, 0), tpot_slo_ms=0.0, **config):
    """p0 and d0 share cores 0 and 1 (a held step: --decode-step-target-ms 1000; p0's chunks
    4 tokens, half its 8-token steps). p0 computes a prompt token in 100 ms on both cores and
    in `share_ms` on the one d0's batch leaves it; d0 computes one beside its batch in 100 ms
    on both, and steps `a` alone in `step_ms`. A long prompt of `earlier_long` tokens came 10
    s before; `shorts` (how many, their tokens, the tokens each generates) came and went
    before `a`. A hold is priced by every second the batch steps held, or with `tpot_slo_ms`
    by what takes its requests past that TPOT."""
    c = Cluster({"p0": 256, "d0": 256}, cpu_cores=(0, 1), prefill_bypass_threshold=4,
                max_num_batched_tokens=8, decode_prefill_tokens=8, decode_long_prefill_tokens=3,
                decode_step_target_ms=1000, tpot_slo_ms=tpot_slo_ms, **config)
    _shorts_come_and_go(c, *shorts)
    if earlier_long:
        c.submit("earlier", list(range(600, 600 + earlier_long)), max_tokens=1)
        c.run()
        c.now += 10.0
    _a_decodes(c)
    p0, d0 = c.sched.workers["p0"], c.sched.workers["d0"]
    p0.prefill_speed.by_threads = {2: 0.1, 1: share_ms / 1000}
    d0.prefill_speed.by_threads = {2: 0.1}
    d0.decode_step_seconds = step_ms / 1000
    return c


@pytest.mark.parametrize("share_ms, step_ms, earlier_long, held", [
    (400, 1000, 0, True), (150, 1000, 0, False), (150, 1000, 108, True),
    (300, 1000, 0, True), (300, 100, 0, False)])
def test_a_decode_worker_holds_a_lone_long_prompt_only_when_it_gains_more_than_its_batch_loses(
        share_ms, step_ms, earlier_long, held):
    """`a` has 8 tokens left; long2 (12 tokens) would take d0 1.2 s beside it, and `a`'s
    steps would be 1 s long meanwhile: `a` loses 1.2 s, and the short requests arriving
    meanwhile (one in the last 20 s, `a`) 0.05 * 1.2^2 / 2 = 0.036 s more: 1.236. On p0 long2
    would take 12 * 0.4 = 4.8 s on its share while `a` lives (8 s): it gains 3.6 s, and d0
    holds it. On a share of 150 ms a token (1.8 s) it gains 0.6 s, less than the batch loses
    at a load of 12 * 0.1 / 20 = 0.06 (1.236 * 0.94), and p0 takes it; unless the earlier
    long prompt (108 tokens) brings the load to (108 + 12) * 0.1 / 20 = 0.6: 1.236 * 0.4 =
    0.49 < 0.6. On a share of 300 ms a token long2 gains 3.6 - 1.2 s while `a` lives through
    its three chunks; with `a` stepping every 100 ms it lives 0.8 s, through long2's first
    chunk only (4 * 0.3 s), and the other two go on both cores but while a short request
    arriving would step (1 - e^(-0.05 * 1.2) = 6% of the time): 8 * 0.112 s, 2.09 s in all, a
    gain of 0.89 s, less than 1.236 * 0.94."""
    c = _priced(share_ms, step_ms, earlier_long)
    a = c.sched.requests["a"]
    assert a.max_tokens - len(a.output_token_ids) == 8
    c.submit("long2", list(range(200, 212)), max_tokens=1)
    assert c.sched.prefill.long_load() == pytest.approx((earlier_long + 12) * 0.1 / 20)
    if held:
        assert c.plan("p0") is None
        assert _scheduled(c.plan("d0")) == [("a", 1), ("long2", 3)]
    else:
        assert _scheduled(c.plan("p0")) == [("long2", 4)]  # its first chunk
    assert (c.sched.num_long_prefills_on_decode, c.sched.num_long_prefills_left) == \
        (int(held), int(not held))
    c.run()
    assert c.workers["d0"].prompt_tokens == (12 if held else 0)
    c.assert_all_free()


@pytest.mark.parametrize("slo_ms, spent, loss, held", [
    (200, 0.0, 0.000178, True), (150, 0.0, 0.241025, True), (100, 0.0, 0.8124, False),
    (200, 1.5, 1.080178, False)])
def test_with_a_tpot_slo_a_hold_costs_only_what_takes_requests_past_it(slo_ms, spent, loss,
                                                                       held):
    """`a` (4 tokens out, 8 left) steps every 100 ms; held beside long2 for d0's 1.2 s it would
    step every second, losing 0.9 of each: 1.08 s. On p0 long2 would take 0.6 + 0.6 s on its
    share of 150 ms a token while `a` lives (0.8 s), then 4 tokens at 0.1 s but while a short
    request arriving would step (1 - e^(-0.05 * 12 * 0.1) = 5.8% of the time, at 0.15):
    1.612 s, a gain of 0.412 s. `a` has 11 tokens after its first; with none of its time spent
    it ends 0.8 s after it on its own. At a TPOT SLO of 200 ms its budget is 2.2 s: the hold
    keeps it within (0.8 + 1.08), and it costs only what the short requests arriving meanwhile
    (0.05 a second, 12 tokens each: a budget of 2.2 s, 1.2 of it stepping, 1 s of slack) lose
    past theirs: one arriving at 0 is held 1.2 s, losing 1.08 > 1, and 0.05 * 0.0036 s in
    all; d0 holds long2. At 150 ms the budget is 1.65 s: `a` ends 0.23 s past it, and those
    arriving 0.05 * 0.2205 s more: 0.241 * 0.94 < 0.412, and d0 holds it. At 100 ms (1.1 s)
    `a` ends 0.78 s past it, and those arriving, with no slack, 0.05 * 0.9 * 1.2^2 / 2 more:
    0.812 * 0.94 > 0.412, and p0 takes it. At 200 ms after 1.5 s of `a`'s budget went (it is
    0.1 s past it already), all 1.08 s count: p0 takes it. Priced by every second held, p0
    would take it at each (1.236 * 0.94)."""
    c = _priced(150, 100, tpot_slo_ms=slo_ms)
    c.now += spent
    c.submit("long2", list(range(200, 212)), max_tokens=1)
    assert _scheduled(c.plan("d0")) == ([("a", 1), ("long2", 3)] if held else [("a", 1)])
    assert c.sched.requests["long2"].hold_terms == pytest.approx(
        (loss, 1.2, 0.411647, 0.06), abs=1e-6)
    assert c.sched.num_long_prefills_on_decode == int(held)
    c.run()
    assert c.workers["d0"].prompt_tokens == (12 if held else 0)
    c.assert_all_free()


def test_short_prompts_arriving_keep_a_batch_stepping_so_a_lone_long_prompt_is_held():
    """The case above where `a` lives through long2's first chunk only (300 ms a token on p0's
    share, `a` stepping every 100 ms), after five short prompts that each generated 100
    tokens: 6 short prompts in the window (`a` too), 0.3 a second, 24 tokens, 1.2 a second,
    generating 85.3 tokens on average. d0 would take 1.2 s for long2 (the short prompts would
    go to p0, free). On p0, after `a`'s 0.8 s, a batch keeps stepping a fraction
    1 - e^(-0.3 * 8.53) = 0.922 of the time, so the other two chunks take
    8 * (0.922 * 0.3 + 0.078 * 0.1) = 2.276 s: 3.476 s in all, a gain of 2.276 s. `a` loses
    1.2 s and the short requests arriving meanwhile 0.3 * 1.2^2 / 2 = 0.216: (1.2 + 0.216) *
    0.94 < 2.276, and d0 holds long2 (without the short prompts p0 would have taken it on 2 s,
    a gain of 0.8)."""
    c = _priced(300, 100, shorts=(5, 4, 100))
    c.submit("long2", list(range(200, 212)), max_tokens=1)
    assert c.sched.prefill.short_load() == pytest.approx(ShortLoad(0.3, 1.2, 512 / 6))
    assert c.plan("p0") is None
    assert _scheduled(c.plan("d0")) == [("a", 1), ("long2", 3)]
    assert c.sched.requests["long2"].hold_terms == pytest.approx(
        (1.2 + 0.3 * 1.2 ** 2 / 2, 1.2, 8 * (0.3 - 0.2 * math.exp(-0.3 * 512 / 60)), 0.06))
    c.run()
    assert c.workers["d0"].prompt_tokens == 12
    c.assert_all_free()


def test_short_requests_arriving_during_a_hold_count_in_what_it_costs():
    """`a` stepping every second (it lives through long2), on a share of 200 ms a token, after
    eight short prompts of one token that each generated 12: 9 in the window, 0.45 a second.
    d0 would take 1.2 s for long2, p0 2.4 s: a gain of 1.2 s. `a` alone loses 1.2 s, 1.128
    after the load of 0.06, less than that; but the short requests arriving meanwhile step
    beside long2 too: 0.45 * 1.2^2 / 2 = 0.324 s more, 1.433 in all after the load, and p0
    takes long2."""
    c = _priced(200, 1000, shorts=(8, 1, 12))
    c.submit("long2", list(range(200, 212)), max_tokens=1)
    assert _scheduled(c.plan("p0")) == [("long2", 4)]
    loss, here, gain, rho = c.sched.requests["long2"].hold_terms
    assert (loss, here, gain, rho) == pytest.approx((1.2 + 0.45 * 1.2 ** 2 / 2, 1.2, 1.2, 0.06))
    assert here * (1 - rho) < gain < loss * (1 - rho)
    assert c.sched.num_long_prefills_left == 1
    c.run()
    assert c.workers["d0"].prompt_tokens == 0
    c.assert_all_free()


def test_a_long_prompt_declined_then_held_as_the_load_rises_is_not_counted_as_left():
    """d0 prices long2 first (the share of 150 ms a token: a gain of 0.6 s against 1.236 * 0.94)
    and leaves it; before p0 starts it, a 108-token prompt arrives, the load rises to 0.6, and
    d0's next step holds long2 (1.236 * 0.4 < 0.6): it is not counted as left, and its
    placement no longer says declined."""
    c = _priced(150, 1000)
    c.submit("long2", list(range(200, 212)), max_tokens=1)
    assert _scheduled(c.plan("d0")) == [("a", 1)]
    assert c.sched.requests["long2"].hold_declined
    c.run_step("d0")
    c.submit("burst", list(range(700, 808)), max_tokens=1)
    assert _scheduled(c.plan("d0")) == [("a", 1), ("long2", 3)]
    assert not c.sched.requests["long2"].hold_declined
    c.run()
    assert (c.sched.num_long_prefills_on_decode, c.sched.num_long_prefills_left) == (1, 0)
    c.assert_all_free()


def test_without_pricing_a_decode_worker_holds_whatever_its_batch_loses():
    """The case above where p0 takes long2 (a gain of 0.6 s against 1.2), with
    --no-price-holds: d0 holds it, as the shared-cores bypass alone says."""
    c = _priced(150, 1000, price_holds=False)
    c.submit("long2", list(range(200, 212)), max_tokens=1)
    assert c.plan("p0") is None
    assert _scheduled(c.plan("d0")) == [("a", 1), ("long2", 3)]
    assert (c.sched.num_long_prefills_on_decode, c.sched.num_long_prefills_left) == (1, 0)
    c.run()
    c.assert_all_free()


def test_a_long_prompt_older_than_the_load_window_no_longer_counts():
    """The case above at a load of 0.6, 21 s later: the earlier prompt has left the window and
    p0 takes long2."""
    c = _priced(150, 1000, 108)
    c.now += 21.0
    c.submit("long2", list(range(200, 212)), max_tokens=1)
    assert c.sched.prefill.long_load() == pytest.approx(12 * 0.1 / 20)
    assert _scheduled(c.plan("p0")) == [("long2", 4)]
    assert c.sched.num_long_prefills_left == 1
    c.run()
    c.assert_all_free()


@pytest.mark.parametrize("shorts, held", [(0, True), (5, False)])
def test_short_prompts_arriving_slow_a_held_prompt_so_the_saturated_bypass_may_leave_it(
        shorts, held):
    """Unpriced: p0 would be done with long1 and long2 in 4 s; d0, at 250 ms a prompt token
    beside its batch, would take 12 / (4 - 0.2) = 3.16 s for long2 with only `a` (4 tokens)
    in the window, and holds it. After five more short prompts of 4 tokens, 1.2 tokens a
    second go first in d0's steps: 12 / 2.8 = 4.29 s, no sooner than p0, which takes it."""
    c = _a_decodes_while_p0_chunks_long1(shorts=shorts, decode_step_target_ms=1000,
                                         price_holds=False)
    c.sched.workers["p0"].prefill_speed.seconds_per_token = 0.1
    c.sched.workers["d0"].prefill_speed.seconds_per_token = 0.25
    before = c.workers["d0"].prompt_tokens
    c.submit("long2", list(range(200, 212)), max_tokens=1)
    assert c.sched.prefill.short_load().tokens_per_s == pytest.approx((shorts + 1) * 4 / 20)
    assert _scheduled(c.plan("d0")) == ([("a", 1), ("long2", 7)] if held else [("a", 1)])
    c.run()
    assert c.workers["d0"].prompt_tokens - before == (12 if held else 0)
    c.assert_all_free()


@pytest.mark.parametrize("p0_seconds_per_token, held", [(1.0, "long3"), (0.1, None)])
def test_at_overload_a_decode_worker_sooner_with_no_long_prompt_takes_the_newest(
        p0_seconds_per_token, held):
    """p0 chunks long1 (28 tokens to go); long2 and long3 (12 tokens each) wait. d0, at 3 s a
    prompt token beside `a` and 0.2 tokens a second of short prompts, would take 12 / (1/3 -
    0.2) = 90 s for either: later than p0 for both. At 1 s a token on p0 (40 and 52 s) the
    load is (40 + 24) * 1 / 20 = 3.2: d0 takes the newest, long3, and long2 keeps its turn on
    p0; d0 is done with long3 before p0 with long1, and long2, the newest then, goes to d0
    too. At 0.1 s a token (4 and 5.2 s; load 0.32) it takes neither."""
    c = _a_decodes_while_p0_chunks_long1(decode_step_target_ms=1000)
    c.sched.workers["p0"].prefill_speed.seconds_per_token = p0_seconds_per_token
    c.sched.workers["d0"].prefill_speed.seconds_per_token = 3.0
    c.submit("long2", list(range(200, 212)), max_tokens=1)
    c.submit("long3", list(range(300, 312)), max_tokens=1)
    assert c.sched.prefill.long_load() == pytest.approx(64 * p0_seconds_per_token / 20)
    assert _scheduled(c.plan("d0")) == [("a", 1)] + ([(held, 7)] if held else [])
    c.run()
    assert c.workers["d0"].prompt_tokens == (24 if held else 0)
    assert c.workers["p0"].prompt_tokens == 4 + 40 + (0 if held else 24)
    c.assert_all_free()


def test_the_pace_beside_the_last_held_prompt_prices_the_next_hold():
    """The 300 ms case below, with d0's steps with prompt tokens at 50 ms a token but those
    beside the long prompt it held last at 300: the hold is priced at the latter, 3.83 s for
    long2 against the 4 s p0 would take, and the 4.2 s the batch would lose: p0 takes it."""
    c = _a_decodes_while_p0_chunks_long1(decode_step_target_ms=1000, tpot_slo_ms=0)
    c.sched.workers["p0"].prefill_speed.seconds_per_token = 0.1
    d0 = c.sched.workers["d0"]
    d0.prefill_speed.seconds_per_token, d0.held_speed.seconds_per_token = 0.05, 0.3
    c.submit("long2", list(range(200, 212)), max_tokens=1)
    assert _scheduled(c.plan("d0")) == [("a", 1)]
    assert c.sched.requests["long2"].hold_terms[1] == pytest.approx(12 / (1 / 0.3 - 0.2))
    c.run()
    assert c.sched.num_long_prefills_left == 1
    assert c.workers["d0"].prompt_tokens == 0
    c.assert_all_free()


@pytest.mark.parametrize("decode_ms_per_token, held", [(50, True), (300, False)])
def test_the_saturated_bypass_holds_a_long_prompt_only_when_it_gains_more_than_the_batch_loses(
        decode_ms_per_token, held):
    """p0 chunks long1 (40 tokens) at 100 ms a token with 28 to go; long2 (12 tokens) would be
    done there in 4 s. d0, decoding `a` (10 tokens left) in held steps of 1 s, would be done
    with long2 in 12 / (20 - 0.2) = 0.61 s at 50 ms a token (`a`'s prompt tokens go first): a
    gain of 3.39 s against the batch's 0.62 (load (40 + 12) * 0.1 / 20 = 0.26), and it holds
    it. At 300 ms a token it would still be done sooner (12 / (3.33 - 0.2) = 3.83 s), but
    gain 0.17 s against the 4.2 the batch loses (`a`'s 10 steps of 1 s capped at the hold's
    length, and the short requests arriving meanwhile; 4.2 * 0.74 > 0.17): p0 takes long2
    after long1."""
    c = _a_decodes_while_p0_chunks_long1(decode_step_target_ms=1000, tpot_slo_ms=0)
    a = c.sched.requests["a"]
    assert (a.max_tokens - len(a.output_token_ids), c.sched.requests["long1"].num_computed_tokens,
            c.sched.workers["p0"].is_idle) == (10, 12, True)
    c.sched.workers["p0"].prefill_speed.seconds_per_token = 0.1
    c.sched.workers["d0"].prefill_speed.seconds_per_token = decode_ms_per_token / 1000
    c.submit("long2", list(range(200, 212)), max_tokens=1)
    assert _scheduled(c.plan("d0")) == ([("a", 1), ("long2", 7)] if held else [("a", 1)])
    assert c.sched.num_long_prefills_on_decode == int(held)
    c.run()
    assert c.sched.num_long_prefills_left == int(not held)  # counted once p0 started it
    assert c.workers["d0"].prompt_tokens == (12 if held else 0)
    assert c.workers["p0"].prompt_tokens == 4 + 40 + (0 if held else 12)
    c.assert_all_free()
