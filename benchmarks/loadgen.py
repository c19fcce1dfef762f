"""The load client the benchmarks share: named workloads, Poisson arrivals, one streaming
OpenAI completions request per prompt against any compatible server (pdserve or a baseline such
as vLLM, with the same code), per-request timings, and their summary.

Every request streams with greedy sampling and ignore_eos, so each server produces exactly
max_tokens tokens. TTFT is the time to the first non-empty token chunk, TPOT the mean gap
between a request's later tokens, ITL every single gap; goodput counts the requests per second
that met both the TTFT and the TPOT objective.
"""
from __future__ import annotations

import asyncio
import json
import random
import socket
import statistics
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[1]
VOCAB = 2000  # prompt token ids are drawn below this: valid for every model here


def workload(name: str, n: int, seed: int) -> list[list[int]]:
    """random:        256-token prompts (the throughput workload)
    bimodal:       80% of prompts 50-200 tokens, 20% 2000-3800 (the disaggregation lesson's)
    mixed:         90% 50-200, 10% 2000-3000
    shared-prefix: one 1024-token system prompt and a 20-80-token question each"""
    rng = random.Random(seed)

    def tokens(k: int) -> list[int]:
        return [rng.randrange(0, VOCAB) for _ in range(k)]

    if name == "random":
        return [tokens(256) for _ in range(n)]
    if name == "shared-prefix":
        return shared_prefix(n, 1024, (20, 80), seed)
    long_frac, long = {"bimodal": (0.2, (2000, 3800)), "mixed": (0.1, (2000, 3000))}[name]
    return [tokens(rng.randint(*long) if rng.random() < long_frac else rng.randint(50, 200))
            for _ in range(n)]


def shared_prefix(n: int, system_len: int, question: tuple[int, int],
                  seed: int) -> list[list[int]]:
    """One system prompt of system_len tokens, then a question of `question` tokens each."""
    rng = random.Random(seed)
    system = [rng.randrange(0, VOCAB) for _ in range(system_len)]
    return [system + [rng.randrange(0, VOCAB) for _ in range(rng.randint(*question))]
            for _ in range(n)]


WORKLOADS = ("random", "bimodal", "mixed", "shared-prefix")


@dataclass
class Record:
    """One request as the client saw it; times in seconds from the run's start."""
    prompt_tokens: int
    start: float
    first: float = float("nan")   # first token
    end: float = float("nan")     # last token
    gaps: list[float] = field(default_factory=list)  # between consecutive tokens
    tokens: int = 0
    error: str = ""

    @property
    def ttft(self) -> float:
        return self.first - self.start

    @property
    def tpot(self) -> float:
        return statistics.mean(self.gaps) if self.gaps else float("nan")


async def _one(client: httpx.AsyncClient, model: str, prompt: list[int], max_tokens: int,
               t0: float) -> Record:
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
            "ignore_eos": True, "stream": True, "return_token_ids": True}
    rec = Record(len(prompt), time.perf_counter() - t0)
    times: list[float] = []
    try:
        async with client.stream("POST", "/v1/completions", json=body) as r:
            r.raise_for_status()
            async for line in r.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                for c in json.loads(line[6:]).get("choices", []):
                    # servers that do not return token ids stream one token per chunk
                    n = len(c.get("token_ids") or []) or int(bool(c.get("text")))
                    times += [time.perf_counter() - t0] * n
    except httpx.HTTPError as e:
        rec.error = repr(e)
    if times:
        rec.first, rec.end, rec.tokens = times[0], times[-1], len(times)
        rec.gaps = [b - a for a, b in zip(times, times[1:])]
    return rec


async def run_load(url: str, prompts: list[list[int]], rate: float, max_tokens: int,
                   seed: int) -> tuple[list[Record], float]:
    """Sends the prompts at `rate` requests/s (Poisson; 0: all at once) after one warm-up
    request; returns their records and the wall time until the last one ended."""
    rng = random.Random(seed)
    async with httpx.AsyncClient(base_url=url, timeout=600) as client:
        model = (await client.get("/v1/models")).json()["data"][0]["id"]
        await _one(client, model, prompts[0][:16], 2, time.perf_counter())
        t0 = time.perf_counter()
        tasks = []
        for p in prompts:
            tasks.append(asyncio.create_task(_one(client, model, p, max_tokens, t0)))
            if rate > 0:
                await asyncio.sleep(rng.expovariate(rate))
        records = await asyncio.gather(*tasks)
    return list(records), time.perf_counter() - t0


def pct(xs: list[float], q: float) -> float:
    """The q-th percentile in milliseconds (nearest rank); nan for no values."""
    xs = sorted(x for x in xs if x == x)
    return xs[min(len(xs) - 1, int(q / 100 * len(xs)))] * 1000 if xs else float("nan")


def summarize(records: list[Record], wall: float, slo_ttft_s: float,
              slo_tpot_s: float) -> dict[str, float]:
    ok = [r for r in records if not r.error and r.tokens]
    good = [r for r in ok if r.ttft <= slo_ttft_s and (not r.gaps or r.tpot <= slo_tpot_s)]
    return {"requests": len(records), "failed": len(records) - len(ok),
            "out tok/s": sum(r.tokens for r in ok) / wall,
            "TTFT p50": pct([r.ttft for r in ok], 50), "TTFT p99": pct([r.ttft for r in ok], 99),
            "TPOT p50": pct([r.tpot for r in ok], 50), "TPOT p99": pct([r.tpot for r in ok], 99),
            "ITL p99": pct([g for r in ok for g in r.gaps], 99),
            "goodput req/s": len(good) / wall}


def records_json(records: list[Record]) -> list[dict]:
    return [{**asdict(r), "ttft": r.ttft, "tpot": r.tpot} for r in records]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch(model: str, up_args: list[str], log: Path) -> tuple[subprocess.Popen, str, str]:
    """`pdserve up` on free ports: (process, gateway url, scheduler address)."""
    port, sport = free_port(), free_port()
    proc = subprocess.Popen([str(Path(sys.executable).parent / "pdserve"), "up", "--model", model,
                             "--port", str(port), "--scheduler-port", str(sport), *up_args],
                            stdout=open(log, "w"), stderr=subprocess.STDOUT, cwd=ROOT)
    deadline = time.monotonic() + 300
    while "pdserve is up" not in log.read_text():
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            raise RuntimeError(log.read_text()[-3000:])
        time.sleep(0.3)
    return proc, f"http://127.0.0.1:{port}", f"127.0.0.1:{sport}"
