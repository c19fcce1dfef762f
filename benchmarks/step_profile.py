"""Where a CPU decode step's time goes: the whole step (the model's forward and its logits) and
the part inside the attention backend (the step's KV write and attention), for the paged cpu
kernels beside the gather + SDPA backend that served before them, in float32 and bfloat16, on
each thread count, in one run.

    .venv/bin/python benchmarks/step_profile.py --model /tmp/m56 [--batch 60 --context 320]

The batch is what a decode worker steps under the saturation load of the serving benchmark
(random 256/64, 60 requests at once: ~60 sequences of ~256-320 tokens), each sequence's blocks
scattered over the cache as a long-running pool leaves them. Attention is timed around the
backend's forward (every layer, each call), the step around the model call and its logits.
Prints median [min-max] per configuration; writes step_profile.json and step_profile.png to
--out.
"""
from __future__ import annotations

import argparse
import json
import platform
import random
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks.attention import cpu_flags  # noqa: E402
from common.kv_cache import PagedKVCache  # noqa: E402
from common.kv_layout import KVLayout  # noqa: E402
from common.models.attention import AttentionMetadata, CpuAttentionBackend, TorchAttentionBackend  # noqa: E402
from common.models.llama import load_model  # noqa: E402

BACKENDS = {"paged cpu kernels": CpuAttentionBackend, "gather + SDPA": TorchAttentionBackend}
BLOCK = 16


class TimedBackend:
    """The backend's forward, its time added up."""

    def __init__(self, inner):
        self.inner = inner
        self.seconds = 0.0

    def forward(self, *args):
        start = time.perf_counter()
        out = self.inner.forward(*args)
        self.seconds += time.perf_counter() - start
        return out

    def __getattr__(self, name):
        return getattr(self.inner, name)


def profile(model_dir: str, dtype: torch.dtype, backend_name: str, threads: int, batch: int,
            context: int, reps: int, seed: int) -> dict:
    torch.set_num_threads(threads)
    backend = TimedBackend(BACKENDS[backend_name]())
    model = load_model(model_dir, backend, dtype, "cpu", progress=False)
    c = model.config
    per_seq = -(-(context + 1) // BLOCK)
    layout = KVLayout(num_layers=c.num_layers, num_kv_heads=c.num_kv_heads,
                      head_dim=c.head_dim, block_size=BLOCK, dtype=str(dtype).split(".")[1])
    cache = PagedKVCache(layout, batch * per_seq + 1)
    for layer in cache.layers:  # touched, and no NaNs in the scores
        layer.normal_(0, 0.5)
    rng = random.Random(seed)
    blocks = rng.sample(range(1, batch * per_seq + 1), batch * per_seq)
    decodes = [(context, blocks[i * per_seq:(i + 1) * per_seq]) for i in range(batch)]
    meta = AttentionMetadata.build(decodes, [], BLOCK)
    ids = torch.randint(0, c.vocab_size, (batch,), generator=torch.Generator().manual_seed(seed))
    positions = torch.full((batch,), context)

    def step():
        with torch.inference_mode():
            model.compute_logits(model(ids, positions, cache.layers, meta))

    step()  # warm
    steps, attention = [], []
    for _ in range(reps):
        backend.seconds = 0.0
        start = time.perf_counter()
        step()
        steps.append((time.perf_counter() - start) * 1e3)
        attention.append(backend.seconds * 1e3)
    shares = [a / s for a, s in zip(attention, steps)]
    return {"dtype": str(dtype).split(".")[1], "backend": backend_name, "threads": threads,
            "step_ms": steps, "attention_ms": attention,
            "step_ms_median": statistics.median(steps),
            "attention_ms_median": statistics.median(attention),
            "attention_share_median": statistics.median(shares),
            "attention_share_range": [min(shares), max(shares)]}


def plot(rows: list[dict], path: Path, title: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(9, 4.5))
    labels = [f"{r['dtype']}\n{r['backend']}\n{r['threads']} thr" for r in rows]
    att = [r["attention_ms_median"] for r in rows]
    rest = [r["step_ms_median"] - r["attention_ms_median"] for r in rows]
    x = range(len(rows))
    ax.bar(x, att, label="attention backend (KV write + attention)")
    ax.bar(x, rest, bottom=att, label="rest of the step (linears, norms, logits)")
    for i, r in enumerate(rows):
        ax.text(i, r["step_ms_median"], f"{r['attention_share_median']:.0%}", ha="center",
                va="bottom", fontsize=8)
    ax.set_xticks(list(x), labels, fontsize=7)
    ax.set_ylabel("decode step, ms (median)")
    ax.set_title(title, fontsize=9)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", required=True)
    ap.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"])
    ap.add_argument("--backends", nargs="+", default=list(BACKENDS), choices=list(BACKENDS))
    ap.add_argument("--threads", nargs="+", type=int, default=[1, 2])
    ap.add_argument("--batch", type=int, default=60)
    ap.add_argument("--context", type=int, default=320)
    ap.add_argument("--reps", type=int, default=9)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default="benchmarks/results")
    args = ap.parse_args()
    flags = cpu_flags()
    print(f"{platform.processor() or platform.machine()}, flags: {flags}; torch "
          f"{torch.__version__}; decode step of {args.batch} x {args.context}")
    rows = []
    for dtype in args.dtypes:
        for threads in args.threads:
            for name in args.backends:
                r = profile(args.model, getattr(torch, dtype), name, threads, args.batch,
                            args.context, args.reps, args.seed)
                rows.append(r)
                lo, hi = r["attention_share_range"]
                print(f"{dtype:9s} {threads} thr  {name:18s} step {r['step_ms_median']:7.1f} ms "
                      f"[{min(r['step_ms']):.1f}-{max(r['step_ms']):.1f}]  attention "
                      f"{r['attention_ms_median']:6.1f} ms  share {r['attention_share_median']:.0%}"
                      f" [{lo:.0%}-{hi:.0%}]", flush=True)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    meta = {"cpu_flags": flags, "torch": torch.__version__, "batch": args.batch,
            "context": args.context, "reps": args.reps}
    (out / "step_profile.json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))
    plot(rows, out / "step_profile.png",
         f"decode step of {args.batch} x {args.context}, 56M-class model; CPU flags: {flags}")


if __name__ == "__main__":
    main()
