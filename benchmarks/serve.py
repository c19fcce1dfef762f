"""Serving benchmark: a named workload against pdserve shapes and any OpenAI-compatible baseline
(vLLM, say), with the same client for all, side by side in one run.

    .venv/bin/python benchmarks/serve.py --model DIR --workload bimodal \\
        --baseline vllm=http://127.0.0.1:8100 --shapes default colocated --out docs/bench/bimodal
    .venv/bin/python benchmarks/serve.py --workload random --rate 0          # saturation
    .venv/bin/python benchmarks/serve.py --rates 0.5 1 1.5 2                 # goodput sweep
    .venv/bin/python benchmarks/serve.py --workload idle --num-requests 9    # idle TTFT

Workloads (loadgen.py): random, bimodal, mixed, shared-prefix (token ids, any model) and chat
(real text for a chat model, `--model smollm2`); idle sends 128/1024/3000-token prompts one
request at a time. Each target gets the same prompts at the same Poisson arrival times; each
rate of a sweep draws its own (the servers' prefix caches would hold the first rate's). Writes
to --out: requests.json (every request's timings, per target and rate), summary.json,
ttft_tpot_cdf.png, timeline.png and, with several rates, goodput.png; prints a table with each
target's ratio to the first one (the baseline, if given), and for idle the median TTFT per
prompt length.
`--replot DIR` redraws a run's figures and table from its JSON files.

`--spans [PORT]` runs an OTLP receiver here (on PORT, or any free port) and has the launched
shapes export their traces to it; a pdserve stack passed as a baseline joins in when it was
started with `--otlp-traces-endpoint http://127.0.0.1:PORT`. Each request's spans (queue,
prefill steps and the worker they ran on, KV send, decode) then go into requests.json and the
timeline, and the table lists where each long prompt's time went. Tracing costs the services a
little: compare figures of runs made the same way.

`--cores` samples every process's CPU time and the machine's idle time while each target
serves (cores.py): cores.json and cores.png beside the rest, and a line per target under the
table (the load client is `serve.py`; the target not being measured waits, near 0).

`--seeds S1 S2 ...` runs one draw of the workload per seed against the same servers (launched
once), turning the order of the targets by one place from each seed to the next (a server
measured right after another one finds the machine in the state that one left: caches, memory,
clocks), each seed's files in DIR/seed-S; then prints, per target, the median and range of its
ratios to the first target over the seeds, and writes them to DIR/seeds.json.
"""
from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import shlex
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import cores  # noqa: E402
import plots  # noqa: E402
import spans  # noqa: E402
from loadgen import (  # noqa: E402
    LONG_PROMPTS,
    WORKLOADS,
    Record,
    launch,
    records_json,
    run_load,
    stop,
    summarize,
    ttft_by_length,
    workload,
)

SHAPES = {  # --shapes key: (row name, `pdserve up` flags)
    "default": ("pdserve (defaults)", []),
    "disagg": ("pdserve 1P+1D", ["--prefill-workers", "1", "--decode-workers", "1"]),
    "static": ("pdserve 1P+1D static split",  # one core each, every prompt through P
               ["--prefill-workers", "1", "--decode-workers", "1", "--pin-cpus",
                "--scheduler-args=--prefill-bypass-threshold 0 --no-saturated-prefill-bypass"]),
    "no-saturated-bypass": ("pdserve 1P+1D, no saturated bypass",  # long prompts wait for P
                            ["--scheduler-args=--no-saturated-prefill-bypass"]),
    "fixed-held-chunk": ("pdserve, 32-token chunks beside the batch",  # no step-time target
                         ["--scheduler-args=--decode-step-target-ms=0"]),
    "colocated": ("pdserve colocated 0P+2D", ["--mode", "colocated", "--decode-workers", "2"]),
    "hold-margin-2": ("pdserve, decode hold margin 2",  # long prompts held on D only if 2x sooner
                      ["--scheduler-args=--decode-hold-margin 2"]),
    "take-back": ("pdserve, prefill take-back",  # P takes a long prompt back from D
                  ["--scheduler-args=--prefill-take-back"]),
    "unpriced-holds": ("pdserve, holds not priced",  # D holds whatever its batch loses
                       ["--scheduler-args=--no-price-holds"]),
    "eager": ("pdserve, no CUDA graphs",  # GPU: every decode step launches its kernels
              ["--prefill-worker-args=--enforce-eager", "--decode-worker-args=--enforce-eager"]),
    "torch-attention": ("pdserve, gather + SDPA attention",  # before the paged CPU kernels
                        ["--prefill-worker-args=--attention-backend torch",
                         "--decode-worker-args=--attention-backend torch"]),
    "offload": ("pdserve, 1 GiB KV tier per worker", ["--kv-offloading-size", "1"]),
    "offload-host": ("pdserve, 1 GiB KV tier per host", ["--kv-offloading-size", "1",
                                                        "--kv-offloading-backend", "host"]),
    "disagg-sync": ("pdserve 1P+1D, no async sched.",
                    ["--prefill-workers", "1", "--decode-workers", "1",
                     "--scheduler-args=--no-async-scheduling"]),
    "disagg-1partial": ("pdserve 1P+1D, 1 partial prefill",
                        ["--prefill-workers", "1", "--decode-workers", "1",
                         "--scheduler-args=--max-num-partial-prefills 1"]),
}
# in the summary table: which way is better for each column; the counts are not compared
COUNTS = ("requests", "failed")
HIGHER_IS_BETTER = {"out tok/s", "goodput req/s"}


