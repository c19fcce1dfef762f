"""Workers.can_serve, the scheduler's health "", is true exactly when a request runs to its end;
has_disaggregated_path ("pdserve.prefill") when a prefill worker has a decode worker to feed."""
import pytest

from tests.policy.harness import Cluster, token_at


@pytest.mark.parametrize(("workers", "mode", "serves", "path"), [
    ({"p0": 16}, "disaggregated", False, False),
    ({"d0": 16}, "disaggregated", True, False),   # it prefills its prompts itself
    ({"d0": 16}, "colocated", True, False),
    ({"p0": 16, "d0": 16}, "disaggregated", True, True),
])
def test_can_serve_exactly_when_a_request_finishes(workers, mode, serves, path):
    c = Cluster(workers, mode=mode)
    assert (c.sched.workers.can_serve, c.sched.workers.has_disaggregated_path) == (serves, path)
    c.submit("a", list(range(40)), max_tokens=3)
    c.run()
    assert c.tokens("a") == ([token_at(40 + i) for i in range(3)] if serves else [])


def test_a_pair_stops_serving_when_its_decode_worker_leaves():
    c = Cluster({"p0": 16, "d0": 16})
    c.lose("d0")
    assert not c.sched.workers.can_serve and not c.sched.workers.has_disaggregated_path
    c.submit("a", list(range(10)), max_tokens=3)
    c.run()
    assert c.tokens("a") == []  # it waits: the prefill worker alone finishes nothing
