"""Where each request's time goes, from its spans: starts `pdserve up` exporting traces to an
OTLP receiver run here, sends prompts one at a time (after the load client's warm-up request),
and prints per request the client's TTFT beside each phase the services traced (tokenize, queue,
placement, prefill steps, KV send and receive, decode steps), as start and end in ms from the
request's arrival at the gateway. A first request slower than the next shows which phase pays.

    .venv/bin/python benchmarks/request_spans.py --model DIR [--up-args "--device cuda"]
        [--prompts 128 128 1024 3000] [--max-tokens 8] [--out FILE.json]
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import shlex
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from spans import EXPORT_DELAY_MS, Receiver, decoded, wait_complete  # noqa: E402

# the phases printed, in the order a request meets them; others are kept in --out only
PHASES = ("gateway.tokenize", "scheduler.queue", "scheduler.placement", "worker.prefill",
          "kv.send", "kv.receive", "worker.decode_step", "worker.decode")


def phase_table(trace: dict) -> list[str]:
    """A request's phases: each name with its spans' count, first start, last end and summed
    time (ms from the request's arrival at the gateway)."""
    lines = []
    for name in PHASES:
        rows = [r for r in trace["spans"] if r[1] == name]
        if rows:
            busy = sum(end - start for _, _, start, end, _ in rows)
            lines.append(f"    {name:<20} x{len(rows):<3} {rows[0][2]:9.1f} .. "
                         f"{max(r[3] for r in rows):9.1f} ms  ({busy:.1f} ms in them)")
    return lines


def wait_for(receiver: Receiver, n: int, timeout_s: float = 30.0) -> list[dict]:
    """The traces of n requests once each has its spans from the gateway, scheduler and
    workers: spans are exported in batches, a request's last ones after it has ended, and a
    prefill worker at a low CPU priority may export its steps after the decode worker exported
    the whole decode (`spans.wait_complete`, over the requests whose trace holds its gateway
    span and its decode)."""
    traces, _ = wait_complete(
        receiver.snapshot, lambda traces: [t for t in traces if decoded(t) and any(
            r[1] == "gateway.generate" for r in t["spans"])], n, timeout_s)
    return traces


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", required=True)
    p.add_argument("--up-args", default="", help="more flags for `pdserve up`, one string")
    p.add_argument("--prompts", type=int, nargs="+", default=[128, 128, 1024, 3000],
                   help="prompt lengths in tokens, sent in this order one at a time")
    p.add_argument("--max-tokens", type=int, default=8)
    p.add_argument("--out", type=Path, help="every request's spans as JSON")
    args = p.parse_args()

    from loadgen import launch, run_load, stop, workload

    receiver = Receiver()
    log = Path(tempfile.gettempdir()) / "pdserve-request-spans.log"
    flags = [*shlex.split(args.up_args), "--detailed-traces",
             "--otlp-traces-endpoint", receiver.endpoint]
    os.environ["OTEL_BSP_SCHEDULE_DELAY"] = EXPORT_DELAY_MS
    proc, url, _ = launch(args.model, flags, log)
    try:
        tokens = workload("random", 1, 0)[0] * (max(args.prompts) // 256 + 1)
        prompts = [tokens[i:i + n] for i, n in enumerate(args.prompts)]  # each its own
        records, _ = asyncio.run(run_load(url, prompts, -1, args.max_tokens, 0))
        traces = wait_for(receiver, len(prompts) + 1)
    finally:
        stop([proc])
        receiver.close()
    warm_up = traces[:-len(prompts)]  # the load client's warm-up request's trace comes first
    traces = traces[-len(prompts):]
    if warm_up:  # the first request a fresh stack serves: what start-up left to it shows here
        span = warm_up[0]["spans"]
        print(f"warm-up request: {max(r[3] for r in span):.1f} ms from arrival to its last span")
        print("\n".join(phase_table(warm_up[0])))
    for rec, trace in zip(records, traces):
        print(f"{rec.prompt_tokens} prompt tokens: TTFT {rec.ttft * 1000:.1f} ms (client), "
              f"first gap {rec.gaps[0] * 1000 if rec.gaps else float('nan'):.1f} ms")
        print("\n".join(phase_table(trace)))
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(
            [{"prompt_tokens": r.prompt_tokens, "ttft_ms": r.ttft * 1000,
              "gaps_ms": [g * 1000 for g in r.gaps], "spans": t["spans"]}
             for r, t in zip(records, traces)]
            + [{"warm_up": True, "spans": t["spans"]} for t in warm_up], indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
