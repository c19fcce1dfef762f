"""Workers sharing cores give lent ones back mid-step (common/worker/core_board.py): which peers
a board counts as stepping (or as stepped lately), a real worker's step dropping to its share at
the first layer that ends with a peer stepping, and one planned on its share taking a peer's
cores once that one has been quiet for QUIET_S; its tokens unchanged. A step kept off its core
by another process counts as starved."""
import logging
import multiprocessing
import os
import time

import pytest
import torch

from common.worker.core_board import BOARD_PREFIX, QUIET_S, RESCAN_S, CoreBoard, core_mask
from common.worker.telemetry import _CountersCollector
from common.worker.worker import STARVED_MIN_S
from tests.unit.test_scheduler_inprocess import _greedy, _prompt, cluster, hf  # noqa: F401


class Clock:
    def __init__(self):
        self.now = 100.0

    def __call__(self):
        return self.now


def test_a_peer_counts_while_it_steps_on_a_shared_core(tmp_path):
    clock = Clock()
    a = CoreBoard("a", [0, 1], "host|sched", shm_dir=tmp_path, clock=clock)
    b = CoreBoard("b", [1, 2], "host|sched", shm_dir=tmp_path, clock=clock)
    apart = CoreBoard("c", [3], "host|sched", shm_dir=tmp_path, clock=clock)
    other = CoreBoard("d", [0, 1], "host|other-sched", shm_dir=tmp_path, clock=clock)
    a.stepping(True)  # looks for its peers: b and c (d answers another scheduler)
    assert (a.peers_stepping(), a.share()) == (0, 2)
    b.stepping(True)
    apart.stepping(True)  # no core of a's
    other.stepping(True)  # not a's scheduler's
    assert (a.peers_stepping(), a.share()) == (1, 1)
    b.stepping(False)
    assert (a.peers_stepping(), a.share()) == (0, 2)
    assert core_mask([0, 2]) == 0b101
    with pytest.raises(ValueError):
        core_mask([-1])


def test_a_peer_counts_as_busy_until_it_has_been_quiet_for_a_while(tmp_path):
    clock = Clock()
    a = CoreBoard("a", [0, 1], "g", shm_dir=tmp_path, clock=clock)
    b = CoreBoard("b", [0, 1], "g", shm_dir=tmp_path, clock=clock)
    a.stepping(True)
    assert a.share(QUIET_S) == 2  # b never stepped
    b.stepping(True)
    assert (a.share(), a.share(QUIET_S)) == (1, 1)
    b.stepping(False)
    assert (a.share(), a.share(QUIET_S)) == (2, 1)  # not stepping, but a moment ago
    clock.now += QUIET_S / 2
    assert a.share(QUIET_S) == 1
    clock.now += QUIET_S
    assert a.share(QUIET_S) == 2


def test_cores_past_the_first_64_are_told_apart(tmp_path):
    """A host of hundreds of cores: masks longer than one word, of different lengths."""
    a = CoreBoard("a", [0, 200], "g", shm_dir=tmp_path)
    near = CoreBoard("near", [64, 65], "g", shm_dir=tmp_path)
    far = CoreBoard("far", [200, 201, 1500], "g", shm_dir=tmp_path)
    for board in (near, far):
        board.stepping(True)
    a.stepping(True)
    assert (a.peers_stepping(), a.share()) == (1, 1)  # far shares core 200; near shares none
    near.stepping(True)
    assert near.peers_stepping() == 0  # cores 64-65 are nobody else's
    far.stepping(False)
    assert a.peers_stepping() == 0


def test_peers_are_found_again_at_most_once_a_second(tmp_path):
    clock = Clock()
    a = CoreBoard("a", [0, 1], "g", shm_dir=tmp_path, clock=clock)
    a.stepping(True)
    late = CoreBoard("late", [0], "g", shm_dir=tmp_path, clock=clock)
    late.stepping(True)
    a.stepping(False)
    a.stepping(True)  # looked less than RESCAN_S ago: not yet
    assert a.peers_stepping() == 0
    clock.now += RESCAN_S
    a.stepping(True)
    assert a.peers_stepping() == 1
    late.close()  # its segment goes: dropped at the next look
    a.stepping(True)
    assert a.peers_stepping() == 0  # close() marks it not stepping first
    clock.now += RESCAN_S
    a.stepping(True)
    assert a._peers == {}


def _die_stepping(shm_dir):
    CoreBoard("dead", [0, 1], "g", shm_dir=shm_dir).stepping(True)
    os._exit(0)  # no cleanup: as a SIGKILL would leave it


def test_a_dead_workers_segment_is_swept_and_never_counts(tmp_path):
    p = multiprocessing.get_context("fork").Process(target=_die_stepping, args=(tmp_path,))
    p.start()
    p.join(30)
    assert p.exitcode == 0
    dead = [f for f in os.listdir(tmp_path) if f.startswith(BOARD_PREFIX)]
    assert len(dead) == 1  # left behind, marked stepping
    a = CoreBoard("a", [0, 1], "g", shm_dir=tmp_path)
    a.stepping(True)
    assert a.peers_stepping() == 0
    assert not (tmp_path / dead[0]).exists()


