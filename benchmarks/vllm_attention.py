"""pdserve's attention kernels beside vLLM-CPU's on the same contexts, in float32 and bfloat16,
call by call: decode (each kernel's GB/s of K/V read and its bfloat16 read rate per byte over
its float32's, the attention benchmark's rule: at least 1) and a prefill chunk over a cached
prefix (GFLOP/s), and pdserve's calls over vLLM's.

    PATH=.venv/bin:$PATH .peers/venv-vllm/bin/python benchmarks/vllm_attention.py \\
        [--reps 21] [--threads 1 2] [--blocks 16 128]

Runs in vLLM's environment (../shared/peers/setup_vllm.sh; the same torch as pdserve's, whose
kernels it loads from their build cache, `make install` having built them). For each decode
batch and prefill shape of benchmarks/attention.py and each block size (16: pdserve's default;
128: vLLM-CPU's), the same random keys and values are written into both caches, pdserve's
([2, blocks, block_size, kv_heads, head_dim]) and vLLM's (its own write op, for the kernel it
picks for that block size, "vec16" or "vec" on AVX-512 without AMX), over the same scattered
blocks; up to LAYERS of them (layer_count), a call on the next one, as a step goes through its
layers. The outputs are compared before timing. Both kernels split the work over torch's threads.
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
from benchmarks.attention import (  # noqa: E402
    DECODES,
    HEAD_DIM,
    HEADS,
    KV_HEADS,
    PREFILLS,
    cpu_flags,
    layer_count,
    median_quartiles,
    padded_tables,
    scattered_blocks,
)
from kernels import cpu_attention  # noqa: E402

DTYPES = (torch.float32, torch.bfloat16)


def vllm_ops():
    """vLLM's CPU attention ops and its choice of kernel (_get_attn_isa)."""
    from vllm import _custom_ops as ops
    from vllm.v1.attention.backends.cpu_attn import _get_attn_isa
    return ops, _get_attn_isa


