"""bfloat16 decode attention against float32, per byte of K/V read, with the two dtypes' calls
alternated pair by pair (attention.py times each dtype's cases minutes apart, and this kind of
VM moves more than the difference between them in that time).

    .venv/bin/python benchmarks/attention_per_byte.py [--reps 31] [--threads 1 2] [--block 16]

For each of attention.py's decode batches: one call in float32, one in bfloat16 (the order
turned each pair), each on the next of its own 8 layers' caches over scattered blocks; prints
each dtype's median GB/s of K/V and the median [quartiles] of bfloat16's GB/s over float32's
in the same pair. `--bf16-block N` gives bfloat16 blocks of N positions (32: as many bytes per
block as float32's 16).
"""
from __future__ import annotations

import argparse
import itertools
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks import attention  # noqa: E402
from common.models.attention import CpuAttentionBackend  # noqa: E402


def decode_call(lengths: list[int], dtype: torch.dtype, block: int, gen: torch.Generator):
    """call(): one decode step's attention (KV write included) over scattered blocks of
    `block` positions, on the next of up to 8 layers' caches; and the K/V bytes it reads."""
    case = attention.decode_case(lengths, dtype, gen, block)
    meta, kv_bytes = case[0], case[3]
    caches, q, k, v = attention.step_inputs(case, dtype, gen, block)
    backend, turn = CpuAttentionBackend(), itertools.count()
    scale = attention.HEAD_DIM ** -0.5

    def call() -> None:
        backend.forward(q, k, v, caches[next(turn) % len(caches)], meta, scale)
    return call, kv_bytes


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--reps", type=int, default=31, help="pairs of calls per case")
    ap.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--block", type=int, default=attention.BLOCK, help="positions per block")
    ap.add_argument("--bf16-block", type=int, help="bfloat16's positions per block (--block)")
    args = ap.parse_args()
    print(f"CPU flags: {attention.cpu_flags()}; blocks of {args.block} (float32), "
          f"{args.bf16_block or args.block} (bfloat16); {args.reps} pairs")
    for threads in args.threads:
        torch.set_num_threads(threads)
        for name, lengths in attention.DECODES.items():
            gen = torch.Generator().manual_seed(0)
            calls = {"float32": decode_call(lengths, torch.float32, args.block, gen),
                     "bfloat16": decode_call(lengths, torch.bfloat16,
                                             args.bf16_block or args.block, gen)}
            rates = attention.in_turn(calls, args.reps)
            ratios = [b / f for f, b in zip(rates["float32"], rates["bfloat16"])]
            print(f"{name:<24} {threads} thr  float32 {statistics.median(rates['float32']):5.1f}"
                  f" GB/s  bfloat16 {statistics.median(rates['bfloat16']):5.1f} GB/s  "
                  f"bfloat16 / float32 per byte {attention.median_quartiles(ratios)}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