def print_table(rows: dict[str, dict[str, float]]) -> None:
    """One row per target; after the first, each figure with its ratio to the first's."""
    names = list(rows)
    keys = [k for k in rows[names[0]] if k not in COUNTS]
    print(f"{'':34}" + "".join(f"{k:>20}" for k in keys))
    for name in names:
        cells = []
        for k in keys:
            v, base = rows[name][k], rows[names[0]][k]
            ratio = f" ({v / base:.2f}x)" if name != names[0] and base else ""
            cells.append(f"{v:.1f}{ratio}")
        print(f"{name[:34]:34}" + "".join(f"{c:>20}" for c in cells))
    print(f"(ms; percentiles over requests, ITL over gaps; ratios to {names[0]}; "
          f"{', '.join(sorted(HIGHER_IS_BETTER))}: higher is better, the rest lower)")


def load(out: Path) -> tuple[dict, dict[str, dict[float, list[Record]]],
                             dict[str, dict[float, dict[str, float]]]]:
    """A run's metadata, records and summaries, as serve.py wrote them."""
    summary = json.loads((out / "summary.json").read_text())
    raw = json.loads((out / "requests.json").read_text())
    fields = {f for f in Record.__dataclass_fields__}
    records = {n: {float(r): [Record(**{k: v for k, v in rec.items() if k in fields})
                              for rec in recs] for r, recs in by.items()}
               for n, by in raw.items()}
    summaries = {n: {float(r): s for r, s in by.items()}
                 for n, by in summary.pop("targets").items()}
    return summary, records, summaries


def report(out: Path, meta: dict, records: dict[str, dict[float, list[Record]]],
           summaries: dict[str, dict[float, dict[str, float]]]) -> None:
    """The figures and the table of one run."""
    rates = list(next(iter(records.values())))
    first = rates[0]
    title = f"{meta['workload']}, {meta['requests']} requests {_at(first)}"
    plots.cdfs({n: by[first] for n, by in records.items()}, out / "ttft_tpot_cdf.png", title)
    plots.timeline({n: by[first] for n, by in records.items()}, out / "timeline.png", title)
    if len(rates) > 1:
        plots.goodput({n: [(r, s["goodput req/s"]) for r, s in by.items()]
                       for n, by in summaries.items()}, out / "goodput.png",
                      f"{meta['workload']}: TTFT <= {meta['slo_ttft_ms']:.0f} ms and TPOT <= "
                      f"{meta['slo_tpot_ms']:.0f} ms")
    for rate in rates:
        print(f"\n{meta['workload']} {_at(rate)}")
        print_table({n: by[rate] for n, by in summaries.items()})
    for name, by in records.items():
        if any(r.phases for r in by[first]):
            print(f"\n{name}: long prompts {_at(first)}, from the server's spans")
            print("\n".join(long_prompts(by[first], LONG_PROMPTS.get(meta["workload"],
                                                                    (0, (1000,)))[1][0])))
    if (out / "cores.json").exists():
        used = json.loads((out / "cores.json").read_text())
        plots.cores({n: by[str(first)] for n, by in used.items()}, out / "cores.png", title)
        for rate in rates:
            print(f"\nwhere the cores went, {_at(rate)}")
            for name, by in used.items():
                print(f"{name[:34]:34}{cores.line(by[str(rate)])}")
    if meta["workload"] == "idle":
        print("\nmedian TTFT by prompt length, one request at a time")
        print_table({n: {f"{k} tok": v for k, v in ttft_by_length(by[first]).items()}
                     for n, by in records.items()})