def case(specs: list[tuple[int, int]], decode: bool, dtype: torch.dtype, block: int,
         gen: torch.Generator, ops, isa: str):
    """Both kernels' calls on LAYERS layers of the same keys and values for sequences of
    (cached, chunk) positions (`decode`: every chunk 1), each chunk's keys already written, and the
    work a call does: K/V bytes read (decode) or attention FLOPs (prefill)."""
    lengths = [a + n for a, n in specs]
    rows, num_blocks = scattered_blocks(lengths, gen, block)
    tables = padded_tables(rows)
    layer_bytes = 2 * num_blocks * block * KV_HEADS * HEAD_DIM * dtype.itemsize
    layers = layer_count(layer_bytes)
    tokens = sum(n for _, n in specs)
    q = torch.randn((tokens, HEADS, HEAD_DIM), generator=gen).to(dtype)
    seq_lens = torch.tensor(lengths)
    start = torch.tensor([0] + [n for _, n in specs]).cumsum(0)
    cached = torch.tensor([a for a, _ in specs])
    # every slot of every block in use: the tokens in slot order
    slots = torch.arange(num_blocks * block)
    ours, theirs = [], []
    for _ in range(layers):
        k = torch.randn((num_blocks * block, KV_HEADS, HEAD_DIM), generator=gen).to(dtype)
        v = torch.randn((num_blocks * block, KV_HEADS, HEAD_DIM), generator=gen).to(dtype)
        cache = torch.stack((k, v)).view(2, num_blocks, block, KV_HEADS, HEAD_DIM).contiguous()
        ours.append(cache)
        kv = torch.zeros((num_blocks, KV_HEADS, 2 * block, HEAD_DIM), dtype=dtype)
        key_cache, value_cache = kv.chunk(2, dim=2)
        ops.cpu_attn_reshape_and_cache(k, v, key_cache, value_cache, slots, isa)
        theirs.append((key_cache, value_cache))
    start32, lens32, tables32 = (t.to(torch.int32) for t in (start, seq_lens, tables))
    meta = ops.cpu_attn_get_scheduler_metadata(
        num_reqs=len(specs), num_heads=HEADS, num_kv_heads=KV_HEADS, head_dim=HEAD_DIM,
        seq_lens=lens32, dtype=dtype, query_start_loc=start32, causal=True,
        sliding_window_size=-1, isa=isa, enable_kv_split=True)
    scale = HEAD_DIM ** -0.5
    mine, yours = torch.empty_like(q), torch.empty_like(q)
    lib = cpu_attention.load()
    t1, t2 = itertools.count(), itertools.count()

    def pdserve() -> torch.Tensor:
        cache = ours[next(t1) % layers]
        if decode:
            return cpu_attention.paged_decode_attention(q, cache, tables, seq_lens, scale,
                                                        out=mine, ops=lib)
        return cpu_attention.paged_prefill_attention(q, cache, tables, start, cached, scale,
                                                     out=mine, ops=lib)

    def vllm() -> torch.Tensor:
        key_cache, value_cache = theirs[next(t2) % layers]
        ops.cpu_attention_with_kv_cache(
            query=q, key_cache=key_cache, value_cache=value_cache, output=yours,
            query_start_loc=start32, seq_lens=lens32, scale=scale, causal=True,
            alibi_slopes=None, sliding_window=-1, block_table=tables32, softcap=0.0,
            scheduler_metadata=meta, s_aux=None)
        return yours
    if decode:
        work = sum(lengths) * KV_HEADS * HEAD_DIM * 2 * dtype.itemsize
    else:  # q.k and p.v over each query's keys: its prefix and the chunk up to itself
        work = sum(4 * HEAD_DIM * HEADS * (n * a + n * (n + 1) // 2) for a, n in specs)
    return pdserve, vllm, work, layers


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--reps", type=int, default=21, help="calls of each kernel and dtype")
    ap.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--blocks", type=int, nargs="+", default=[16, 128], help="block sizes")
    args = ap.parse_args()
    ops, get_isa = vllm_ops()
    print(f"CPU flags: {cpu_flags()}; {HEADS} query heads / {KV_HEADS} kv heads, head_dim "
          f"{HEAD_DIM}; {args.reps} calls of each kernel and dtype, in turn; GB/s of K/V read "
          f"(medians), per byte: bfloat16's rate over float32's, pdserve/vllm: vLLM's call time "
          f"over pdserve's (> 1: pdserve faster), medians [quartiles] call by call", flush=True)
    cases = {name: [(n - 1, 1) for n in lengths] for name, lengths in DECODES.items()}
    cases |= {name: [(cached, chunk)] for name, (chunk, cached) in PREFILLS.items()}
    for threads, block in itertools.product(args.threads, args.blocks):
        torch.set_num_threads(threads)
        isas = {dtype: get_isa(dtype, block, HEAD_DIM) for dtype in DTYPES}
        for name, specs in cases.items():
            decode = all(n == 1 for _, n in specs)  # else a prefill chunk
            gen = torch.Generator().manual_seed(0)
            calls, diffs, layers = {}, [], 0
            for dtype in DTYPES:
                pd, vl, work, layers = case(specs, decode, dtype, block, gen, ops, isas[dtype])
                diffs.append((pd().float() - vl().float()).abs().max().item())
                calls[("pdserve", dtype)] = (pd, work)
                calls[("vllm", dtype)] = (vl, work)
            times: dict[tuple, list[float]] = {key: [] for key in calls}
            keys = list(calls)
            for rep in range(args.reps):  # the order turned each rep
                for key in keys[rep % len(keys):] + keys[:rep % len(keys)]:
                    start = time.perf_counter()
                    calls[key][0]()
                    times[key].append(time.perf_counter() - start)
            rate = {key: calls[key][1] / statistics.median(t) / 1e9 for key, t in times.items()}
            versus = {d: median_quartiles([v / p for p, v in zip(times[("pdserve", d)],
                                                       times[("vllm", d)])]) for d in DTYPES}
            f32, b16 = torch.float32, torch.bfloat16
            unit = "GB/s of K/V" if decode else "GFLOP/s"
            line = (f"{name:<22} block {block:<3d} {threads} thr ({isas[f32]}/{isas[b16]}, "
                    f"{layers} caches)  {unit}: float32 pdserve {rate[('pdserve', f32)]:5.1f} "
                    f"vllm {rate[('vllm', f32)]:5.1f}, bfloat16 pdserve "
                    f"{rate[('pdserve', b16)]:5.1f} vllm {rate[('vllm', b16)]:5.1f}\n    ")
            if decode:
                per_byte = {k: median_quartiles([f / (2 * b) for f, b in zip(times[(k, f32)],
                                                                     times[(k, b16)])])
                            for k in ("pdserve", "vllm")}
                line += (f"bfloat16 per byte over float32: pdserve {per_byte['pdserve']}, vllm "
                         f"{per_byte['vllm']}; ")
            print(line + f"pdserve/vllm: float32 {versus[f32]}, bfloat16 {versus[b16]}; outputs "
                  f"differ by at most {diffs[0]:.1e} (float32), {diffs[1]:.1e} (bfloat16)",
                  flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