def test_a_worker_restarted_under_its_id_takes_its_dead_runs_place(tmp_path):
    p = multiprocessing.get_context("fork").Process(target=_die_stepping, args=(tmp_path,))
    p.start()
    p.join(30)
    from common.shm_segments import sweep_stale_segments
    sweep_stale_segments(tmp_path)  # as a worker's start does (build_worker)
    again = CoreBoard("dead", [0, 1], "g", shm_dir=tmp_path)  # the same id, restarted
    peer = CoreBoard("peer", [0, 1], "g", shm_dir=tmp_path)
    peer.stepping(True)
    assert peer.peers_stepping() == 0  # the restarted one is not stepping yet
    again.stepping(True)
    assert peer.peers_stepping() == 1
    with pytest.raises(FileExistsError):  # a live worker's id stays its own
        CoreBoard("dead", [0, 1], "g", shm_dir=tmp_path)


@pytest.fixture
def two_threads():
    before = torch.get_num_threads()
    yield
    torch.set_num_threads(before)


def _board_cluster(cluster, tmp_path, clock=time.monotonic):
    """A colocated worker on two threads whose board (and its peer's) lives in tmp_path."""
    c = cluster([("decode", 64)])
    (wid, worker), = c.workers.items()
    worker.board.close()  # the host's board: other workers of this machine are not its peers
    worker.board = CoreBoard(wid, [0, 1], "g", shm_dir=tmp_path, clock=clock)
    peer = CoreBoard("peer", [0, 1], "g", shm_dir=tmp_path, clock=clock)
    return c, worker, peer


def _plans_threads(worker, threads: list[int]):
    """Each of the worker's plans says threads[0], as the scheduler's would beside a busy
    peer."""
    run = worker.execute

    def execute(plan, sub_step=0):
        plan.num_threads = threads[0]
        return run(plan, sub_step)
    worker.execute = execute


def test_a_step_on_lent_cores_gives_them_back_while_a_peer_steps(cluster, hf, tmp_path,
                                                                  two_threads):
    """The peer starts a step while layer 0 runs and ends it while layer 2 does: layers 1 and 2
    run on one thread, layer 3 on both again; then a step that starts while the peer steps runs
    on one from its start. The tokens stay HuggingFace's."""
    c, worker, peer = _board_cluster(cluster, tmp_path)
    layers = worker.runner.model.layers
    assert len(layers) == 4
    seen = []

    def at(i, peer_steps=None):
        def hook(*_):
            seen.append(worker.threads.get())
            if peer_steps is not None:
                peer.stepping(peer_steps)
        return layers[i].register_forward_hook(hook)
    hooks = [at(0, True), at(1), at(2, False), at(3)]
    prompt = _prompt(21, 5)
    c.submit("a", prompt, max_tokens=5)
    worker.threads.set(2)
    c.step()  # the prompt
    for h in hooks:
        h.remove()
    assert seen == [2, 1, 1, 2]
    assert worker.yielded == 1
    metric, = [m for m in _CountersCollector(worker, "w", "decode").collect()
               if m.name == "pdserve:worker_cpu_cores_yielded"]
    assert metric.samples[0].value == 1
    peer.stepping(True)
    seen.clear()
    hook = at(0)
    c.step()  # a decode step while the peer steps throughout
    hook.remove()
    assert seen == [1] and worker.yielded == 2
    c.run()
    assert c.tokens("a") == _greedy(hf, prompt, 5)
    c.assert_all_free()


def test_a_step_keeps_its_threads_while_no_peer_steps(cluster, hf, tmp_path, two_threads):
    c, worker, peer = _board_cluster(cluster, tmp_path)
    peer.stepping(True)
    peer.stepping(False)
    prompt = _prompt(9, 6)
    c.submit("a", prompt, max_tokens=4)
    worker.threads.set(2)
    c.run()
    assert worker.threads.get() == 2
    assert worker.yielded == 0
    assert c.tokens("a") == _greedy(hf, prompt, 4)


