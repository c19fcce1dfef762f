"""Speculative decoding: `pdserve up` without speculation beside the same stack with n-gram
speculation, one stream at a time and several at once, at both ends of acceptance, in one run.

    .venv/bin/python benchmarks/speculative.py --model DIR [--k 4] [--out results/speculative]

Three workloads frame what prompt lookup can do with a random-weight model:
  repeat  prompts that repeat one random 8-token phrase, greedy: lookup proposes the phrase's
          continuation and the model follows it as long as it repeats it;
  high    random prompts, greedy, the output held by logit_bias to four tokens: its runs repeat
          and lookup is mostly right (what accepted drafts buy);
  low     random prompts, the output held to sixteen tokens and sampled at temperature 1: a
          2-token suffix has nearly always occurred before, so lookup proposes at every step,
          and the sampled token mostly differs (the cost of verifying drafts that are rejected).
ignore_eos, streamed; each request's tokens are counted from the token ids the stream carries (a
step of several accepted tokens arrives as one chunk). Acceptance is read from the
decode worker's counters (`pdserve stats`). Writes every request's timings and the summary as
JSON and a plot of tokens/s per stream beside it.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from loadgen import launch, records_json, run_load, stop  # noqa: E402

HIGH = (5, 17, 300, 1200)  # tokens the output is held to
LOW = tuple(range(1000, 1160, 10))
WORKLOADS = ("repeat", "high", "low")


def prompts(workload: str, n: int, length: int, rng: random.Random) -> list[list[int]]:
    if workload == "repeat":
        out = []
        for _ in range(n):
            phrase = [rng.randrange(0, 2000) for _ in range(8)]
            out.append((phrase * (length // 8 + 1))[:length])
        return out
    return [[rng.randrange(0, 2000) for _ in range(length)] for _ in range(n)]


def extra(workload: str) -> dict:
    if workload == "high":
        return {"logit_bias": {str(t): 30 for t in HIGH}}
    if workload == "low":
        return {"logit_bias": {str(t): 30 for t in LOW}, "temperature": 1.0}
    return {}


def spec_counters(sched: str) -> dict[str, int]:
    out = subprocess.run([str(Path(sys.executable).parent / "pdserve"), "stats", "--scheduler",
                          sched], capture_output=True, text=True, check=True, timeout=30)
    workers = json.loads(out.stdout)["workers"]
    keys = ("spec_decode_num_draft_tokens", "spec_decode_num_accepted_tokens", "tokens_decoded",
            "steps")
    return {k: sum(int(w.get(k, 0)) for w in workers if w["role"] == "decode") for k in keys}


def stream_rate(rec) -> float:
    """Tokens per second of one stream after its first token."""
    return (rec.tokens - 1) / (rec.end - rec.first) if rec.tokens > 1 else float("nan")


def measure(url: str, sched: str, workload: str, streams: int, args, seed: int) -> dict:
    rng = random.Random(seed)
    reqs = prompts(workload, args.requests * streams, args.prompt_len, rng)
    before = spec_counters(sched)
    records, wall = asyncio.run(run_load(url, reqs, 0, args.max_tokens, seed,
                                         label=f"{workload} x{streams}", extra=extra(workload),
                                         concurrency=streams))
    after = spec_counters(sched)
    delta = {k: after[k] - before[k] for k in after}
    failed = [r for r in records if r.error or r.tokens != args.max_tokens]
    assert not failed, failed[0]
    rates = [stream_rate(r) for r in records]
    return {
        "records": records_json(records),
        "output_tok_s": sum(r.tokens for r in records) / wall,
        "stream_tok_s_p50": statistics.median(rates),
        "stream_tok_s_min": min(rates), "stream_tok_s_max": max(rates),
        "acceptance": (delta["spec_decode_num_accepted_tokens"]
                       / delta["spec_decode_num_draft_tokens"]
                       if delta["spec_decode_num_draft_tokens"] else 0.0),
        "draft_tokens": delta["spec_decode_num_draft_tokens"],
        "accepted_tokens": delta["spec_decode_num_accepted_tokens"],
    }


def plot(results: dict, path: Path, title: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    cases = list(next(iter(results.values())))
    fig, ax = plt.subplots(figsize=(8, 4))
    width = 0.8 / len(results)
    for i, (mode, by_case) in enumerate(results.items()):
        xs = [j + i * width for j in range(len(cases))]
        mid = [by_case[c]["stream_tok_s_p50"] for c in cases]
        lo = [m - by_case[c]["stream_tok_s_min"] for c, m in zip(cases, mid)]
        hi = [by_case[c]["stream_tok_s_max"] - m for c, m in zip(cases, mid)]
        ax.bar(xs, mid, width, yerr=[lo, hi], capsize=3, label=mode)
    ax.set_xticks([j + width * (len(results) - 1) / 2 for j in range(len(cases))], cases)
    ax.set_ylabel("tokens/s per stream (median, min-max)")
    ax.set_title(title)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", required=True)
    p.add_argument("--k", type=int, default=4, help="num_speculative_tokens")
    p.add_argument("--streams", type=int, nargs="+", default=[1, 8],
                   help="requests in flight at once, one run each")
    p.add_argument("--requests", type=int, default=4, help="requests per stream")
    p.add_argument("--prompt-len", type=int, default=128)
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--workloads", nargs="+", default=list(WORKLOADS), choices=WORKLOADS)
    p.add_argument("--draft", default="",
                   help="a draft model directory: its mode replaces n-gram's (make_bench_model.py "
                        "--draft-layers makes DIR-draft, agreeing, and DIR-other-draft)")
    p.add_argument("--other-draft", default="", help="a second draft, run as a mode of its own")
    p.add_argument("--mode", action="append", default=[], metavar="NAME=FLAGS",
                   help="instead of the modes above, `pdserve up` with these flags under this "
                        "name (repeatable; the first is the baseline), e.g. "
                        "'multi-step 4=--num-scheduler-steps 4'")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--up-args", default="", help="more `pdserve up` flags for both stacks")
    p.add_argument("--out", type=Path, default=Path("benchmarks/results/speculative"))
    args = p.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    config = json.dumps({"method": "ngram", "num_speculative_tokens": args.k,
                         "prompt_lookup_min": 2, "prompt_lookup_max": 4})
    modes = {"off": [], f"ngram k={args.k}": ["--speculative-config", config]}
    if args.draft:
        modes = {"off": []}
        for name, path in (("draft", args.draft), ("other draft", args.other_draft)):
            if path:
                modes[f"{name} k={args.k}"] = ["--speculative-config", json.dumps(
                    {"model": path, "num_speculative_tokens": args.k})]
    if args.mode:
        modes = dict((name, flags.split()) for name, _, flags in
                     (m.partition("=") for m in args.mode))
    results: dict[str, dict[str, dict]] = {}
    for i, (mode, flags) in enumerate(modes.items()):
        proc, url, sched = launch(args.model, flags + args.up_args.split(),
                                  args.out / f"stack-{i}.log")
        try:
            results[mode] = {f"{w} x{s}": measure(url, sched, w, s, args, args.seed + 7 * j)
                             for j, (w, s) in enumerate((w, s) for w in args.workloads
                                                        for s in args.streams)}
        finally:
            stop([proc])
    (args.out / "results.json").write_text(json.dumps(
        {"args": {k: str(v) for k, v in vars(args).items()}, "results": results}, indent=1))
    base = next(iter(results.values()))
    head = ("case", "mode", "out tok/s", "stream tok/s p50 (min-max)", "vs off", "acceptance")
    print(f"{head[0]:>10} {head[1]:>16} {head[2]:>10} {head[3]:>28} {head[4]:>7} {head[5]:>10}")
    for mode, by_case in results.items():
        for case, r in by_case.items():
            ratio = r["stream_tok_s_p50"] / base[case]["stream_tok_s_p50"]
            spread = (f"{r['stream_tok_s_p50']:.1f} ({r['stream_tok_s_min']:.1f}-"
                      f"{r['stream_tok_s_max']:.1f})")
            acc = f"{r['acceptance']:.2f}" if r["draft_tokens"] else "-"
            print(f"{case:>10} {mode:>16} {r['output_tok_s']:>10.1f} {spread:>28} "
                  f"{ratio:>6.2f}x {acc:>10}")
    plot(results, args.out / "tokens_per_stream.png",
         f"{Path(args.model).name}: speculation off vs on, {args.max_tokens} tokens each")
    print(f"wrote {args.out}/results.json and tokens_per_stream.png")
    return 0


if __name__ == "__main__":
    sys.exit(main())
