"""Load test of the OpenAI API: TTFT / TPOT / ITL percentiles and throughput under a mixed
workload (mostly short prompts, some long), for several stack shapes side by side in one run.

    .venv/bin/python benchmarks/serve.py                     # launches each shape itself
    .venv/bin/python benchmarks/serve.py --url http://127.0.0.1:8000   # one running server

Every request streams; TTFT is the time to the first non-empty token chunk, TPOT the mean gap
between a request's later tokens, ITL every single gap.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import random
import shlex
import signal
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[1]
SHAPES = {  # --shapes key: (row name, `pdserve up` flags)
    "disagg": ("disaggregated 1P+1D", ["--prefill-workers", "1", "--decode-workers", "1"]),
    "colocated": ("colocated 0P+2D", ["--prefill-workers", "0", "--decode-workers", "2"]),
    "disagg-sync": ("disagg., no async sched.",
                    ["--prefill-workers", "1", "--decode-workers", "1",
                     "--scheduler-args=--no-async-scheduling"]),
    "disagg-1partial": ("disagg., 1 partial prefill",
                        ["--prefill-workers", "1", "--decode-workers", "1",
                         "--scheduler-args=--max-num-partial-prefills 1"]),
}


def workload(n: int, short: tuple[int, int], long: tuple[int, int], long_frac: float,
             seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        lo, hi = long if rng.random() < long_frac else short
        out.append([rng.randrange(0, 2000) for _ in range(rng.randint(lo, hi))])
    return out


async def one(client: httpx.AsyncClient, model: str, prompt: list[int], max_tokens: int) -> dict:
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
            "ignore_eos": True, "stream": True, "return_token_ids": True}
    start = time.perf_counter()
    times = []
    async with client.stream("POST", "/v1/completions", json=body) as r:
        r.raise_for_status()
        async for line in r.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            for c in chunk.get("choices", []):
                n = len(c.get("token_ids") or [])
                times += [time.perf_counter()] * n
    return {"prompt": len(prompt), "ttft": times[0] - start if times else float("nan"),
            "itl": [b - a for a, b in zip(times, times[1:])], "n": len(times),
            "e2e": time.perf_counter() - start}


async def run_load(url: str, prompts: list[list[int]], rate: float, max_tokens: int,
                   seed: int) -> tuple[list[dict], float]:
    rng = random.Random(seed)
    async with httpx.AsyncClient(base_url=url, timeout=600) as client:
        model = (await client.get("/v1/models")).json()["data"][0]["id"]
        await one(client, model, prompts[0], 4)  # warm-up
        tasks = []
        start = time.perf_counter()
        for p in prompts:
            tasks.append(asyncio.create_task(one(client, model, p, max_tokens)))
            if rate > 0:
                await asyncio.sleep(rng.expovariate(rate))
        results = await asyncio.gather(*tasks)
        return results, time.perf_counter() - start


def pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q / 100 * len(xs)))] * 1000 if xs else float("nan")


def summarize(name: str, results: list[dict], wall: float) -> dict:
    ttft = [r["ttft"] for r in results]
    tpot = [statistics.mean(r["itl"]) for r in results if r["itl"]]
    itl = [g for r in results for g in r["itl"]]
    out_tokens = sum(r["n"] for r in results)
    short = [r["ttft"] for r in results if r["prompt"] < 512]
    return {"shape": name, "requests": len(results), "out tok/s": out_tokens / wall,
            "TTFT p50": pct(ttft, 50), "TTFT p99": pct(ttft, 99),
            "short TTFT p99": pct(short, 99), "TPOT p50": pct(tpot, 50),
            "TPOT p99": pct(tpot, 99), "ITL p99": pct(itl, 99)}


def print_table(rows: list[dict]) -> None:
    keys = list(rows[0])
    print("  ".join(f"{k:>22}" if i == 0 else f"{k:>14}" for i, k in enumerate(keys)))
    for r in rows:
        print("  ".join(f"{r[k]:>22}" if i == 0 else
                        (f"{r[k]:>14.1f}" if isinstance(r[k], float) else f"{r[k]:>14}")
                        for i, k in enumerate(keys)))
    print("(times in ms; TTFT/TPOT/ITL percentiles over requests / gaps)")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch(model: str, shape_args: list[str], log: Path) -> tuple[subprocess.Popen, str, str]:
    """`pdserve up` on free ports: (process, gateway url, scheduler address)."""
    port, sport = free_port(), free_port()
    proc = subprocess.Popen([str(Path(sys.executable).parent / "pdserve"), "up", "--model", model,
                             "--port", str(port), "--scheduler-port", str(sport),
                             "--cpu-threads", "1", *shape_args],
                            stdout=open(log, "w"), stderr=subprocess.STDOUT, cwd=ROOT)
    deadline = time.monotonic() + 300
    while "pdserve is up" not in log.read_text():
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            raise RuntimeError(log.read_text()[-3000:])
        time.sleep(0.3)
    return proc, f"http://127.0.0.1:{port}", f"127.0.0.1:{sport}"


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--url", help="benchmark this running server instead of launching shapes")
    p.add_argument("--model", default="models/tiny-llama")
    p.add_argument("--num-requests", type=int, default=60)
    p.add_argument("--rate", type=float, default=8.0, help="requests/s (Poisson); 0 = all at once")
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--short", type=int, nargs=2, default=[50, 200])
    p.add_argument("--long", type=int, nargs=2, default=[2000, 3000])
    p.add_argument("--long-frac", type=float, default=0.1)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--up-args", default="", help="more `pdserve up` flags for every shape")
    p.add_argument("--shapes", nargs="+", choices=list(SHAPES), default=["disagg", "colocated"],
                   help="stack shapes to compare, in this order")
    args = p.parse_args()
    prompts = workload(args.num_requests, tuple(args.short), tuple(args.long), args.long_frac,
                       args.seed)
    print(f"{len(prompts)} requests, prompts {args.short} tokens ({1 - args.long_frac:.0%}) and "
          f"{args.long} ({args.long_frac:.0%}), {args.max_tokens} output tokens, "
          f"{args.rate} req/s")
    rows = []
    if args.url:
        results, wall = asyncio.run(run_load(args.url, prompts, args.rate, args.max_tokens,
                                             args.seed))
        rows.append(summarize(args.url, results, wall))
    else:
        if not Path(args.model, "config.json").exists():
            from common.models.tiny import make_tiny_model
            make_tiny_model(args.model)
        for key in args.shapes:
            name, shape = SHAPES[key]
            log = Path(f"/tmp/pdserve-bench-{key}.log")
            proc, url, _ = launch(args.model, shape + shlex.split(args.up_args), log)
            try:
                results, wall = asyncio.run(run_load(url, prompts, args.rate, args.max_tokens,
                                                     args.seed))
            finally:
                proc.send_signal(signal.SIGINT)
                proc.wait(30)
            rows.append(summarize(name, results, wall))
    print_table(rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
