"""Whether the CPU decode attention kernel is bound by its arithmetic or by its reads: ns per
position and KV head on a cache-resident context (every sequence reads the same 4 or 20 blocks)
beside contexts scattered over 8 layers' caches (as a step reads them), on one thread, in
float32 and bfloat16, each scattered case beside a plain read of the same blocks in the same
order (the ceiling this machine's memory sets for that access pattern); then this machine's copy
and read bandwidth on one thread.

    .venv/bin/python benchmarks/attention_resident.py
    .venv/bin/python benchmarks/attention_resident.py --loop scattered bfloat16 5   # for perf

Shapes are the 56M Llama's (8 query heads, 4 KV heads, head_dim 64, blocks of 16), 64 sequences.
"""
from __future__ import annotations

import argparse
import ctypes
import itertools
import statistics
import subprocess
import sys
import tempfile
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
    return decode_over(scattered_decode([ctx] * BATCH, dtype, gen))


def decode_over(inputs):
    """Calls of the kernel on scattered_decode's inputs, each on the next layer's cache."""
    q, caches, tables, lens = inputs
    turn = itertools.count()
    return lambda: paged_decode_attention(q, caches[next(turn) % len(caches)], tables, lens,
                                          HEAD_DIM ** -0.5)


# A plain read of the blocks a decode call reads, in its order, as K and V streams with the
# kernel's prefetch (rows AHEAD_BYTES ahead into L2, both streams): the rate this machine's
# memory gives that access pattern on one thread, the ceiling of the scattered cases above.
AHEAD_BYTES = {torch.float32: 16384, torch.bfloat16: 12288}  # paged_attention.cpp's
READ_SRC = r"""
#include <stdint.h>
#include <string.h>
uint64_t read_blocks(const char* base, const int64_t* offsets, int64_t n, int64_t block_bytes,
                     int64_t value_offset, int64_t ahead) {
  uint64_t acc[8] = {0};
  int64_t lines = block_bytes / 64, total = n * lines, step = ahead / 64;
  for (int64_t i = 0; i < total; ++i) {
    const char* k = base + offsets[i / lines] + (i % lines) * 64;
    if (i + step < total) {
      const char* p = base + offsets[(i + step) / lines] + ((i + step) % lines) * 64;
      __builtin_prefetch(p, 0, 2);
      __builtin_prefetch(p + value_offset, 0, 2);
    }
    uint64_t w[8], x[8];
    memcpy(w, k, 64);
    memcpy(x, k + value_offset, 64);
    for (int j = 0; j < 8; ++j) acc[j] += w[j] ^ x[j];
  }
  uint64_t s = 0;
  for (int j = 0; j < 8; ++j) s += acc[j];
  return s;
}
"""


def block_reader():
    """read_blocks above, compiled here (gcc, the compiler the kernels build with); the files go
    once it is loaded."""
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "read_blocks.so"
        src = out.with_suffix(".c")
        src.write_text(READ_SRC)
        subprocess.run(["gcc", "-O2", "-march=native", "-shared", "-fPIC", "-o", str(out),
                        str(src)], check=True)
        fn = ctypes.CDLL(str(out)).read_blocks
    fn.restype = ctypes.c_uint64
    fn.argtypes = [ctypes.c_void_p, ctypes.c_void_p] + [ctypes.c_int64] * 4
    return fn


def read_over(inputs, fn):
    """Plain reads of the blocks decode_over's calls read: each call the next layer's, sequence
    by sequence, each sequence's blocks up to its length; a call returns read_blocks' sum."""
    _, caches, tables, lens = inputs
    dtype, block = caches[0].dtype, caches[0].size(2)
    block_bytes = block * KV_HEADS * HEAD_DIM * dtype.itemsize
    offsets = torch.cat([row[:-(-int(n) // block)] for row, n in zip(tables, lens)])
    offsets = (offsets * block_bytes).contiguous()
    turn = itertools.count()

    def call() -> int:
        cache = caches[next(turn) % len(caches)]
        return fn(cache.data_ptr(), offsets.data_ptr(), offsets.numel(), block_bytes,
                  cache.stride(0) * dtype.itemsize, AHEAD_BYTES[dtype])
    return call


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
    reader = block_reader()
    for dtype in (torch.float32, torch.bfloat16):
        name = str(dtype).removeprefix("torch.")
        for ctx in (64, 320):
            per = BATCH * ctx * KV_HEADS / 1e9
            m, lo, hi = spread(resident(dtype, ctx, gen))
            print(f"resident  {name:9s} {BATCH}x{ctx:<5d} {m / per:5.1f} ns/position/kv head "
                  f"[{lo / per:.1f}-{hi / per:.1f}]", flush=True)
        for ctx in (320, 2000):
            inputs = scattered_decode([ctx] * BATCH, dtype, gen)
            m, lo, hi = spread(decode_over(inputs))
            per = BATCH * ctx * KV_HEADS / 1e9
            gb = BATCH * ctx * KV_HEADS * HEAD_DIM * 2 * dtype.itemsize / 1e9
            print(f"scattered {name:9s} {BATCH}x{ctx:<5d} {m / per:5.1f} ns/position/kv head, "
                  f"{gb / m:.1f} GB/s [{gb / hi:.1f}-{gb / lo:.1f}]", flush=True)
            m, lo, hi = spread(read_over(inputs, reader))
            print(f"  a plain read of its blocks, K and V, prefetched as the kernel does: "
                  f"{gb / m:.1f} GB/s [{gb / hi:.1f}-{gb / lo:.1f}]", flush=True)
    src = torch.ones(64 * 2**20)
    dst = torch.empty_like(src)
    copy = spread(lambda: dst.copy_(src), 5)[0]
    read = spread(lambda: src.sum(), 5)[0]
    print(f"one thread: copy {src.numel() * 4 / copy / 1e9:.1f} GB/s, "
          f"read (sum) {src.numel() * 4 / read / 1e9:.1f} GB/s")


if __name__ == "__main__":
    main()
