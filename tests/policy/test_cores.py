"""Cores shared by the workers of one host: each plan's thread count follows who is busy."""
from common.kv_layout import KVLayout
from services.scheduler.cores import threads_for
from services.scheduler.kv_cache_manager import KVCacheManager
from services.scheduler.worker_state import WorkerState
from tests.policy.harness import Cluster, scheduled


def _worker(wid: str, cores: tuple[int, ...], host: str = "h") -> WorkerState:
    role = {"p": "prefill", "d": "decode"}[wid[0]]
    return WorkerState(wid, role, "m", KVLayout(1, 1, 8, 4, "float32"), 0, ("shm",),
                       KVCacheManager(4, 4, True), host_id=host, cpu_cores=cores)


def test_busy_workers_split_the_cores_they_share_decode_first():
    p, d = _worker("p0", (0, 1, 2)), _worker("d0", (0, 1, 2))
    both = [p, d]
    assert threads_for(p, both, lambda x: True) == 1
    assert threads_for(d, both, lambda x: True) == 2     # the odd core goes to decode
    assert threads_for(p, both, lambda x: False) == 3    # an idle peer lends all of them
    assert threads_for(d, both, lambda x: x is p) == 2
    d1 = _worker("d1", (0, 1, 2))
    assert [threads_for(w, [p, d, d1], lambda x: True) for w in (p, d, d1)] == [1, 1, 1]


def test_workers_that_share_no_cores_keep_their_threads():
    p, d = _worker("p0", (0,)), _worker("d0", (1,))
    assert threads_for(p, [p, d], lambda x: True) == 0           # pinned apart
    other_host = _worker("d1", (0, 1), host="other")
    assert threads_for(other_host, [other_host, _worker("p1", (0, 1))], lambda x: True) == 0
    gpu = _worker("d2", ())
    assert threads_for(gpu, [gpu, _worker("p2", (0, 1))], lambda x: True) == 0
    lone = _worker("d3", (0, 1))
    assert threads_for(lone, [lone], lambda x: True) == 0


def test_thread_counts_follow_the_load():
    """The plans computing tokens, in order, with the threads each got. The harness runs a
    step as soon as it is planned, so a peer counts as busy for what it has left to compute.
    Every prompt goes to p0 (no bypass of either kind)."""
    c = Cluster({"p0": 32, "d0": 32}, cpu_cores=(0, 1), prefill_bypass_threshold=0,
                shared_cores_prefill_bypass=False, max_num_batched_tokens=16)
    planned = []
    for name in ("schedule", "schedule_ahead"):
        def record(wid, make=getattr(c.sched, name)):
            plan = make(wid)
            if plan is not None and plan.scheduled:
                planned.append((wid, plan.num_threads,
                                scheduled(plan)))
            return plan
        setattr(c.sched, name, record)
    c.submit("long", list(range(100, 116)), max_tokens=3)
    c.step()
    c.step()
    c.submit("b", list(range(200, 208)), max_tokens=3)
    c.run()
    assert planned == [
        ("p0", 2, [("long", 8)]),   # nothing else to compute: both cores prefill
        ("p0", 2, [("long", 8)]),   # the decode worker's step only registered the transfer
        ("d0", 2, [("long", 1)]),   # the prefill worker has nothing left: both cores decode
        ("p0", 1, [("b", 8)]),      # b arrived while long decodes: one core each
        ("d0", 2, [("long", 1)]),
        ("d0", 2, [("b", 1)]),
        ("d0", 2, [("b", 1)]),
    ]
    c.assert_all_free()


def test_steps_beside_a_held_prompt_are_sized_for_the_threads_they_run_on():
    """d0 computes a long prompt beside its batch on both cores while p0 is free, its steps
    sized to --decode-step-target-ms (100) from the step before on as many threads: 16 tokens
    (--decode-long-prefill-tokens) in 50 ms -> 32 in 50 ms -> 64. Then p0 takes a short prompt
    and d0's next step runs on one core: it starts again from 16, not from the 64 timed on two
    (a step twice the target or more), and is sized from its own time; once p0 is done, two
    threads again and their 64."""
    c = Cluster({"p0": 128, "d0": 256}, cpu_cores=(0, 1), prefill_bypass_threshold=4,
                decode_prefill_tokens=64, decode_long_prefill_tokens=16, decode_step_target_ms=100)
    c.submit("a", list(range(10, 14)), max_tokens=40)  # d0's batch
    for _ in range(4):
        c.step()
    for wid in ("p0", "d0"):
        while c.sent[wid]:
            c.run_step(wid)
    c.submit("long", list(range(1000, 1300)), max_tokens=1)
    d0 = c.sched.workers["d0"]
    held = []
    for seconds in (0.05, 0.05):
        plan = c.plan("d0")
        held.append((plan.num_threads, scheduled(plan)))
        c.now += seconds
        c.run_step("d0")
    assert held == [(2, [("a", 1), ("long", 16)]), (2, [("a", 1), ("long", 32)])]
    assert d0.held_step_tokens == {2: 64}
    c.submit("b", list(range(2000, 2010)), max_tokens=1)
    assert scheduled(c.plan("p0")) == [("b", 10)]  # running: p0 computes
    plan = c.plan("d0")
    assert (plan.num_threads, scheduled(plan)) == (1, [("a", 1), ("long", 16)])
    c.now += 0.08
    c.run_step("d0")
    assert d0.held_step_tokens == {2: 64, 1: 20}
    c.run_step("p0")
    plan = c.plan("d0")
    assert (plan.num_threads, scheduled(plan)) == (2, [("a", 1), ("long", 64)])
    c.run()
    c.assert_all_free()
