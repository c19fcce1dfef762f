"""The sampler's cost per decode step: a batch of rows over a 32000-token vocabulary, greedy, at
temperature 1, and with top_p over a peaked distribution (a few dozen tokens hold most of the
mass, as a trained model's usually do: the nucleus is found among the candidates) and a flat
one (random weights: the whole row is sorted), drawn through torch's generators and through
the CPU race kernel (kernels/csrc/sampling.cpp), on 1 and 2 threads, in one run.

    .venv/bin/python benchmarks/sampler.py [--rows 64] [--vocab 32000] [--reps 20]

Prints the median [min-max] ms per call of Sampler(logits, rows) and writes sampler.json to
--out.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks.attention import cpu_flags  # noqa: E402
from common.sampling_params import SamplingParams  # noqa: E402
from common.worker.sampler import Sampler, SamplingRequest  # noqa: E402
from kernels import cpu_attention  # noqa: E402

CASES = {  # name: (sampling params, peaked logits)
    "greedy": ({"temperature": 0.0}, False), "temperature 1": ({"temperature": 1.0}, False),
    "top_p 0.9, peaked": ({"temperature": 0.8, "top_p": 0.9}, True),
    "top_p 0.9, flat": ({"temperature": 0.8, "top_p": 0.9}, False)}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--rows", type=int, default=64)
    p.add_argument("--vocab", type=int, default=32000)
    p.add_argument("--reps", type=int, default=20)
    p.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    p.add_argument("--out", default=str(Path(__file__).parent / "results"))
    args = p.parse_args()
    gen = torch.Generator().manual_seed(0)
    flat = torch.randn((args.rows, args.vocab), generator=gen) * 3
    peaked = flat.clone()
    likely = torch.randint(0, args.vocab, (args.rows, 32), generator=gen)
    peaked.scatter_add_(1, likely, torch.full(likely.shape, 12.0))
    paths = {"torch generators": Sampler(args.vocab),
             "cpu race kernel": Sampler(args.vocab, cpu_kernels=cpu_attention.load())}
    print(f"CPU flags: {cpu_flags()}; {args.rows} rows x {args.vocab} tokens, ms per call")
    results = []
    for threads in args.threads:
        torch.set_num_threads(threads)
        for case, (params, is_peaked) in CASES.items():
            logits = peaked if is_peaked else flat
            rows = [SamplingRequest(SamplingParams(max_tokens=16, **params), [1, 2, 3], [4],
                                    [0], 4) for _ in range(args.rows)]
            cells = {}
            for name, sampler in paths.items():
                sampler(logits, rows)  # warm
                times = []
                for _ in range(args.reps):
                    start = time.perf_counter()
                    sampler(logits, rows)
                    times.append((time.perf_counter() - start) * 1e3)
                cells[name] = {"ms": statistics.median(times), "min": min(times),
                               "max": max(times)}
            results.append({"threads": threads, "case": case, **cells})
            print(f"{threads} thr  {case:<28}" + "".join(
                f"  {n}: {c['ms']:6.2f} [{c['min']:.2f}-{c['max']:.2f}]"
                for n, c in cells.items()), flush=True)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "sampler.json").write_text(json.dumps(
        {"cpu_flags": cpu_flags(), "rows": args.rows, "vocab": args.vocab, "results": results},
        indent=1))
    print(f"wrote {out / 'sampler.json'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
