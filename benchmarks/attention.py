"""CPU attention over the paged KV cache: the cpu backend's kernels beside the torch backend that
served before them (gather every context into a padded tensor, then SDPA), in one run.

    .venv/bin/python benchmarks/attention.py [--reps 5] [--out benchmarks/results]

Shapes are the 56M Llama's (8 query heads, 4 KV heads, head_dim 64, blocks of 16) with scattered
block tables: decode of 64 x 320, 64 x 2000 and a bimodal batch (48 x 320 + 16 x 3000), and the
prefill of a 2048-token chunk over a 2048-token cached prefix; float32 and bfloat16; 1 and 2
threads. Each case times one layer's attention call of each backend, the step's KV write
included (the same for both), each call on the next of the model's 8 layers' caches (as many as
fit in 512 MiB), as a decode step goes through them: one layer's K/V, called again, would still
be partly in the last-level cache and read faster than any step reads it. Decode reports GB/s
of K/V read (bytes of the contexts' keys and values over the time) beside this machine's memcpy
bandwidth on as many threads; prefill reports GFLOP/s (4 * head_dim flops per visible query-key
pair and head). Writes attention.json and attention.png to --out.
"""
from __future__ import annotations

import argparse
import itertools
import json
import platform
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from common.models.attention import AttentionMetadata, CpuAttentionBackend, TorchAttentionBackend  # noqa: E402

HEADS, KV_HEADS, HEAD_DIM, BLOCK = 8, 4, 64, 16
DECODES = {"decode 64x320": [320] * 64, "decode 64x2000": [2000] * 64,
           "decode 48x320+16x3000": [320] * 48 + [3000] * 16}
PREFILLS = {"prefill 2048 over 2048": (2048, 2048)}
LAYERS, LAYERS_BYTES = 8, 512 << 20  # caches a case goes through in turn, at most this much


def cpu_flags() -> str:
    flags = set()
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("flags"):
            flags = set(line.split(":", 1)[1].split())
            break
    keep = ["avx2", "avx512f", "avx512_bf16", "amx_bf16", "amx_tile"]
    return " ".join(f for f in keep if f in flags) or "none of avx2/avx512"


def timed(fn, reps: int) -> list[float]:
    fn()  # warm: first-touch of buffers, thread pool start
    out = []
    for _ in range(reps):
        start = time.perf_counter()
        fn()
        out.append(time.perf_counter() - start)
    return out


def memcpy_gbps(threads: int, reps: int) -> float:
    torch.set_num_threads(threads)
    src = torch.ones(64 * 2**20)  # 256 MiB
    dst = torch.empty_like(src)
    return src.numel() * 4 / min(timed(lambda: dst.copy_(src), reps)) / 1e9