def long_prompts(records: list[Record], long_at: int) -> list[str]:
    """A line per traced prompt of long_at tokens or more, in arrival order: when it came, its
    TTFT, and where that went (s): queued, prefill steps on a prefill worker and on the
    decode worker (first start to last end, and how many), the KV send; and where the
    scheduler priced a hold, the times it expected for the prompt on the decode worker and
    on a prefill worker, and the seconds it expected the batch to lose."""
    lines = [f"{'arrived':>8} {'tokens':>6} {'TTFT':>6} {'queued':>6}  {'prefill worker':>20}  "
             f"{'decode worker':>20} {'KV':>5}  {'est here':>8} {'there':>6} {'loss':>6}"]
    for r in sorted(records, key=lambda r: r.start):
        if r.prompt_tokens < long_at or not r.phases:
            continue
        cells = []
        for phase in ("prefill", "local"):
            steps = [(a, b) for p, a, b, *_ in r.phases if p == phase]
            cells.append(f"{steps[0][0] - r.start:6.2f}-{max(b for _, b in steps) - r.start:6.2f} "
                         f"x{len(steps):<3}" if steps else "")
        queued = sum(b - a for p, a, b, *_ in r.phases if p == "queue")
        kv = sum(b - a for p, a, b, *_ in r.phases if p == "kv")
        est = ""
        if r.hold:
            loss, here, gain, _ = r.hold
            est = f"  {here:8.2f} {here + gain:6.2f} {loss:6.2f}"
        lines.append(f"{r.start:8.2f} {r.prompt_tokens:6d} {r.ttft:6.2f} {queued:6.2f}  "
                     f"{cells[0]:>20}  {cells[1]:>20} {kv:5.2f}{est}")
    return lines


def _at(rate: float) -> str:
    return f"at {rate} req/s" if rate > 0 else "one at a time" if rate < 0 else "all at once"


def targets(args) -> list[tuple[str, str | None, list[str]]]:
    """(row name, URL of a running server or None to launch, `pdserve up` flags)."""
    out: list[tuple[str, str | None, list[str]]] = []
    for spec in args.baseline:
        name, _, url = spec.rpartition("=")
        out.append((name or url, url, []))
    traced = ["--otlp-traces-endpoint", args.receiver.endpoint] \
        if getattr(args, "receiver", None) is not None else []
    launched = [(SHAPES[key][0], SHAPES[key][1] + shlex.split(args.up_args) + traced)
                for key in args.shapes]
    for name, flags in launched:
        out.append((name, None, flags + _gpu_share(flags, len(launched))))
    return out


def _gpu_share(flags: list[str], stacks: int) -> list[str]:
    """The stacks run side by side: on a GPU each takes its part of the memory `pdserve up`
    would give one (unless the flags name a fraction), as its workers split theirs."""
    from services import launcher
    p = argparse.ArgumentParser()
    launcher.add_arguments(p)  # the flags as `pdserve up` reads them
    up = p.parse_args(flags)
    if stacks < 2 or up.device == "cpu" or up.gpu_memory_utilization is not None:
        return []
    return ["--gpu-memory-utilization", f"{launcher.GPU_MEMORY_SHARE / stacks:.4f}"]


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="models/tiny-llama", help="for the pdserve shapes")
    p.add_argument("--workload", choices=WORKLOADS, default="mixed")
    p.add_argument("--num-requests", type=int, default=60)
    p.add_argument("--rate", type=float, default=1.5, help="requests/s (Poisson); 0: all at once")
    p.add_argument("--rates", type=float, nargs="+",
                   help="a sweep instead of --rate (each rate its own draw of prompts)")
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--seeds", type=int, nargs="+",
                   help="one draw per seed, the targets' order turned by one each time")
    p.add_argument("--temperature", type=float, default=0.0,
                   help="sampling temperature of every request (0: greedy)")
    p.add_argument("--baseline", action="append", default=[], metavar="[NAME=]URL",
                   help="a running OpenAI-compatible server, compared first (repeatable)")
    p.add_argument("--shapes", nargs="*", choices=list(SHAPES), default=["default"],
                   help="pdserve shapes to launch, in this order")
    p.add_argument("--up-args", default="", help="more `pdserve up` flags for every shape")
    p.add_argument("--slo-ttft-ms", type=float, default=2000.0)
    p.add_argument("--slo-tpot-ms", type=float, default=100.0)
    p.add_argument("--out", default="benchmarks/results/serve", help="directory for the files")
    p.add_argument("--replot", metavar="DIR", help="redraw DIR's figures from its JSON files")
    p.add_argument("--cores", action="store_true",
                   help="where the cores went while each target served (cores.json, cores.png)")
    p.add_argument("--spans", type=int, nargs="?", const=0, metavar="PORT",
                   help="take the pdserve stacks' spans on an OTLP receiver here (on PORT; "
                        "without it any free port): timeline phases and long prompts' table")
    args = p.parse_args()
    if args.replot:
        report(Path(args.replot), *load(Path(args.replot)))
        return 0
    rates = [-1.0] if args.workload == "idle" else args.rates or [args.rate]
    if len(set(rates)) != len(rates):
        p.error("--rates: each rate once (a rate's second run would find its prompts cached)")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    if any(url is None for _, url, _ in targets(args)) and args.model == p.get_default("model") \
            and not Path(args.model, "config.json").exists():
        from common.models.tiny import make_tiny_model
        make_tiny_model(args.model)
    args.receiver = None
    if args.spans is not None:
        args.receiver = spans.Receiver(args.spans)
        os.environ["OTEL_BSP_SCHEDULE_DELAY"] = spans.EXPORT_DELAY_MS  # the launched stacks'
        print(f"OTLP receiver for the stacks' spans at {args.receiver.endpoint}")
    try:
        if args.seeds:
            return run_seeds(args, rates, out)
        prompts = draws(args, rates, args.seed)
        describe(args, prompts, rates)
        order = targets(args)
        procs, urls = start(args, order)
        try:
            run_draw(args, order, urls, rates, prompts, args.seed, out)
        finally:
            stop(procs)
    finally:
        if args.receiver is not None:
            args.receiver.close()
    return 0


