"""Parallel sampling: n samples of each prompt as one request (n=N: prefilled once, the KV sent
once, the prompt's blocks shared on the decode worker) beside the same samples sent as N separate
requests (n=1 each, seed + j; the prefix cache still shares full blocks on the prefill worker),
on one running stack, in one run.

    .venv/bin/python benchmarks/parallel_sampling.py
"""
from __future__ import annotations

import argparse
import asyncio
import json
import random
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))
from loadgen import launch  # noqa: E402


def counters(sched: str) -> dict[str, int]:
    out = subprocess.run([str(Path(sys.executable).parent / "pdserve"), "stats", "--scheduler",
                          sched], capture_output=True, text=True, check=True, timeout=30)
    workers = json.loads(out.stdout)["workers"]
    return {k: sum(w[k] for w in workers) for k in ("prompt_tokens_computed", "kv_blocks_sent")}


async def run(url: str, prompts: list[list[int]], n: int, max_tokens: int, together: bool,
              concurrency: int) -> tuple[list[float], float]:
    """Per prompt, the seconds until all n samples were complete; and the wall time."""
    async with httpx.AsyncClient(base_url=url, timeout=600) as client:
        model = (await client.get("/v1/models")).json()["data"][0]["id"]
        gate = asyncio.Semaphore(concurrency)

        async def complete(prompt, samples, seed):
            body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "n": samples,
                    "temperature": 1.0, "seed": seed, "ignore_eos": True}
            r = await client.post("/v1/completions", json=body)
            r.raise_for_status()
            assert len(r.json()["choices"]) == samples

        async def group(i, prompt):
            async with gate:
                start = time.perf_counter()
                if together:
                    await complete(prompt, n, i * n)
                else:
                    await asyncio.gather(*(complete(prompt, 1, i * n + j) for j in range(n)))
                return time.perf_counter() - start

        start = time.perf_counter()
        latencies = await asyncio.gather(*(group(i, p) for i, p in enumerate(prompts)))
        return list(latencies), time.perf_counter() - start


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="models/tiny-llama")
    p.add_argument("--num-prompts", type=int, default=24)
    p.add_argument("--n", type=int, default=4)
    p.add_argument("--prompt-len", type=int, default=500)
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--concurrency", type=int, default=4, help="prompts in flight at once")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args()
    if not Path(args.model, "config.json").exists():
        from common.models.tiny import make_tiny_model
        make_tiny_model(args.model)
    rng = random.Random(args.seed)

    def prompts():  # fresh ones per mode: no prefix-cache hit across the two
        return [[rng.randrange(0, 2000) for _ in range(args.prompt_len)]
                for _ in range(args.num_prompts)]

    print(f"{args.num_prompts} prompts of {args.prompt_len} tokens, {args.n} samples of "
          f"{args.max_tokens} tokens each, {args.concurrency} prompts in flight")
    proc, url, sched = launch(args.model, [], Path("/tmp/pdserve-bench-parallel-sampling.log"))
    rows = []
    try:
        for name, together in ((f"n={args.n}, one request", True),
                               (f"{args.n} requests, n=1", False)):
            before = counters(sched)
            latencies, wall = asyncio.run(run(url, prompts(), args.n, args.max_tokens, together,
                                              args.concurrency))
            after = counters(sched)
            latencies.sort()
            rows.append((name, args.num_prompts * args.n * args.max_tokens / wall,
                         1000 * statistics.median(latencies),
                         1000 * latencies[int(0.99 * (len(latencies) - 1))],
                         after["prompt_tokens_computed"] - before["prompt_tokens_computed"],
                         after["kv_blocks_sent"] - before["kv_blocks_sent"]))
    finally:
        proc.send_signal(signal.SIGINT)
        proc.wait(30)
    head = ("mode", "out tok/s", "group e2e p50", "group e2e p99", "prefill tokens",
            "KV blocks sent")
    print(f"{head[0]:>22} " + " ".join(f"{h:>15}" for h in head[1:]))
    for row in rows:
        print(f"{row[0]:>22} {row[1]:>15.1f} {row[2]:>15.1f} {row[3]:>15.1f} {row[4]:>15} "
              f"{row[5]:>15}")
    print("(times in ms; a group is the n samples of one prompt)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