def scattered_blocks(lengths: list[int], gen: torch.Generator,
                     block: int = BLOCK) -> tuple[list[list[int]], int]:
    need = [-(-n // block) for n in lengths]
    ids = torch.randperm(sum(need) + 8, generator=gen).tolist()
    tables, at = [], 0
    for n in need:
        tables.append(ids[at:at + n])
        at += n
    return tables, sum(need) + 8


def layer_count(layer_bytes: int) -> int:
    """Layers' caches a case goes through in turn: as many as fit in LAYERS_BYTES, 1 to LAYERS."""
    return max(1, min(LAYERS, LAYERS_BYTES // layer_bytes))


def padded_tables(rows: list[list[int]]) -> torch.Tensor:
    """Block tables [sequences, longest], each row zero-padded past its own blocks."""
    width = max(map(len, rows))
    return torch.tensor([r + [0] * (width - len(r)) for r in rows])


def quartiles(values: list[float]) -> dict[str, float]:
    """The median and the first and third quartiles of values."""
    r = sorted(values)
    return {"median": statistics.median(r), "q1": r[len(r) // 4], "q3": r[3 * len(r) // 4]}


def median_quartiles(values: list[float]) -> str:
    """`median [first quartile, third quartile]` of values, two decimals."""
    q = quartiles(values)
    return f"{q['median']:.2f} [{q['q1']:.2f}, {q['q3']:.2f}]"


def in_turn(calls: dict[str, tuple], reps: int) -> dict[str, list[float]]:
    """GB/s of each (call, bytes) over `reps` rounds, the calls in turn, the order turned each
    round (a call right after another finds the machine as that one left it); one warm call
    each first (first touch, thread pool)."""
    rates: dict[str, list[float]] = {name: [] for name in calls}
    for call, _ in calls.values():
        call()
    names = list(calls)
    for rep in range(reps):
        for name in names if rep % 2 == 0 else names[::-1]:
            call, nbytes = calls[name]
            start = time.perf_counter()
            call()
            rates[name].append(nbytes / (time.perf_counter() - start) / 1e9)
    return rates


def scattered_decode(lengths: list[int], dtype: torch.dtype, gen: torch.Generator,
                     block: int = BLOCK):
    """The CPU decode kernel's inputs over scattered blocks of `block` positions: q, the caches
    of LAYERS layers (a step reads them in turn), the block tables (zero-padded to the longest)
    and the lengths."""
    rows, num_blocks = scattered_blocks(lengths, gen, block)
    tables = padded_tables(rows)
    caches = [torch.randn((2, num_blocks, block, KV_HEADS, HEAD_DIM), generator=gen).to(dtype)
              for _ in range(LAYERS)]
    q = torch.randn((len(lengths), HEADS, HEAD_DIM), generator=gen).to(dtype)
    return q, caches, tables, torch.tensor(lengths)


def decode_case(lengths: list[int], dtype: torch.dtype, gen: torch.Generator,
                block: int = BLOCK):
    # every sequence's last position is the new token: written by the step, then attended
    tables, num_blocks = scattered_blocks(lengths, gen, block)
    meta = AttentionMetadata.build([(n - 1, t) for n, t in zip(lengths, tables)], [], block)
    rows = len(lengths)
    kv_bytes = sum(lengths) * KV_HEADS * HEAD_DIM * 2 * torch.finfo(dtype).bits // 8
    return meta, num_blocks, rows, kv_bytes, None


def prefill_case(chunk: int, cached: int, dtype: torch.dtype, gen: torch.Generator):
    tables, num_blocks = scattered_blocks([cached + chunk], gen)
    meta = AttentionMetadata.build([], [(cached, chunk, tables[0])], BLOCK)
    pairs = chunk * cached + chunk * (chunk + 1) // 2
    return meta, num_blocks, chunk, None, 4 * HEAD_DIM * pairs * HEADS


def step_inputs(case, dtype: torch.dtype, gen: torch.Generator, block: int = BLOCK):
    """A case's layers' caches (as many as fit in LAYERS_BYTES, at most LAYERS: a call goes on
    the next one, as a step goes through its layers) and the step's q, k and v."""
    _, num_blocks, rows, _, _ = case
    shape = (2, num_blocks, block, KV_HEADS, HEAD_DIM)
    layer_bytes = torch.Size(shape).numel() * torch.finfo(dtype).bits // 8
    caches = [torch.randn(shape, generator=gen).to(dtype) for _ in range(layer_count(layer_bytes))]
    q = torch.randn((rows, HEADS, HEAD_DIM), generator=gen).to(dtype)
    k = torch.randn((rows, KV_HEADS, HEAD_DIM), generator=gen).to(dtype)
    v = torch.randn((rows, KV_HEADS, HEAD_DIM), generator=gen).to(dtype)
    return caches, q, k, v


def run_case(name, case, dtype, threads, backends, reps, gen) -> dict:
    torch.set_num_threads(threads)
    meta, _, _, kv_bytes, flops = case
    caches, q, k, v = step_inputs(case, dtype, gen)
    turn = itertools.count()
    result = {"case": name, "dtype": str(dtype).removeprefix("torch."), "threads": threads}
    for label, backend in backends.items():
        times = timed(lambda backend=backend: backend.forward(
            q, k, v, caches[next(turn) % len(caches)], meta, HEAD_DIM ** -0.5), reps)
        med = statistics.median(times)
        entry = {"ms": med * 1e3, "ms_min": min(times) * 1e3, "ms_max": max(times) * 1e3}
        if kv_bytes:
            entry["gbps"] = kv_bytes / med / 1e9
        if flops:
            entry["gflops"] = flops / med / 1e9
        result[label] = entry
    return result


def plot(results: list[dict], memcpy: dict[int, float], path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    decode = [r for r in results if "gbps" in r["new"]]
    prefill = [r for r in results if "gflops" in r["new"]]
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(15, 5.5),
                                   gridspec_kw={"width_ratios": [3, 1]})
    labels = [f"{r['case'].removeprefix('decode ')}\n{r['dtype']}, {r['threads']} thr"
              for r in decode]
    xs = range(len(decode))
    ax1.bar([x - 0.2 for x in xs], [r["old"]["gbps"] for r in decode], 0.4,
            label="torch backend (gather + SDPA)")
    ax1.bar([x + 0.2 for x in xs], [r["new"]["gbps"] for r in decode], 0.4,
            label="cpu backend (paged kernel)")
    for threads, gbps in memcpy.items():
        ax1.axhline(gbps, ls="--", lw=1, color="grey" if threads == 1 else "black")
        ax1.text(len(decode) - 0.5, gbps, f"memcpy, {threads} thr", va="bottom", ha="right",
                 fontsize=8)
    ax1.set_xticks(list(xs), labels, fontsize=7)
    ax1.set_ylabel("GB/s of K/V read")
    ax1.set_title("decode attention, one layer")
    ax1.legend(fontsize=8)
    plabels = [f"{r['dtype']}\n{r['threads']} thr" for r in prefill]
    px = range(len(prefill))
    ax2.bar([x - 0.2 for x in px], [r["old"]["gflops"] for r in prefill], 0.4, label="torch")
    ax2.bar([x + 0.2 for x in px], [r["new"]["gflops"] for r in prefill], 0.4, label="cpu")
    ax2.set_xticks(list(px), plabels, fontsize=7)
    ax2.set_ylabel("GFLOP/s")
    ax2.set_title("prefill 2048 over a 2048 cached prefix")
    ax2.legend(fontsize=8)
    fig.suptitle(f"{platform.processor() or platform.machine()}, flags: {cpu_flags()}")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--reps", type=int, default=5, help="timed calls per case (median reported)")
    p.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    p.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"])
    p.add_argument("--out", default=str(Path(__file__).parent / "results"))
    args = p.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    backends = {"old": TorchAttentionBackend(), "new": CpuAttentionBackend()}
    memcpy = {t: memcpy_gbps(t, args.reps) for t in args.threads}
    print(f"CPU flags: {cpu_flags()}; memcpy " +
          ", ".join(f"{g:.1f} GB/s on {t} thr" for t, g in memcpy.items()))
    gen = torch.Generator().manual_seed(0)
    results = []
    head = f"{'case':<24} {'dtype':<9} {'thr':>3} {'old ms':>16} {'new ms':>16} {'x':>6}  rate"
    print(head)
    for dtype_name in args.dtypes:
        dtype = getattr(torch, dtype_name)
        cases = {n: decode_case(lens, dtype, gen) for n, lens in DECODES.items()}
        cases.update({n: prefill_case(*s, dtype, gen) for n, s in PREFILLS.items()})
        for name, case in cases.items():
            for threads in args.threads:
                r = run_case(name, case, dtype, threads, backends, args.reps, gen)
                results.append(r)
                old, new = r["old"], r["new"]
                if "gbps" in new:
                    rate = (f"{old['gbps']:.1f} -> {new['gbps']:.1f} GB/s "
                            f"({new['gbps'] / memcpy[threads]:.0%} of memcpy)")
                else:
                    rate = f"{old['gflops']:.1f} -> {new['gflops']:.1f} GFLOP/s"
                print(f"{name:<24} {dtype_name:<9} {threads:>3} "
                      f"{old['ms']:7.2f} [{old['ms_min']:.1f}-{old['ms_max']:.1f}] "
                      f"{new['ms']:7.2f} [{new['ms_min']:.1f}-{new['ms_max']:.1f}] "
                      f"{old['ms'] / new['ms']:5.1f}x  {rate}", flush=True)
    (out / "attention.json").write_text(json.dumps(
        {"cpu_flags": cpu_flags(), "memcpy_gbps": memcpy, "results": results}, indent=1))
    plot(results, memcpy, out / "attention.png")
    print(f"wrote {out / 'attention.json'} and {out / 'attention.png'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
