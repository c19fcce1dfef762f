"""Decode step time on a GPU worker, eager beside CUDA graphs, in one run.

    python benchmarks/decode_step.py --model DIR [--dtype bfloat16] [--context 512]
        [--batches 1 8 32 64 128 256] [--out results/decode_step]

Builds the decode worker a user gets (`build_worker`), prefills `max(batches)` requests of
`--context` random tokens, then times whole decode steps (`Worker.execute` of a StepPlan: inputs,
forward, logits, sampling, the step's result) at each batch size: the median of `--steps` steps
after warm-up, with the 10th-90th percentile spread. Batch 1 is single-stream ITL without the
network. Writes a JSON of the figures and a plot beside it.
"""
from __future__ import annotations

import argparse
import gc
import json
import statistics
import sys
import time
import uuid
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from common.worker.config import WorkerConfig  # noqa: E402
from common.worker.service import build_worker  # noqa: E402
from common.plans import NewRequest, ScheduledTokens, StepPlan  # noqa: E402
from common.sampling_params import SamplingParams  # noqa: E402


def time_steps(worker, num: int, batch: int, steps: int, first_step: int) -> list[float]:
    times = []
    for k in range(steps + 3):
        plan = StepPlan(first_step + k,
                        scheduled=[ScheduledTokens(f"r{i}", 1) for i in range(batch)])
        torch.cuda.synchronize()
        start = time.perf_counter()
        worker.execute(plan)  # returns after sampling: the tokens are on the host
        if k >= 3:
            times.append((time.perf_counter() - start) * 1e3)
    return times


def measure(args, eager: bool) -> dict[int, list[float]]:
    n = max(args.batches)
    blocks_per = -(-(args.context + 16 * args.steps + 64) // 16)
    w, _ = build_worker(WorkerConfig(
        role="decode", model=args.model, worker_id=f"bench-{uuid.uuid4().hex[:6]}",
        num_kv_blocks=n * blocks_per, device="cuda", dtype=args.dtype, enforce_eager=eager,
        max_cudagraph_capture_size=max(args.batches)))
    g = torch.Generator().manual_seed(0)
    step = 0
    for lo in range(0, n, 16):  # prefill 16 prompts a step
        plan = StepPlan(step)
        for i in range(lo, min(n, lo + 16)):
            prompt = tuple(torch.randint(0, 32000, (args.context,), generator=g).tolist())
            plan.new_requests.append(NewRequest(
                f"r{i}", prompt, len(prompt), 0,
                tuple(range(i * blocks_per, (i + 1) * blocks_per)),
                SamplingParams(max_tokens=1 << 20)))
            plan.scheduled.append(ScheduledTokens(f"r{i}", len(prompt)))
        w.execute(plan)
        step += 1
    out = {}
    for b in args.batches:
        out[b] = time_steps(w, n, b, args.steps, step)
        step += args.steps + 3
    w.cache.close()
    del w
    gc.collect()
    torch.cuda.empty_cache()
    return out


def spread(ms: list[float]) -> tuple[float, float, float]:
    q = statistics.quantiles(ms, n=10)
    return statistics.median(ms), q[0], q[-1]


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", required=True)
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--context", type=int, default=512)
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--batches", type=int, nargs="+", default=[1, 8, 32, 64, 128, 256])
    p.add_argument("--out", default="benchmarks/results/decode_step")
    args = p.parse_args()
    if not torch.cuda.is_available():
        p.error("decode steps from CUDA graphs need a GPU")
    results = {"eager": measure(args, True), "graphs": measure(args, False)}
    print(f"{torch.cuda.get_device_name()}, {args.model}, {args.dtype}, context {args.context}: "
          "decode step ms, median [p10, p90]")
    print(f"{'batch':>6} {'eager':>22} {'CUDA graphs':>22} {'speed-up':>9}")
    rows = []
    for b in args.batches:
        e, gr = spread(results["eager"][b]), spread(results["graphs"][b])
        rows.append({"batch": b, "eager_ms": e, "graphs_ms": gr})
        print(f"{b:>6} {e[0]:>8.2f} [{e[1]:.2f}, {e[2]:.2f}] {gr[0]:>8.2f} [{gr[1]:.2f}, "
              f"{gr[2]:.2f}] {e[0] / gr[0]:>8.2f}x")
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    meta = {"device": torch.cuda.get_device_name(), "model": args.model, "dtype": args.dtype,
            "context": args.context, "steps": args.steps}
    out.with_suffix(".json").write_text(json.dumps({**meta, "rows": rows}, indent=1))
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(6, 4))
    for key, label in (("eager_ms", "eager"), ("graphs_ms", "CUDA graphs")):
        med = [r[key][0] for r in rows]
        err = [[m - r[key][1] for m, r in zip(med, rows)], [r[key][2] - m for m, r in
                                                             zip(med, rows)]]
        ax.errorbar(args.batches, med, yerr=err, marker="o", capsize=3, label=label)
    ax.set_xscale("log", base=2)
    ax.set_xlabel("decode batch (sequences)")
    ax.set_ylabel("step time, ms (median, p10-p90)")
    ax.set_title(f"decode step, {meta['device']}, {args.dtype}, context {args.context}")
    ax.legend()
    fig.tight_layout()
    fig.savefig(out.with_suffix(".png"), dpi=120)
    print(f"wrote {out.with_suffix('.json')} and {out.with_suffix('.png')}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