def draw_seed(seed: int, k: int) -> int:
    """The seed of the k-th rate's draw (prompts and arrivals) in a sweep: the first rate's is
    the run's own, so a single-rate run draws what it always drew."""
    return seed + 1_000_003 * k


def draws(args, rates: list[float], seed: int) -> dict[float, list]:
    """Each rate's prompts, the same for every target. Every rate of a sweep draws its own:
    a server that saw the first rate's prompts would find the next rates' in its prefix cache
    (a 3000-token prompt's TTFT then that of a cache hit)."""
    return {rate: workload(args.workload, args.num_requests, draw_seed(seed, k))
            for k, rate in enumerate(rates)}


def describe(args, prompts: dict[float, list], rates: list[float]) -> None:
    lengths = [len(p) for draw in prompts.values() for p in draw]
    print(f"{args.workload}: {args.num_requests} requests"
          f"{' per rate, each its own draw' if len(rates) > 1 else ''}, prompts "
          f"{min(lengths)}-{max(lengths)} tokens, {args.max_tokens} output tokens, at "
          f"{', '.join(map(str, rates))} req/s; SLO TTFT <= {args.slo_ttft_ms:.0f} ms, "
          f"TPOT <= {args.slo_tpot_ms:.0f} ms")


def start(args, order) -> tuple[list, dict[str, str]]:
    """Launches the shapes (a baseline is running already): their processes, every URL. Each
    shape's start-up (launch to "pdserve is up", the model loaded and every kernel warmed) goes
    into args.startup_s and the summaries."""
    procs, urls = [], {}
    args.startup_s = {}
    try:
        for name, url, flags in order:
            if url is None:
                log = Path(tempfile.gettempdir()) / f"pdserve-bench-{name.replace(' ', '_')}.log"
                t0 = time.monotonic()
                proc, url, _ = launch(args.model, flags, log)
                args.startup_s[name] = round(time.monotonic() - t0, 2)
                print(f"{name}: up in {args.startup_s[name]:.1f} s")
                procs.append(proc)
            urls[name] = url
    except BaseException:
        stop(procs)
        raise
    return procs, urls


