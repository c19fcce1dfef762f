"""Where the cores go while a target serves a draw (serve.py --cores): every process's CPU time
and the machine's idle time, sampled beside the load with psutil, summed by process name over
the draw's wall time.

The figures are the machine's, not a target's alone: the load client shows up as `serve.py`
(this sampler's thread included, about 1% of a core at the default interval), and whatever else
runs under its own name; the target that is not being measured waits, near 0. A process that
starts inside the window counts from its start; one that ends inside it loses what it used after
the last sample that saw it (at most one interval)."""
from __future__ import annotations

import os
import threading
import time
from dataclasses import dataclass, field

import psutil

INTERVAL_S = 0.25
TIMELINE_S = 0.5  # bins of the timeline the figures draw


def label(cmdline: list[str], name: str) -> str:
    """A process's name in the figures: a Python program's script (`serve.py`) or console
    command with its subcommand (`pdserve decode-worker`, `vllm serve`), a module run with -m,
    or what the process calls itself (vLLM names its engine and workers `VLLM::EngineCore`,
    `VLLM::Worker`)."""
    if not cmdline or not cmdline[0]:
        return name
    first = cmdline[0].split()[0]
    if not os.path.basename(first).startswith("python"):
        return os.path.basename(first)
    args = iter(cmdline[1:])
    for arg in args:
        if arg in ("-m", "-c"):
            return next(args, "") if arg == "-m" else "python -c"
        if arg.startswith("-"):
            if arg in ("-X", "-W"):
                next(args, None)
            continue
        script = os.path.basename(arg)
        if script.endswith(".py"):
            return script
        sub = next(args, "")
        return f"{script} {sub}" if sub and not sub.startswith("-") else script
    return name


@dataclass
class Sample:
    t: float                                  # time.monotonic()
    wall: float                               # time.time(), as processes' start times are
    idle_s: float                             # the machine's idle + iowait seconds so far
    cpu_s: dict[tuple[int, float], float] = field(default_factory=dict)  # (pid, created) -> s


class Cores:
    """Samples on a thread from entering its `with` block to leaving it; `usage` then says
    where the cores went."""

    def __init__(self, interval_s: float = INTERVAL_S):
        self.interval_s = interval_s
        self.samples: list[Sample] = []
        self.labels: dict[tuple[int, float], str] = {}
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._run, name="cores", daemon=True)

    def __enter__(self) -> Cores:
        self.samples.append(self._sample())
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._done.set()
        self._thread.join(10)
        self.samples.append(self._sample())

    def _run(self) -> None:
        while not self._done.wait(self.interval_s):
            self.samples.append(self._sample())

    def _sample(self) -> Sample:
        times = psutil.cpu_times()
        s = Sample(time.monotonic(), time.time(), times.idle + getattr(times, "iowait", 0.0))
        for p in psutil.process_iter(["cpu_times", "create_time"]):
            cpu, created = p.info["cpu_times"], p.info["create_time"]
            if cpu is None or created is None:  # gone, or not ours to read
                continue
            key = (p.pid, created)
            if key not in self.labels:
                try:
                    self.labels[key] = label(p.cmdline(), p.name())
                except psutil.Error:
                    continue
            s.cpu_s[key] = cpu.user + cpu.system
        return s

    def usage(self) -> dict:
        """{"wall_s", "cores" (the machine's), "idle" (cores idle on average), "processes"
        (name -> cores used on average, over 0.005), "timeline" ([t from the start, idle,
        {name: cores}] per TIMELINE_S bin)}."""
        return usage(self.samples, self.labels, psutil.cpu_count() or 1)


def usage(samples: list[Sample], labels: dict[tuple[int, float], str], cores: int) -> dict:
    """`Cores.usage` from its samples (apart, for tests): each interval's CPU seconds per name,
    summed over the whole window and over each TIMELINE_S bin it starts in."""
    start, end = samples[0].t, samples[-1].t
    wall = max(end - start, 1e-9)
    total: dict[str, float] = {}
    bins: list[tuple[list[float], dict[str, float]]] = []  # ([idle s, wall s], {name: s})
    for before, after in zip(samples, samples[1:]):
        k = int((before.t - start) / TIMELINE_S)
        while len(bins) <= k:
            bins.append(([0.0, 0.0], {}))
        times, names = bins[k]
        times[0] += after.idle_s - before.idle_s
        times[1] += after.t - before.t
        for key, cpu in after.cpu_s.items():
            if key in before.cpu_s:
                used = cpu - before.cpu_s[key]
            else:  # all of it if it started since; else it was not read then: none of it
                used = cpu if key[1] >= before.wall else 0.0
            if used > 0:
                name = labels[key]
                names[name] = names.get(name, 0.0) + used
                total[name] = total.get(name, 0.0) + used
    return {
        "wall_s": round(wall, 3), "cores": cores,
        "idle": round((samples[-1].idle_s - samples[0].idle_s) / wall, 3),
        "processes": {n: round(s / wall, 3) for n, s in
                      sorted(total.items(), key=lambda kv: -kv[1]) if s / wall > 0.005},
        "timeline": [[round(k * TIMELINE_S, 2), round(idle / span, 3),
                      {n: round(s / span, 3) for n, s in names.items() if s / span > 0.005}]
                     for k, ((idle, span), names) in enumerate(bins) if span > 0],
    }


def line(u: dict) -> str:
    """One line of where the cores went: each name's cores on average, then idle."""
    used = ", ".join(f"{n} {c:.2f}" for n, c in u["processes"].items())
    return f"cores ({u['cores']}) over {u['wall_s']:.1f} s: {used}; idle {u['idle']:.2f}"
