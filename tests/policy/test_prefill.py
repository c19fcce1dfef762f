"""Chunked and partial prefills under the step budget: short prompts pass long ones, at most one
long prompt is partial at a time and none starts in the step another ends in, and the prefill
worker caching more of a prompt takes it."""
from tests.policy.harness import Cluster, scheduled


def test_two_long_prompts_take_turns_while_a_short_one_passes():
    # budget 16, 2 partials: a long prompt (> 8 tokens) gets at most 8 tokens a step
    c = Cluster({"d0": 64}, max_num_batched_tokens=16, max_num_partial_prefills=2)
    c.submit("long1", list(range(30)), max_tokens=1)
    c.submit("long2", list(range(100, 130)), max_tokens=1)
    c.submit("short", list(range(200, 205)), max_tokens=3)
    steps = []
    for _ in range(6):
        plan = c.plan("d0")
        steps.append(scheduled(plan))
        c.run_step("d0")
    assert steps == [
        [("long1", 8), ("short", 5)],  # long2 waits: one long partial at a time
        [("short", 1), ("long1", 8)],  # short decodes; the budget's other half stays unused
        [("short", 1), ("long1", 8)],
        # long1 ends (its last 6); long2 starts in the next step, not beside it, where its 8
        # tokens would hold back long1's first token
        [("long1", 6)],
        [("long2", 8)],
        [("long2", 8)],
    ]
    c.run()
    assert c.workers["d0"].prompt_tokens == 65
    c.assert_all_free()


def test_a_short_prompt_joins_the_step_a_long_one_ends_in_and_the_next_long_one_waits():
    c = Cluster({"d0": 64}, max_num_batched_tokens=16, max_num_partial_prefills=2)
    c.submit("long1", list(range(20)), max_tokens=1)
    assert scheduled(c.plan("d0")) == [("long1", 8)]
    c.run_step("d0")
    assert scheduled(c.plan("d0")) == [("long1", 8)]
    c.run_step("d0")
    c.submit("long2", list(range(100, 130)), max_tokens=1)
    c.submit("short", list(range(200, 205)), max_tokens=1)
    # long1's last 4 end its prefill: short, whole, joins them; long2, ahead of it, waits
    assert scheduled(c.plan("d0")) == [("long1", 4), ("short", 5)]
    c.run_step("d0")
    assert scheduled(c.plan("d0")) == [("long2", 8)]
    c.run()
    assert c.workers["d0"].prompt_tokens == 55
    c.assert_all_free()


def test_one_partial_prefill_at_a_time_when_asked():
    c = Cluster({"d0": 64}, max_num_batched_tokens=16, max_num_partial_prefills=1,
                max_long_partial_prefills=1)
    c.submit("long", list(range(30)), max_tokens=1)
    c.submit("short", list(range(200, 205)), max_tokens=1)
    assert scheduled(c.plan("d0")) == [("long", 16)]  # no budget left for short
    c.run_step("d0")
    # long's last chunk ends its partial prefill: short may start one with the 2 tokens left
    assert scheduled(c.plan("d0")) == [("long", 14), ("short", 2)]
    c.run_step("d0")
    assert scheduled(c.plan("d0")) == [("short", 3)]  # long ended with its one token
    c.run()
    c.assert_all_free()


def test_the_prefill_worker_caching_more_of_the_prompt_takes_it():
    c = Cluster({"p0": 32, "p1": 32, "d0": 32})
    c.submit("warm", list(range(12)), max_tokens=1)
    c.run()
    warm_on = next(wid for wid in ("p0", "p1") if c.workers[wid].prompt_tokens)
    cold = "p1" if warm_on == "p0" else "p0"
    c.submit("again", list(range(12)) + [70, 71], max_tokens=1)
    assert c.plan(cold) is None  # it leaves the prompt to the one holding 3 of its blocks
    [new] = c.plan(warm_on).new_requests
    assert new.num_computed_tokens == 12
    c.run()
    assert c.workers[warm_on].prompt_tokens == 12 + 2 and c.workers[cold].prompt_tokens == 0
    c.assert_all_free()
