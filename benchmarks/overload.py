"""Overload: requests arriving at several times what `pdserve up` can serve, for a bounded
time, against its defaults (a bounded waiting queue) and, beside them in one run, shapes with
other limits. Per shape: requests sent, answered 200, refused 429 (with Retry-After) and failed
otherwise, and every service process's resident memory (RSS) sampled each second: its peak and
its value at the end of the load, which stay bounded when the queue is.

    .venv/bin/python benchmarks/overload.py --factor 10 --seconds 20 --max-tokens 16 \\
        --shape "defaults=" --shape "unbounded=--scheduler-args='--max-waiting-requests 0'"

First measures the served rate (requests/s of --max-tokens tokens at saturation, one minute at
most), then sends Poisson arrivals at --factor times it. Writes overload.json and overload.png
(RSS over time per process) to --out.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import shlex
import signal
import sys
import tempfile
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))
from loadgen import VOCAB, launch  # noqa: E402

SERVICES = ("scheduler", "gateway", "prefill-worker", "decode-worker")


def rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return 0.0


def service_pids(launcher: int) -> dict[str, int]:
    """The launcher's children by role (the first of each)."""
    out: dict[str, int] = {}
    for d in Path("/proc").iterdir():
        try:
            if d.name.isdigit() and (d / "stat").read_text().split()[3] == str(launcher):
                cmd = (d / "cmdline").read_bytes().replace(b"\0", b" ").decode()
                role = next((r for r in SERVICES if f"pdserve {r}" in cmd), None)
                if role is not None:
                    out.setdefault(role, int(d.name))
        except OSError:
            pass
    return out


async def one(client: httpx.AsyncClient, model: str, prompt: list[int], max_tokens: int,
              outcomes: dict[str, int]) -> None:
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
            "ignore_eos": True}
    try:
        r = await client.post("/v1/completions", json=body)
        key = str(r.status_code)
        if r.status_code == 429 and "retry-after" not in r.headers:
            key = "429 without Retry-After"
    except httpx.HTTPError as e:
        key = type(e).__name__
    outcomes[key] = outcomes.get(key, 0) + 1


async def served_rate(url: str, model: str, max_tokens: int, concurrency: int) -> float:
    """Requests/s at saturation: `concurrency` clients back to back for 20 s (or 60 requests
    each at most)."""
    rng = random.Random(1)
    done = 0
    stop = time.monotonic() + 20

    async def client_loop(client: httpx.AsyncClient) -> None:
        nonlocal done
        for _ in range(60):
            if time.monotonic() > stop:
                return
            await one(client, model, [rng.randrange(VOCAB) for _ in range(128)], max_tokens, {})
            done += 1

    start = time.monotonic()
    async with httpx.AsyncClient(base_url=url, timeout=120) as client:
        await asyncio.gather(*(client_loop(client) for _ in range(concurrency)))
    return done / (time.monotonic() - start)


async def overload(url: str, launcher: int, rate: float, seconds: float, max_tokens: int,
                   seed: int) -> dict:
    rng = random.Random(seed)
    pids = service_pids(launcher)
    samples: dict[str, list[tuple[float, float]]] = {role: [] for role in pids}
    outcomes: dict[str, int] = {}
    start = time.monotonic()
    sampling = True

    async def sample_rss() -> None:
        while sampling:
            for role, pid in pids.items():
                samples[role].append((time.monotonic() - start, rss_mib(pid)))
            await asyncio.sleep(1.0)

    limits = httpx.Limits(max_connections=None, max_keepalive_connections=64)
    async with httpx.AsyncClient(base_url=url, timeout=300, limits=limits) as client:
        model = (await client.get("/v1/models")).json()["data"][0]["id"]
        sampler = asyncio.create_task(sample_rss())
        tasks, sent, t = [], 0, 0.0
        while t < seconds:
            t += rng.expovariate(rate)
            await asyncio.sleep(max(0.0, start + t - time.monotonic()))
            prompt = [rng.randrange(VOCAB) for _ in range(128)]
            tasks.append(asyncio.create_task(one(client, model, prompt, max_tokens, outcomes)))
            sent += 1
        end_of_load = {role: rss_mib(pid) for role, pid in pids.items()}
        await asyncio.gather(*tasks)
        sampling = False
        await sampler
    return {"sent": sent, "outcomes": outcomes, "rate": rate,
            "rss_peak_mib": {r: max(v for _, v in s) for r, s in samples.items()},
            "rss_end_of_load_mib": end_of_load, "rss_samples": samples,
            "wall_s": time.monotonic() - start}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="models/tiny-llama")
    p.add_argument("--shape", action="append", default=[], metavar="NAME=UP_FLAGS",
                   help="a pdserve up shape (repeatable); default: defaults=")
    p.add_argument("--factor", type=float, default=10.0, help="times the served rate")
    p.add_argument("--seconds", type=float, default=40.0, help="how long arrivals go on")
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default="benchmarks/results/overload")
    args = p.parse_args()
    shapes = dict(s.split("=", 1) for s in args.shape) or {"defaults": ""}
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    results = {}
    for name, flags in shapes.items():
        log = Path(tempfile.gettempdir()) / f"pdserve-overload-{name}.log"
        proc, url, _ = launch(args.model, shlex.split(flags), log)
        try:
            async def measure() -> dict:
                async with httpx.AsyncClient(base_url=url, timeout=30) as c:
                    model = (await c.get("/v1/models")).json()["data"][0]["id"]
                rate = await served_rate(url, model, args.max_tokens, 16)
                print(f"{name}: served {rate:.2f} req/s; sending {args.factor:g}x that for "
                      f"{args.seconds:g} s", flush=True)
                return await overload(url, proc.pid, rate * args.factor, args.seconds,
                                      args.max_tokens, args.seed)
            results[name] = asyncio.run(measure())
        finally:
            os.kill(proc.pid, signal.SIGINT)
            proc.wait(60)
        r = results[name]
        print(f"  sent {r['sent']}: {r['outcomes']}; RSS MiB peak / end of load: " + ", ".join(
            f"{role} {r['rss_peak_mib'][role]:.0f} / {r['rss_end_of_load_mib'][role]:.0f}"
            for role in r["rss_peak_mib"]), flush=True)
    (out / "overload.json").write_text(json.dumps(
        {"factor": args.factor, "seconds": args.seconds, "max_tokens": args.max_tokens,
         "shapes": results}, indent=1))
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, axes = plt.subplots(1, len(results), figsize=(6 * len(results), 4), squeeze=False)
    for ax, (name, r) in zip(axes[0], results.items()):
        for role, s in r["rss_samples"].items():
            ax.plot([t for t, _ in s], [v for _, v in s], label=role)
        ax.axvline(args.seconds, color="grey", linestyle=":")
        ax.set_title(f"{name}: {r['outcomes']}", fontsize=8)
        ax.set_xlabel("seconds")
        ax.set_ylabel("RSS (MiB)")
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(out / "overload.png", dpi=110)
    print(f"wrote {out}/")
    return 0


if __name__ == "__main__":
    sys.exit(main())
