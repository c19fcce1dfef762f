"""Gateway CPU per streamed token, and throughput, with 1 and with N gateway processes.

    python benchmarks/gateways.py --model DIR [--processes 1 2] [--num-requests 64]
        [--max-tokens 64] [--repeats 2] [--out benchmarks/results/gateways]

For each count, `pdserve up --gateways N` on the same model; the random workload (256-token
prompts) all at once; the CPU time (user + system, from /proc) of the gateway's processes (the
parent and its children) over the run, divided by the streamed tokens. Prints a table and writes
a JSON and a bar plot beside it.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks.loadgen import launch, run_load, summarize, workload  # noqa: E402

TICK = os.sysconf("SC_CLK_TCK")


def _tree(root: int) -> list[int]:
    """root and its descendants."""
    parent = {}
    for d in Path("/proc").iterdir():
        try:
            if d.name.isdigit():
                parent[int(d.name)] = int((d / "stat").read_text().rsplit(")", 1)[1].split()[1])
        except (OSError, ValueError):
            pass
    out, frontier = [root], [root]
    while frontier:
        frontier = [p for p, pp in parent.items() if pp in frontier]
        out += frontier
    return out


def _cpu_s(pids: list[int]) -> float:
    total = 0
    for pid in pids:
        try:
            fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
            total += int(fields[11]) + int(fields[12])  # utime, stime
        except OSError:
            pass
    return total / TICK


def _gateway_root(launcher: int) -> int:
    for pid in _tree(launcher):
        try:
            if b"\0gateway\0" in Path(f"/proc/{pid}/cmdline").read_bytes():
                return pid
        except OSError:
            pass
    raise RuntimeError("no gateway process under the launcher")


def measure(model: str, processes: int, args) -> list[dict]:
    log = Path(tempfile.gettempdir()) / f"pdserve-bench-gateways-{processes}.log"
    proc, url, _ = launch(model, ["--gateways", str(processes)], log)
    runs = []
    try:
        gateway = _tree(_gateway_root(proc.pid))
        for k in range(args.repeats):
            prompts = workload("random", args.num_requests, args.seed + k)
            before = _cpu_s(gateway)
            records, wall = asyncio.run(run_load(url, prompts, 0, args.max_tokens,
                                                 args.seed + k, f"{processes} gateway(s)"))
            cpu = _cpu_s(gateway) - before
            tokens = sum(r.tokens for r in records if not r.error)
            s = summarize(records, wall, 2.0, 0.1)
            runs.append({"processes": processes, "cpu_s": cpu, "tokens": tokens,
                         "cpu_ms_per_token": 1000 * cpu / max(1, tokens),
                         "out_tok_s": s["out tok/s"], "failed": s["failed"]})
    finally:
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
    return runs


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", required=True)
    p.add_argument("--processes", type=int, nargs="+", default=[1, 2])
    p.add_argument("--num-requests", type=int, default=64)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--seed", type=int, default=500)
    p.add_argument("--out", default="benchmarks/results/gateways")
    args = p.parse_args()
    rows = [r for n in args.processes for r in measure(args.model, n, args)]
    print(f"\n{'gateways':>8} {'out tok/s':>10} {'gateway CPU ms/token':>21} {'failed':>7}")
    for r in rows:
        print(f"{r['processes']:>8} {r['out_tok_s']:>10.1f} {r['cpu_ms_per_token']:>21.3f} "
              f"{r['failed']:>7}")
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".json").write_text(json.dumps({"model": args.model, "rows": rows}, indent=1))
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, (a, b) = plt.subplots(1, 2, figsize=(9, 3.5))
    for ax, key, label in ((a, "out_tok_s", "output tok/s"),
                           (b, "cpu_ms_per_token", "gateway CPU ms per token")):
        for n in args.processes:
            vals = [r[key] for r in rows if r["processes"] == n]
            ax.bar(str(n), statistics.mean(vals), yerr=[[statistics.mean(vals) - min(vals)],
                                                         [max(vals) - statistics.mean(vals)]],
                   capsize=4)
        ax.set_xlabel("gateway processes")
        ax.set_ylabel(label)
    fig.tight_layout()
    fig.savefig(out.with_suffix(".png"), dpi=120)
    print(f"wrote {out.with_suffix('.json')} and {out.with_suffix('.png')}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
