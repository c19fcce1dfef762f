"""Shared-prefix workload: one long system prompt, many short questions. TTFT percentiles and
the prompt tokens the prefill workers actually computed, prefix caching on versus off, in one run.

    .venv/bin/python benchmarks/prefix_cache.py
"""
from __future__ import annotations

import argparse
import asyncio
import json
import signal
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from loadgen import launch, run_load, shared_prefix, summarize  # noqa: E402
from serve import print_table  # noqa: E402

SHAPES = {
    "prefix caching on": [],
    "prefix caching off": ["--scheduler-args=--no-enable-prefix-caching"],
}


def prefill_tokens(sched: str) -> int:
    out = subprocess.run([str(Path(sys.executable).parent / "pdserve"), "stats", "--scheduler",
                          sched], capture_output=True, text=True, check=True, timeout=30)
    return sum(w["prompt_tokens_computed"] for w in json.loads(out.stdout)["workers"])


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="models/tiny-llama")
    p.add_argument("--num-requests", type=int, default=60)
    p.add_argument("--rate", type=float, default=8.0, help="requests/s (Poisson)")
    p.add_argument("--system-len", type=int, default=1500)
    p.add_argument("--question", type=int, nargs=2, default=[20, 60])
    p.add_argument("--max-tokens", type=int, default=16)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args()
    if not Path(args.model, "config.json").exists():
        from common.models.tiny import make_tiny_model
        make_tiny_model(args.model)
    prompts = shared_prefix(args.num_requests, args.system_len, tuple(args.question), args.seed)
    total = sum(map(len, prompts))
    print(f"{len(prompts)} requests: a {args.system_len}-token system prompt + {args.question} "
          f"question tokens ({total} prompt tokens in all), {args.max_tokens} output tokens, "
          f"{args.rate} req/s")
    rows = {}
    for name, shape in SHAPES.items():
        log = Path(f"/tmp/pdserve-bench-prefix-{name.split()[-1]}.log")
        proc, url, sched = launch(args.model, shape, log)
        try:
            base = prefill_tokens(sched)
            results, wall = asyncio.run(run_load(url, prompts, args.rate, args.max_tokens,
                                                 args.seed, name))
            computed = prefill_tokens(sched) - base
        finally:
            proc.send_signal(signal.SIGINT)
            proc.wait(30)
        row = summarize(results, wall, slo_ttft_s=2.0, slo_tpot_s=0.1)
        row["prefill tokens"] = computed
        rows[name] = row
    print_table(rows)
    print("(prefill tokens: prompt tokens the workers computed, warm-up request included)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
