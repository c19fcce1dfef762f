"""Whether the CPU decode attention kernel is bound by its arithmetic or by its reads: ns per
position and KV head on a cache-resident context (every sequence reads the same 4 or 20 blocks)
beside contexts scattered over 8 layers' caches (as a step reads them), on one thread, in
float32 and bfloat16; then this machine's copy and read bandwidth on one thread.

    .venv/bin/python benchmarks/attention_resident.py
    .venv/bin/python benchmarks/attention_resident.py --loop scattered bfloat16 5   # for perf

Shapes are the 56M Llama's (8 query heads, 4 KV heads, head_dim 64, blocks of 16), 64 sequences.
"""
from __future__ import annotations

import argparse
import itertools
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks.attention import BLOCK, HEAD_DIM, HEADS, KV_HEADS, scattered_decode, timed  # noqa: E402
from kernels.cpu_attention import cpu_isa, load, paged_decode_attention  # noqa: E402

BATCH = 64


def spread(fn, reps: int = 15) -> tuple[float, float, float]:
    """Median, min and max seconds of `reps` calls (after a warm one)."""
    ts = timed(fn, reps)
    return statistics.median(ts), min(ts), max(ts)


def resident(dtype: torch.dtype, ctx: int, gen: torch.Generator):
    """A call reading the same `ctx // BLOCK` blocks for every sequence (they stay in cache)."""
    q = torch.randn((BATCH, HEADS, HEAD_DIM), generator=gen).to(dtype)
    blocks = ctx // BLOCK
    tables = torch.arange(blocks).repeat(BATCH, 1)
    lens = torch.full((BATCH,), ctx)
    cache = torch.randn((2, blocks, BLOCK, KV_HEADS, HEAD_DIM), generator=gen).to(dtype)
    return lambda: paged_decode_attention(q, cache, tables, lens, HEAD_DIM ** -0.5)


def scattered(dtype: torch.dtype, ctx: int, gen: torch.Generator):
    """Calls over scattered blocks, each on the next of 8 layers' caches."""
    q, caches, tables, lens = scattered_decode([ctx] * BATCH, dtype, gen)
    turn = itertools.count()
    return lambda: paged_decode_attention(q, caches[next(turn) % len(caches)], tables, lens,
                                          HEAD_DIM ** -0.5)


def loop(case: str, dtype: torch.dtype, ctx: int, seconds: float) -> None:
    """One case called over and over for `seconds`, for a sampling profiler (perf record)."""
    make = resident if case == "resident" else scattered
    fn = make(dtype, ctx, torch.Generator().manual_seed(0))
    fn()
    calls, start = 0, time.perf_counter()
    while time.perf_counter() - start < seconds:
        fn()
        calls += 1
    per = (time.perf_counter() - start) / calls / (BATCH * ctx * KV_HEADS) * 1e9
    print(f"{case} {dtype} {BATCH}x{ctx}: {per:.1f} ns/position/kv head over {calls} calls")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--loop", nargs=3, metavar=("CASE", "DTYPE", "SECONDS"),
                    help="call one case (resident or scattered, 64 x 320) for SECONDS instead, "
                         "for a profiler: e.g. --loop scattered bfloat16 5")
    args = ap.parse_args()
    load()
    torch.set_num_threads(1)
    if args.loop:
        case, dtype, seconds = args.loop
        loop(case, getattr(torch, dtype), 320, float(seconds))
        return
    print(f"kernels built for {cpu_isa()}, 1 thread")
    gen = torch.Generator().manual_seed(0)
    for dtype in (torch.float32, torch.bfloat16):
        name = str(dtype).removeprefix("torch.")
        for ctx in (64, 320):
            per = BATCH * ctx * KV_HEADS / 1e9
            m, lo, hi = spread(resident(dtype, ctx, gen))
            print(f"resident  {name:9s} {BATCH}x{ctx:<5d} {m / per:5.1f} ns/position/kv head "
                  f"[{lo / per:.1f}-{hi / per:.1f}]", flush=True)
        for ctx in (320, 2000):
            m, lo, hi = spread(scattered(dtype, ctx, gen))
            per = BATCH * ctx * KV_HEADS / 1e9
            gb = BATCH * ctx * KV_HEADS * HEAD_DIM * 2 * dtype.itemsize / 1e9
            print(f"scattered {name:9s} {BATCH}x{ctx:<5d} {m / per:5.1f} ns/position/kv head, "
                  f"{gb / m:.1f} GB/s [{gb / hi:.1f}-{gb / lo:.1f}]", flush=True)
    src = torch.ones(64 * 2**20)
    dst = torch.empty_like(src)
    copy = spread(lambda: dst.copy_(src), 5)[0]
    read = spread(lambda: src.sum(), 5)[0]
    print(f"one thread: copy {src.numel() * 4 / copy / 1e9:.1f} GB/s, "
          f"read (sum) {src.numel() * 4 / read / 1e9:.1f} GB/s")


if __name__ == "__main__":
    main()
