import argparse
import os

import pytest

from common.worker.config import parse_cores
from services import launcher


def test_core_lists_parse():
    assert parse_cores("0-3,8") == (0, 1, 2, 3, 8)
    assert parse_cores("5") == (5,)
    with pytest.raises(argparse.ArgumentTypeError):
        parse_cores("a-b")


def _commands(*argv):
    p = argparse.ArgumentParser()
    launcher.add_arguments(p)
    role = len(launcher._pdserve())  # the subcommand follows the executable
    return {f"{c[role]}{i}": c for i, c in enumerate(launcher.commands(p.parse_args(argv)))}


def test_workers_share_every_core_and_prefill_yields_them_by_default():
    cmds = _commands("--prefill-workers", "1", "--decode-workers", "2")
    workers = {n: c for n, c in cmds.items() if "worker" in n}
    assert len(workers) == 3
    cores = str(len(os.sched_getaffinity(0)))
    for name, c in workers.items():
        assert "--cpu-cores" not in c
        assert c[c.index("--cpu-threads") + 1] == cores
        nice = c[c.index("--cpu-nice") + 1] if "--cpu-nice" in c else None
        assert nice == ("19" if name.startswith("prefill") else None)
        env = launcher.environment(c)
        for key, nice_value in (("OMP_WAIT_POLICY", "PASSIVE"),
                                ("GOMP_SPINCOUNT", str(launcher.NICE_SPIN_COUNT))):
            assert env.get(key) == (nice_value if name.startswith("prefill")
                                    else os.environ.get(key))


def test_pinned_workers_get_disjoint_cores_when_there_are_enough():
    cmds = _commands("--prefill-workers", "1", "--decode-workers", "1", "--pin-cpus")
    pinned = [c[c.index("--cpu-cores") + 1] for c in cmds.values() if "--cpu-cores" in c]
    assert not any("--cpu-nice" in c for c in cmds.values())
    if len(os.sched_getaffinity(0)) >= 2:
        assert len(pinned) == 2
        sets = [set(parse_cores(p)) for p in pinned]
        assert not sets[0] & sets[1]


def test_colocated_mode_starts_no_prefill_worker():
    roles = [c[len(launcher._pdserve())]
             for c in _commands("--mode", "colocated", "--decode-workers", "2").values()]
    assert roles.count("decode-worker") == 2 and "prefill-worker" not in roles


def test_workers_sharing_a_gpu_split_its_memory(monkeypatch):
    monkeypatch.delenv("PDSERVE_GPU_MEMORY_UTILIZATION", raising=False)
    cmds = _commands("--device", "cuda", "--prefill-workers", "1", "--decode-workers", "2",
                     "--decode-worker-args", "--gpu-memory-utilization 0.5")
    shares = {name: [c[i + 1] for i, a in enumerate(c) if a == "--gpu-memory-utilization"]
              for name, c in cmds.items() if "worker" in name}
    assert shares == {"prefill-worker1": ["0.3000"], "decode-worker2": ["0.3000", "0.5"],
                      "decode-worker3": ["0.3000", "0.5"]}  # argparse keeps the last
    assert not any("--gpu-memory-utilization" in c for c in _commands().values())


def test_the_dtype_reaches_every_worker_auto_by_default():
    for argv, want in [((), "auto"), (("--dtype", "float32"), "float32"),
                       (("--dtype", "half"), "half")]:
        dtypes = {n: c[c.index("--dtype") + 1] for n, c in _commands(*argv).items()
                  if "--dtype" in c}
        assert dtypes == {"prefill-worker1": want, "decode-worker2": want}


def test_the_kv_tier_reaches_every_worker_and_parses_there():
    from common.worker.config import add_arguments, config_from_args
    cmds = _commands("--kv-offloading-size", "2.5", "--kv-offloading-backend", "host")
    workers = {n: c for n, c in cmds.items() if "worker" in n}
    assert {n: c[c.index("--kv-offloading-size") + 1] for n, c in workers.items()} == \
        {"prefill-worker1": "2.5", "decode-worker2": "2.5"}
    assert not any("--kv-offloading-size" in c for c in _commands().values())
    p = argparse.ArgumentParser()
    add_arguments(p)
    role = len(launcher._pdserve())
    cfg = config_from_args("decode", p.parse_args(workers["decode-worker2"][role + 1:]))
    assert cfg.kv_offloading_size_gib == 2.5 and cfg.kv_offloading_blocks == 0
    assert cfg.kv_offloading_backend == "host"
