"""Attention kernels beside torch's scaled_dot_product_attention on the same shapes, one table.

    .venv/bin/python benchmarks/kernels.py [--dtype bfloat16] [--block-size 16] [--sweep]

Decode is memory-bound: it reports the bandwidth achieved (K/V, q and out bytes over the time) as
a fraction of the device's peak (from its memory clock and bus width). Prefill is compute-bound:
it reports TFLOP/s (4 * head_dim flops per visible query-key pair and head). SDPA runs on
contiguous K/V of the same lengths, so the gap is the price of paging (and the kernel's quality).
On a GPU every call is timed from a CUDA graph of it (as decode steps run in serving), so launch
overhead is left out of both columns. --sweep times every tile/warp/stage configuration of the
two kernels on the GPU shapes and prints the best per shape (what the defaults are chosen from).

Without a GPU it times the torch references (the CPU backend) instead, on smaller shapes, and says
so: the Triton interpreter is for correctness, its timings mean nothing.
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from kernels import reference  # noqa: E402

# (batch, context, heads, kv_heads, head_dim): Llama-3-8B-like GQA, and Llama-2-7B-like MHA
DECODE_GPU = [(1, 4096, 32, 8, 128), (8, 4096, 32, 8, 128), (64, 1024, 32, 8, 128),
              (64, 4096, 32, 8, 128), (16, 2048, 32, 32, 128)]
DECODE_CPU = [(1, 1024, 8, 2, 64), (8, 512, 8, 2, 64)]
# (sequences, chunk, cached prefix, heads, kv_heads, head_dim)
PREFILL_GPU = [(1, 4096, 0, 32, 8, 128), (8, 512, 0, 32, 8, 128), (1, 2048, 2048, 32, 8, 128),
               (4, 1024, 0, 32, 32, 128)]
PREFILL_CPU = [(1, 512, 0, 8, 2, 64), (1, 256, 256, 8, 2, 64)]


def bench(fn, on_gpu: bool) -> float:
    """Median milliseconds of fn()."""
    if on_gpu:
        import triton.testing
        return triton.testing.do_bench_cudagraph(fn, rep=50, return_mode="median")
    fn()
    times = []
    for _ in range(5):
        start = time.perf_counter()
        fn()
        times.append((time.perf_counter() - start) * 1e3)
    return sorted(times)[len(times) // 2]


def peak_bandwidth() -> float | None:
    """Bytes/s of the device's memory: double data rate x clock x bus width."""
    if not torch.cuda.is_available():
        return None
    p = torch.cuda.get_device_properties(0)
    return 2 * p.memory_clock_rate * 1e3 * p.memory_bus_width / 8


