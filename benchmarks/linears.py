"""A model's linears on the CPU in float32: oneDNN's packed GEMM beside the CPU kernels' panel
linear (kernels/csrc/linear.cpp), in one run, alternating case by case so that both see the
same machine state.

    .venv/bin/python benchmarks/linears.py --model DIR [--rows 1 2 4 8 16 64 256]
        [--threads 1 2] [--reps 7] [--out results/linears]

One pass is every linear of one forward on `rows` rows of random input (a step's tokens):
each layer's qkv, o, gate_up and down projections, then the LM head on min(rows, --seqs) rows
(a step computes logits only for its sequences' last tokens), with random weights of the
model's shapes (only its config.json is read). Prints, for each thread count and row count,
the median [min-max] ms of a pass for each kernel, their ratio, the layers' and the LM head's
ratios apart, the weights' read rate and the multiply rate of the panels, and the largest
difference between the two kernels' outputs; writes a JSON of the figures and a plot (ms
against rows, one line per kernel and thread count).
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch
from torch import nn

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from common.models.config import ModelConfig  # noqa: E402
from common.models.packed_linear import PackedLinear  # noqa: E402
from kernels import cpu_attention  # noqa: E402


def shapes(cfg: ModelConfig) -> list[tuple[int, int]]:
    """(out_features, in_features) of one forward's linears, in order."""
    q, kv = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
    layer = [(q + 2 * kv, cfg.hidden_size), (cfg.hidden_size, q),
             (2 * cfg.intermediate_size, cfg.hidden_size),
             (cfg.hidden_size, cfg.intermediate_size)]
    return layer * cfg.num_layers + [(cfg.vocab_size, cfg.hidden_size)]


def build(dims: list[tuple[int, int]], library) -> tuple[list[PackedLinear], list[PackedLinear]]:
    g = torch.Generator().manual_seed(0)
    onednn, panels = [], []
    for out, inp in dims:
        linear = nn.Linear(inp, out, bias=False)
        with torch.no_grad():
            linear.weight.copy_(torch.randn(out, inp, generator=g) / inp ** 0.5)
        onednn.append(PackedLinear(linear))
        panels.append(PackedLinear(linear, library=library))
    return onednn, panels


def layers_pass(linears: list[PackedLinear], inputs: dict[int, torch.Tensor]
                ) -> list[torch.Tensor]:
    """The layers' linears (all but the last) on every row."""
    return [lin(inputs[lin.in_features]) for lin in linears[:-1]]


def head_pass(linears: list[PackedLinear], inputs: dict[int, torch.Tensor],
              head_rows: int) -> torch.Tensor:
    """The LM head (the last) on the first head_rows rows."""
    head = linears[-1]
    return head(inputs[head.in_features][:head_rows])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", required=True, help="a checkpoint directory (its config.json)")
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 2, 4, 8, 16, 64, 256])
    ap.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--seqs", type=int, default=256,
                    help="most rows of the LM head (the step's sequences)")
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--out", default="benchmarks/results/linears")
    args = ap.parse_args()

    cfg = ModelConfig.from_pretrained(args.model)
    dims = shapes(cfg)
    weight_bytes = sum(o * i for o, i in dims) * 4
    head_params = dims[-1][0] * dims[-1][1]
    library = cpu_attention.load()
    onednn, panels = build(dims, library)
    print(f"{len(dims)} linears, {weight_bytes / 1e6:.1f} MB of float32 weights; "
          f"build {cpu_attention.cpu_isa()}")
    results = []
    g = torch.Generator().manual_seed(1)
    with torch.inference_mode():
        for threads in args.threads:
            torch.set_num_threads(threads)
            for rows in args.rows:
                head_rows = min(rows, args.seqs)
                inputs = {n: torch.randn(rows, n, generator=g) for _, n in dims}
                diff = max((a - b).abs().max().item() for a, b in zip(
                    [*layers_pass(onednn, inputs), head_pass(onednn, inputs, head_rows)],
                    [*layers_pass(panels, inputs), head_pass(panels, inputs, head_rows)]))
                times: dict[str, list[float]] = {"oneDNN": [], "panels": []}
                parts: dict[str, list[float]] = {"oneDNN": [], "panels": []}  # the LM head's
                for rep in range(args.reps + 1):
                    for name, linears in (("oneDNN", onednn), ("panels", panels)):
                        start = time.perf_counter()
                        layers_pass(linears, inputs)
                        mid = time.perf_counter()
                        head_pass(linears, inputs, head_rows)
                        end = time.perf_counter()
                        if rep:  # the first is warm-up
                            times[name].append((end - start) * 1e3)
                            parts[name].append((end - mid) * 1e3)
                med = {k: statistics.median(v) for k, v in times.items()}
                head = {k: statistics.median(v) for k, v in parts.items()}
                flops = 2 * (rows * (weight_bytes // 4 - head_params) + head_rows * head_params)
                row = {"threads": threads, "rows": rows, "head_rows": head_rows,
                       "max_abs_diff": diff, **{f"{k}_ms": v for k, v in times.items()},
                       **{f"{k}_head_ms": v for k, v in parts.items()}}
                results.append(row)
                layers = (med["panels"] - head["panels"]) / (med["oneDNN"] - head["oneDNN"])
                print(f"{threads} thr {rows:5d} rows: oneDNN {med['oneDNN']:8.1f} ms "
                      f"[{min(times['oneDNN']):.1f}-{max(times['oneDNN']):.1f}]  panels "
                      f"{med['panels']:8.1f} ms [{min(times['panels']):.1f}-"
                      f"{max(times['panels']):.1f}]  ratio {med['panels'] / med['oneDNN']:.2f}"
                      f" (layers {layers:.2f}, head {head['panels'] / head['oneDNN']:.2f})"
                      f"  panels {weight_bytes / med['panels'] / 1e6:5.1f} GB/s "
                      f"{flops / med['panels'] / 1e6:5.1f} GFLOP/s"
                      f"  max |diff| {diff:.1e}", flush=True)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "linears.json").write_text(json.dumps(
        {"model": str(args.model), "isa": cpu_attention.cpu_isa(), "weight_bytes": weight_bytes,
         "results": results}, indent=1))
    plot(results, out / "linears.png", f"{Path(args.model).name}: one forward's linears, "
                                        f"float32 ({cpu_attention.cpu_isa()})")
    print(f"wrote {out}/linears.json, linears.png")


def plot(results: list[dict], path: Path, title: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for threads in sorted({r["threads"] for r in results}):
        rs = [r for r in results if r["threads"] == threads]
        for name, style in (("oneDNN", "--"), ("panels", "-")):
            ax.plot([r["rows"] for r in rs], [statistics.median(r[f"{name}_ms"]) for r in rs],
                    style, marker="o", label=f"{name}, {threads} thread(s)")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("rows (tokens in the step)")
    ax.set_ylabel("ms per forward's linears (median)")
    ax.grid(alpha=0.3)
    ax.legend()
    ax.set_title(title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


if __name__ == "__main__":
    main()