def run_draw(args, order, urls: dict[str, str], rates: list[float],
             prompts: dict[float, list], seed: int,
             out: Path) -> dict[str, dict[float, dict[str, float]]]:
    """One draw against every target in `order`: its files in `out`, its table printed."""
    out.mkdir(parents=True, exist_ok=True)
    records: dict[str, dict[float, list[Record]]] = {}
    summaries: dict[str, dict[float, dict[str, float]]] = {}
    used: dict[str, dict[float, dict]] = {}
    for name, _, _ in order:
        for k, rate in enumerate(rates):
            with cores.Cores() if args.cores else contextlib.nullcontext() as sampler:
                recs, wall = asyncio.run(run_load(urls[name], prompts[rate], rate,
                                                  args.max_tokens, draw_seed(seed, k),
                                                  f"{name} @ {rate:g} req/s",
                                                  {"temperature": args.temperature}))
            if sampler is not None:
                used.setdefault(name, {})[rate] = sampler.usage()
            if args.receiver is not None:
                spans.attach(recs, args.receiver)
            records.setdefault(name, {})[rate] = recs
            summaries.setdefault(name, {})[rate] = summarize(
                recs, wall, args.slo_ttft_ms / 1000, args.slo_tpot_ms / 1000,
                LONG_PROMPTS[args.workload][1][0] if args.workload in LONG_PROMPTS else 0)
    # files and tables in the targets' own order, whatever order they ran in
    names = [n for n, _, _ in targets(args)]
    records = {n: records[n] for n in names}
    summaries = {n: summaries[n] for n in names}
    (out / "requests.json").write_text(json.dumps(
        {n: {str(r): records_json(v) for r, v in by.items()} for n, by in records.items()}))
    if used:
        (out / "cores.json").write_text(json.dumps(
            {n: {str(r): u for r, u in used[n].items()} for n in names}))
    meta = {"workload": args.workload, "requests": len(next(iter(prompts.values()))),
            "max_tokens": args.max_tokens,
            "temperature": args.temperature, "seed": seed, "order": [n for n, _, _ in order],
            "draw_seeds": {str(rate): draw_seed(seed, k) for k, rate in enumerate(rates)},
            "slo_ttft_ms": args.slo_ttft_ms, "slo_tpot_ms": args.slo_tpot_ms,
            "startup_s": args.startup_s}
    (out / "summary.json").write_text(json.dumps(
        {**meta, "targets": {n: {str(r): s for r, s in by.items()}
                             for n, by in summaries.items()}}, indent=1))
    report(out, meta, records, summaries)
    print(f"\nwrote {out}/")
    return summaries


def run_seeds(args, rates: list[float], out: Path) -> int:
    """A draw per seed, the targets' order turned by one each time; the ratios over the seeds."""
    order = targets(args)
    first = order[0][0]
    procs, urls = start(args, order)
    per_seed: dict[int, dict[str, dict[float, dict[str, float]]]] = {}
    try:
        for k, seed in enumerate(args.seeds):
            turned = order[k % len(order):] + order[:k % len(order)]
            print(f"\n=== seed {seed}: {' -> '.join(n for n, _, _ in turned)}")
            prompts = draws(args, rates, seed)
            describe(args, prompts, rates)
            per_seed[seed] = run_draw(args, turned, urls, rates, prompts, seed,
                                      out / f"seed-{seed}")
    finally:
        stop(procs)
    ratios = seed_ratios(per_seed, first)
    (out / "seeds.json").write_text(json.dumps(
        {"workload": args.workload, "seeds": args.seeds, "first": first,
         "summaries": {str(s): {n: {str(r): v for r, v in by.items()} for n, by in t.items()}
                       for s, t in per_seed.items()},
         "ratios": ratios}, indent=1))
    for rate in rates:
        print(f"\n{args.workload} {_at(rate)}, seeds {' '.join(map(str, args.seeds))}: ratio to "
              f"{first}, median [min, max] over the seeds")
        keys = [k for k in per_seed[args.seeds[0]][first][rate] if k not in COUNTS]
        print(f"{'':34}" + "".join(f"{k:>22}" for k in keys))
        for name, by_rate in ratios.items():
            cells = [by_rate[str(rate)].get(k) for k in keys]
            print(f"{name[:34]:34}" + "".join(
                f"{c['median']:.2f} [{c['min']:.2f}, {c['max']:.2f}]".rjust(22) if c else
                f"{'-':>22}" for c in cells))
    print(f"\nwrote {out}/seeds.json")
    return 0


def seed_ratios(per_seed: dict[int, dict[str, dict[float, dict[str, float]]]],
                first: str) -> dict[str, dict[str, dict[str, dict[str, float]]]]:
    """target -> rate -> metric -> median, min and max over the seeds of target / first."""
    out: dict[str, dict[str, dict[str, dict[str, float]]]] = {}
    for summaries in per_seed.values():
        for name, by_rate in summaries.items():
            if name == first:
                continue
            for rate, figures in by_rate.items():
                base = summaries[first][rate]
                for key, value in figures.items():
                    if key in COUNTS or not base.get(key):
                        continue
                    out.setdefault(name, {}).setdefault(str(rate), {}).setdefault(
                        key, {"values": []})["values"].append(value / base[key])
    for by_rate in out.values():
        for figures in by_rate.values():
            for cell in figures.values():
                values = sorted(cell.pop("values"))
                cell.update(median=statistics.median(values), min=values[0], max=values[-1])
    return out


if __name__ == "__main__":
    sys.exit(main())