def paged(batch: int, length: int, kv_heads: int, head_dim: int, block_size: int, dtype, device):
    """A cache holding `batch` sequences of `length` keys in scattered blocks, and their tables."""
    per_seq = -(-length // block_size)
    cache = torch.randn((2, batch * per_seq, block_size, kv_heads, head_dim), dtype=dtype,
                        device=device)
    tables = torch.randperm(batch * per_seq, device=device).view(batch, per_seq)
    return cache, tables


def decode_rows(dtype, block_size: int, on_gpu: bool, peak: float | None) -> list[list[str]]:
    device = "cuda" if on_gpu else "cpu"
    rows = []
    for batch, ctx, heads, kv_heads, dim in DECODE_GPU if on_gpu else DECODE_CPU:
        cache, tables = paged(batch, ctx, kv_heads, dim, block_size, dtype, device)
        lens = torch.full((batch,), ctx, device=device)
        q = torch.randn((batch, heads, dim), dtype=dtype, device=device)
        k = torch.randn((batch, kv_heads, ctx, dim), dtype=dtype, device=device)
        v = torch.randn_like(k)
        scale = dim ** -0.5
        if on_gpu:
            from kernels.paged_decode_attention import paged_decode_attention
            ours = bench(lambda: paged_decode_attention(q, cache, tables, lens, scale), True)
        else:
            ours = bench(lambda: reference.decode_attention(q, cache, tables, lens, scale), False)
        sdpa = bench(lambda: F.scaled_dot_product_attention(
            q[:, :, None], k, v, scale=scale, enable_gqa=True), on_gpu)
        nbytes = (2 * batch * ctx * kv_heads * dim + 2 * batch * heads * dim) * q.element_size()

        def cols(ms):
            bw = nbytes / (ms * 1e-3)
            return [f"{ms:.3f}", f"{bw / 1e9:.3g} GB/s",
                    f"{bw / peak:.0%}" if peak else "n/a"]
        rows.append([f"decode b={batch} ctx={ctx} h={heads}/{kv_heads} d={dim}",
                     *cols(ours), *cols(sdpa)])
    return rows


def prefill_rows(dtype, block_size: int, on_gpu: bool) -> list[list[str]]:
    device = "cuda" if on_gpu else "cpu"
    rows = []
    for seqs, chunk, cached, heads, kv_heads, dim in PREFILL_GPU if on_gpu else PREFILL_CPU:
        total = cached + chunk
        cache, tables = paged(seqs, total, kv_heads, dim, block_size, dtype, device)
        q = torch.randn((seqs * chunk, heads, dim), dtype=dtype, device=device)
        k = torch.randn((seqs * chunk, kv_heads, dim), dtype=dtype, device=device)
        scale = dim ** -0.5
        if on_gpu:
            from kernels.paged_prefill_attention import paged_prefill_attention
            starts = torch.arange(0, seqs * chunk + 1, chunk, device=device)
            num_cached = torch.full((seqs,), cached, device=device)
            ours = bench(lambda: paged_prefill_attention(q, cache, tables, starts, num_cached,
                                                         chunk, scale), True)
        else:
            ours = bench(lambda: [reference.prefill_attention(
                q[i * chunk:(i + 1) * chunk], k[i * chunk:(i + 1) * chunk],
                k[i * chunk:(i + 1) * chunk], cache, tables[i], cached, scale)
                for i in range(seqs)], False)
        qs = torch.randn((seqs, heads, chunk, dim), dtype=dtype, device=device)
        ks = torch.randn((seqs, kv_heads, total, dim), dtype=dtype, device=device)
        if cached:
            from torch.nn.attention.bias import causal_lower_right
            mask = dict(attn_mask=causal_lower_right(chunk, total))
        else:
            mask = dict(is_causal=True)
        sdpa = bench(lambda: F.scaled_dot_product_attention(qs, ks, ks, scale=scale,
                                                            enable_gqa=True, **mask), on_gpu)
        # query i (position cached + i) sees cached + i + 1 keys
        pairs = seqs * (chunk * cached + chunk * (chunk + 1) // 2)
        flops = 4 * dim * heads * pairs
        rows.append([f"prefill n={seqs} chunk={chunk} cached={cached} h={heads}/{kv_heads} "
                     f"d={dim}", f"{ours:.3f}", f"{flops / ours / 1e9:.3g} TFLOP/s", "",
                     f"{sdpa:.3f}", f"{flops / sdpa / 1e9:.3g} TFLOP/s", ""])
    return rows


def sweep(dtype, block_size: int) -> None:
    """Every configuration of both kernels on each GPU shape: the best three per shape, and the
    configuration with the least total time over the shapes."""
    import itertools

    from kernels.paged_decode_attention import DecodeConfig, paged_decode_attention
    from kernels.paged_prefill_attention import PrefillConfig, paged_prefill_attention
    device = "cuda"
    cases = []  # (name, shape, configs, fn(config))
    for batch, ctx, heads, kv_heads, dim in DECODE_GPU:
        cache, tables = paged(batch, ctx, kv_heads, dim, block_size, dtype, device)
        lens = torch.full((batch,), ctx, device=device)
        q = torch.randn((batch, heads, dim), dtype=dtype, device=device)
        configs = [DecodeConfig(t, w, st, tp) for t, w, st, tp in itertools.product(
            (32, 64, 128), (2, 4, 8), (2, 3), (512, 1024))]
        cases.append((f"decode b={batch} ctx={ctx} h={heads}/{kv_heads}", configs,
                       lambda c, q=q, cache=cache, tables=tables, lens=lens:
                       paged_decode_attention(q, cache, tables, lens, 0.1, config=c)))
    for seqs, chunk, cached, heads, kv_heads, dim in PREFILL_GPU:
        cache, tables = paged(seqs, cached + chunk, kv_heads, dim, block_size, dtype, device)
        q = torch.randn((seqs * chunk, heads, dim), dtype=dtype, device=device)
        starts = torch.arange(0, seqs * chunk + 1, chunk, device=device)
        num_cached = torch.full((seqs,), cached, device=device)
        configs = [PrefillConfig(m, n, w, st) for m, n, w, st in itertools.product(
            (64, 128), (32, 64, 128), (4, 8), (2, 3, 4)) if m * n <= 128 * 64]
        cases.append((f"prefill n={seqs} chunk={chunk} cached={cached} h={heads}/{kv_heads}",
                       configs, lambda c, q=q, cache=cache, tables=tables, starts=starts,
                       num_cached=num_cached, chunk=chunk:
                       paged_prefill_attention(q, cache, tables, starts, num_cached, chunk, 0.1,
                                               config=c)))
    for kind in ("decode", "prefill"):
        totals: dict = {}
        for name, configs, fn in (c for c in cases if c[0].startswith(kind)):
            times = []
            for c in configs:
                try:
                    times.append((bench(lambda: fn(c), True), c))
                except Exception as e:  # out of shared memory or registers: not a candidate
                    print(f"  {c}: {type(e).__name__}")
            times.sort(key=lambda t: t[0])
            print(f"{name}: " + "; ".join(f"{ms:.3f} ms {c}" for ms, c in times[:3]))
            for ms, c in times:
                totals.setdefault(c, []).append(ms / times[0][0])
        best = min((sum(r) / len(r), c) for c, r in totals.items()
                   if len(r) == max(map(len, totals.values())))
        print(f"{kind}: best overall {best[1]}, mean {best[0]:.2f}x of each shape's best")


def print_table(header: list[str], rows: list[list[str]]) -> None:
    widths = [max(len(r[i]) for r in [header, *rows]) for i in range(len(header))]
    for r in [header, ["-" * w for w in widths], *rows]:
        print("  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in
                        enumerate(zip(r, widths))))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--dtype", default="bfloat16", choices=["float16", "bfloat16", "float32"])
    p.add_argument("--block-size", type=int, default=16, help="tokens per KV block")
    p.add_argument("--sweep", action="store_true", help="time every kernel configuration (GPU)")
    args = p.parse_args()
    on_gpu = torch.cuda.is_available()
    dtype = getattr(torch, args.dtype)
    if args.sweep:
        if not on_gpu:
            p.error("--sweep times the Triton kernels: it needs a GPU")
        sweep(dtype, args.block_size)
        return
    if on_gpu:
        peak = peak_bandwidth()
        ours = "triton"
        print(f"{torch.cuda.get_device_name()}: peak memory bandwidth {peak / 1e9:.0f} GB/s, "
              f"{args.dtype}, block size {args.block_size}")
    else:
        peak, ours, dtype = None, "torch reference", torch.float32
        print("no CUDA device: timing the torch references (the CPU backend) beside SDPA on CPU, "
              "fp32, small shapes; the Triton kernels are not timed (the interpreter checks "
              "correctness only)")
    header = ["shape", f"{ours} ms", "achieved", "of peak", "sdpa ms", "achieved", "of peak"]
    print_table(header, decode_rows(dtype, args.block_size, on_gpu, peak)
                + prefill_rows(dtype, args.block_size, on_gpu))


if __name__ == "__main__":
    main()
