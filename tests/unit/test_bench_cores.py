"""benchmarks/cores.py: the names processes go by in serve.py --cores, and the arithmetic that
turns samples of CPU times into cores used over a draw."""
import os
import time

import pytest

from benchmarks.cores import TIMELINE_S, Cores, Sample, label, usage


@pytest.mark.parametrize("cmdline, name, expected", [
    (["/r/.venv/bin/python3", "/r/.venv/bin/pdserve", "decode-worker", "--model", "m"], "python3",
     "pdserve decode-worker"),
    (["/r/.venv/bin/python3", "/r/.venv/bin/pdserve", "up", "--model", "m"], "python3",
     "pdserve up"),
    ([".peers/venv-vllm/bin/python3", ".peers/venv-vllm/bin/vllm", "serve", "/tmp/m"], "python3",
     "vllm serve"),
    (["VLLM::EngineCore"], "VLLM::EngineCor", "VLLM::EngineCore"),
    (["VLLM::Worker   "], "VLLM::Worker", "VLLM::Worker"),
    ([".venv/bin/python", "benchmarks/serve.py", "--workload", "random"], "python",
     "serve.py"),
    (["python3", "-X", "importtime", "-u", "benchmarks/serve.py"], "python3", "serve.py"),
    (["/usr/bin/python3.11", "-m", "pytest", "-q"], "python3.11", "pytest"),
    (["python3", "-B", "-c", "from multiprocessing import x"], "python3", "python -c"),
    (["/r/.venv/bin/pdserve", "--log-level", "INFO"], "pdserve", "pdserve"),
    (["python3", "/r/bin/tool"], "python3", "tool"),
    (["flock", "/tmp/lock", "python", "x.py"], "flock", "flock"),
    ([], "kworker/0:1", "kworker/0:1"),
])
def test_a_process_goes_by_its_program_and_subcommand(cmdline, name, expected):
    assert label(cmdline, name) == expected


def test_cores_are_each_interval_s_cpu_over_the_window_and_new_processes_count_from_start():
    a, b, c, d = (1, 100.0), (2, 1000.6), (3, 100.0), (4, 100.0)
    labels = {a: "pdserve decode-worker", b: "pdserve gateway", c: "serve.py", d: "serve.py"}
    samples = [
        Sample(0.00, 1000.00, 10.0, {a: 5.0, c: 1.0}),
        Sample(0.25, 1000.25, 10.1, {a: 5.2, c: 1.05}),
        # b started at 1000.6, after the sample before: all its time counts; c is gone
        Sample(0.50, 1000.50, 10.2, {a: 5.4}),
        Sample(0.75, 1000.75, 10.2, {a: 5.6, b: 0.1}),
        # d was there all along but not read before: its time so far is not the window's
        Sample(1.00, 1001.00, 10.3, {a: 5.8, b: 0.2, d: 3.0}),
    ]
    u = usage(samples, labels, cores=2)
    assert u["wall_s"] == 1.0 and u["cores"] == 2
    assert u["idle"] == pytest.approx(0.3)
    assert u["processes"] == pytest.approx({"pdserve decode-worker": 0.8,
                                            "pdserve gateway": 0.2, "serve.py": 0.05})
    assert list(u["processes"]) == ["pdserve decode-worker", "pdserve gateway", "serve.py"]
    assert TIMELINE_S == 0.5
    (t0, idle0, by0), (t1, idle1, by1) = u["timeline"]
    assert (t0, t1) == (0.0, 0.5)
    assert idle0 == pytest.approx(0.4) and idle1 == pytest.approx(0.2)
    assert by0 == pytest.approx({"pdserve decode-worker": 0.8, "serve.py": 0.1})
    assert by1 == pytest.approx({"pdserve decode-worker": 0.8, "pdserve gateway": 0.4})


def test_a_busy_loop_here_shows_up_as_this_process():
    with Cores(interval_s=0.05) as cores:
        start = time.process_time()
        while time.process_time() - start < 0.4:  # 0.4 s of this process's CPU, however long
            pass
    u = cores.usage()
    mine = [k for k in cores.labels if k[0] == os.getpid()]
    assert len(mine) == 1
    name = cores.labels[mine[0]]
    assert u["processes"][name] * u["wall_s"] >= 0.35
    assert len(u["timeline"]) >= 1 and all(0 <= idle <= u["cores"] for _, idle, _ in
                                          u["timeline"])
