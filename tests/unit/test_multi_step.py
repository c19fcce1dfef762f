"""Multi-step decode with real workers in this process: greedy tokens equal HuggingFace's, a
stop token inside a plan's steps ends the request there, an abort between a plan's steps stops
its stream at once, and every block comes back."""
import pytest

from tests.unit.test_scheduler_inprocess import _greedy, _prompt, cluster, hf  # noqa: F401


@pytest.mark.parametrize("roles", [[("prefill", 64), ("decode", 64)], [("decode", 64)]])
@pytest.mark.parametrize("async_scheduling", [True, False])
def test_multi_step_greedy_equals_hf(cluster, hf, roles, async_scheduling):
    c = cluster(roles, num_scheduler_steps=4, async_scheduling=async_scheduling)
    prompts = {"a": _prompt(7, 70), "b": _prompt(19, 71), "c": _prompt(3, 72)}
    for rid, p in prompts.items():
        c.submit(rid, p, max_tokens=13)
    c.run()
    for rid, p in prompts.items():
        assert c.tokens(rid) == _greedy(hf, p, 13), rid
        assert c.finish_reason(rid) == "length"
    c.assert_all_free()


def test_a_stop_token_inside_a_plans_steps_ends_the_request_there(cluster, hf):
    prompt = _prompt(11, 73)
    greedy = _greedy(hf, prompt, 16)
    c = cluster([("prefill", 64), ("decode", 64)], num_scheduler_steps=8)
    c.submit("stops", prompt, max_tokens=16, stop_token_ids=[greedy[5]])
    c.submit("runs", prompt, max_tokens=16)
    c.run()
    assert c.tokens("stops") == greedy[:greedy.index(greedy[5]) + 1]
    assert c.finish_reason("stops") == "stop"
    assert c.tokens("runs") == greedy
    c.assert_all_free()


def test_an_abort_between_a_plans_steps_stops_the_stream_at_once(cluster):
    c = cluster([("decode", 64)], num_scheduler_steps=6, async_scheduling=False)
    c.submit("a", _prompt(9, 74), max_tokens=30)
    c.submit("b", _prompt(9, 75), max_tokens=30)
    (wid, worker), = c.workers.items()
    c.step()  # both prefill
    plan = c.sched.schedule(wid)
    assert plan.num_steps == 6
    result = worker.execute(plan, 0)
    for out in c.sched.update(wid, result):
        c.outputs[out.request_id].append(out)
    assert c.sched.abort("a").finish_reason == "abort"
    sub_step = 1
    while result.more:
        result = worker.execute(plan, sub_step)
        for out in c.sched.update(wid, result):
            c.outputs[out.request_id].append(out)
        sub_step += 1
    assert sub_step == 6
    assert len(c.tokens("a")) == 2 and len(c.tokens("b")) == 7  # a: none after the abort
    c.run()
    assert len(c.tokens("b")) == 30
    c.assert_all_free()
