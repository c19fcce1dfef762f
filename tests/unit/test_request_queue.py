import pytest

from common.sampling_params import SamplingParams
from services.scheduler.request import Request
from services.scheduler.request_queue import create_request_queue


def _req(rid, priority=0, t=0.0):
    return Request(rid, [1], SamplingParams(max_tokens=1), [], priority=priority,
                   arrival_time=t)


def test_fcfs_order_and_push_front():
    q = create_request_queue("fcfs")
    a, b, c = _req("a"), _req("b"), _req("c")
    for r in (a, b, c):
        q.push(r)
    assert q.remove(b) and not q.remove(b)
    q.push_front(b)
    assert [r.request_id for r in q] == ["b", "a", "c"]
    assert q.pop() is b and len(q) == 2


def test_priority_order_with_removal_and_requeue():
    q = create_request_queue("priority")
    a, b, c = _req("a", 1, 1.0), _req("b", 0, 2.0), _req("c", 1, 0.5)
    for r in (a, b, c):
        q.push(r)
    assert [r.request_id for r in q] == ["b", "c", "a"]
    assert q.remove(c) and len(q) == 2
    q.push_front(c)  # a preempted request goes ahead of its own priority class only once
    assert [r.request_id for r in q] == ["b", "c", "a"] and len(q) == 3
    assert q.remove(b)
    q.push(b)
    assert [q.pop().request_id for _ in range(3)] == ["b", "c", "a"]
    assert len(q) == 0 and list(q) == []


def test_unknown_policy_lists_the_known_ones():
    with pytest.raises(ValueError, match="fcfs, priority"):
        create_request_queue("lifo")


def test_priority_queue_compacts_removed_entries_and_keeps_order():
    q = create_request_queue("priority")
    reqs = [_req(f"r{i}", priority=i % 3, t=float(i)) for i in range(300)]
    for r in reqs:
        q.push(r)
    for r in reqs[::2]:
        assert q.remove(r)
    assert len(q._heap) <= 2 * len(q) + 64  # dead entries did not pile up
    kept = sorted(reqs[1::2], key=lambda r: (r.priority, r.arrival_time))
    assert list(q) == kept
    assert [q.pop() for _ in range(len(kept))] == kept