def test_a_step_planned_beside_a_busy_peer_takes_its_cores_once_it_is_quiet(cluster, hf,
                                                                            tmp_path,
                                                                            two_threads):
    """Planned on one of two cores while the peer stepped: the peer ends its step during layer
    0; layers 1 and 2 end less than QUIET_S after that (one thread), layer 3 runs on both. A
    step that starts with the peer quiet runs on both from its start; one whose plan gave no
    thread count (the scheduler does not split these cores) never takes more. HuggingFace's
    tokens throughout."""
    clock = Clock()
    c, worker, peer = _board_cluster(cluster, tmp_path, clock)
    layers = worker.runner.model.layers
    seen = []

    def at(i, then):
        def hook(*_):
            seen.append(worker.threads.get())
            then()
        return layers[i].register_forward_hook(hook)

    def later(s):
        def advance():
            clock.now += s
        return advance
    planned = [1]
    _plans_threads(worker, planned)
    peer.stepping(True)
    hooks = [at(0, lambda: peer.stepping(False)), at(1, later(QUIET_S / 2)),
             at(2, later(QUIET_S)), at(3, lambda: None)]
    prompt = _prompt(23, 5)
    c.submit("a", prompt, max_tokens=5)
    c.step()  # the prompt
    assert seen == [1, 1, 1, 2]
    assert (worker.taken, worker.yielded) == (1, 0)
    metric, = [m for m in _CountersCollector(worker, "w", "decode").collect()
               if m.name == "pdserve:worker_cpu_cores_taken"]
    assert metric.samples[0].value == 1
    for h in hooks:
        h.remove()
    hooks = [at(i, lambda: None) for i in range(4)]
    seen.clear()
    c.step()  # a decode step, the peer quiet since
    assert seen == [2, 2, 2, 2] and worker.taken == 2
    assert worker.threads.get() == 1  # back to its plan's with the step
    planned[0] = 0  # the step before gave its taken core back at its end
    seen.clear()
    c.step()
    assert seen == [1, 1, 1, 1] and worker.taken == 2 and worker.yielded == 0
    for h in hooks:
        h.remove()
    c.run()
    assert c.tokens("a") == _greedy(hf, prompt, 5)
    c.assert_all_free()


def test_a_worker_on_one_core_gives_its_extra_threads_back_while_a_peer_steps(cluster, hf,
                                                                               tmp_path,
                                                                               two_threads):
    """One core, a plan of two threads (as a --cpu-threads above the cores would run): its
    share while the peer steps is one thread."""
    c = cluster([("decode", 64)])
    (wid, worker), = c.workers.items()
    worker.board.close()
    worker.board = CoreBoard(wid, [0], "g", shm_dir=tmp_path)
    peer = CoreBoard("peer", [0], "g", shm_dir=tmp_path)
    _plans_threads(worker, [2])
    peer.stepping(True)
    seen = []
    hook = worker.runner.model.layers[0].register_forward_hook(
        lambda *_: seen.append(worker.threads.get()))
    prompt = _prompt(29, 5)
    c.submit("a", prompt, max_tokens=3)
    c.step()
    hook.remove()
    assert seen == [1] and worker.yielded == 1 and worker.taken == 0
    peer.stepping(False)
    c.run()
    assert c.tokens("a") == _greedy(hf, prompt, 3)
    c.assert_all_free()


def _starved_metric(worker) -> float:
    metric, = [m for m in _CountersCollector(worker, "w", "decode").collect()
               if m.name == "pdserve:worker_cpu_starved_seconds"]
    return metric.samples[0].value


def test_a_step_kept_off_its_core_counts_as_starved_and_says_so_once(cluster, hf, tmp_path,
                                                                     caplog):
    """Steps whose thread is off its core for most of their time (it sleeps in each layer, as a
    thread waits while a busier process at a higher priority has its core) count their wall
    seconds as starved, with one warning for both; steps as long on the core count nothing. The
    tokens stay HuggingFace's."""
    c, worker, _ = _board_cluster(cluster, tmp_path)
    layers = worker.runner.model.layers
    per_layer = STARVED_MIN_S / len(layers)

    def off_core(*_):
        time.sleep(per_layer)

    def on_core(*_):
        end = time.thread_time() + per_layer
        while time.thread_time() < end:
            pass
    prompt = _prompt(31, 5)
    c.submit("a", prompt, max_tokens=4)
    hooks = [layer.register_forward_hook(on_core) for layer in layers]
    c.step()  # the prompt, on its core throughout
    assert worker.starved_s == 0 and _starved_metric(worker) == 0
    for h in hooks:
        h.remove()
    hooks = [layer.register_forward_hook(off_core) for layer in layers]
    with caplog.at_level(logging.WARNING, logger="common.worker.worker"):
        c.step()
        c.step()
    for h in hooks:
        h.remove()
    assert 2 * STARVED_MIN_S <= worker.starved_s < 4 * STARVED_MIN_S
    assert _starved_metric(worker) == worker.starved_s
    warned = [r.getMessage() for r in caplog.records if "another process" in r.getMessage()]
    assert len(warned) == 1 and "--pin-cpus" in warned[0]
    c.run()
    assert c.tokens("a") == _greedy(hf, prompt, 4)
    c.assert_all_free()


def test_a_workers_start_sweeps_dead_workers_boards_of_every_scheduler(tmp_path):
    from common.shm_segments import sweep_stale_segments
    p = multiprocessing.get_context("fork").Process(target=_die_stepping, args=(tmp_path,))
    p.start()
    p.join(30)
    live = CoreBoard("live", [0], "another scheduler", shm_dir=tmp_path)
    dead = [f for f in os.listdir(tmp_path) if f.endswith("-dead")]
    assert sweep_stale_segments(tmp_path) == dead
    assert os.listdir(tmp_path) == [live._own.path.name]
