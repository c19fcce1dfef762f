"""Whether the CPU decode attention kernel is bound by its arithmetic or by its reads: ns per
position and KV head on a cache-resident context (every sequence reads the same 4 or 20 blocks)
beside contexts scattered over 8 layers' caches (as a step reads them), on one thread, in
float32 and bfloat16; then this machine's copy and read bandwidth on one thread.

    .venv/bin/python benchmarks/attention_resident.py

Shapes are the 56M Llama's (8 query heads, 4 KV heads, head_dim 64, blocks of 16), 64 sequences.
"""
from __future__ import annotations

import itertools
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks.attention import BLOCK, HEAD_DIM, HEADS, KV_HEADS, scattered_blocks, timed  # noqa: E402
from kernels.cpu_attention import cpu_isa, load, paged_decode_attention  # noqa: E402

BATCH = 64


def spread(fn, reps: int = 15) -> tuple[float, float, float]:
    """Median, min and max seconds of `reps` calls (after a warm one)."""
    ts = timed(fn, reps)
    return statistics.median(ts), min(ts), max(ts)


def main() -> None:
    load()
    torch.set_num_threads(1)
    print(f"kernels built for {cpu_isa()}, 1 thread")
    gen = torch.Generator().manual_seed(0)
    scale = HEAD_DIM ** -0.5
    for dtype in (torch.float32, torch.bfloat16):
        name = str(dtype).removeprefix("torch.")
        q = torch.randn((BATCH, HEADS, HEAD_DIM), generator=gen).to(dtype)
        for ctx in (64, 320):
            blocks = ctx // BLOCK
            tables = torch.arange(blocks).repeat(BATCH, 1)
            lens = torch.full((BATCH,), ctx)
            cache = torch.randn((2, blocks, BLOCK, KV_HEADS, HEAD_DIM), generator=gen).to(dtype)
            per = BATCH * ctx * KV_HEADS / 1e9
            m, lo, hi = spread(lambda q=q, c=cache, t=tables, n=lens:
                              paged_decode_attention(q, c, t, n, scale))
            print(f"resident  {name:9s} {BATCH}x{ctx:<5d} {m / per:5.1f} ns/position/kv head "
                  f"[{lo / per:.1f}-{hi / per:.1f}]", flush=True)
        for ctx in (320, 2000):
            rows, num_blocks = scattered_blocks([ctx] * BATCH, gen)
            tables, lens = torch.tensor(rows), torch.full((BATCH,), ctx)
            caches = [torch.randn((2, num_blocks, BLOCK, KV_HEADS, HEAD_DIM), generator=gen)
                      .to(dtype) for _ in range(8)]
            turn = itertools.count()
            m, lo, hi = spread(lambda q=q, cs=caches, i=turn, t=tables, n=lens:
                              paged_decode_attention(q, cs[next(i) % 8], t, n, scale))
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
