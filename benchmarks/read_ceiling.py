"""How near each dtype's decode kernel reads K/V to the rate this machine's memory gives its
cache's access pattern, and how that rate depends on the bytes a block holds: the bound under
the attention benchmark's rule that bfloat16 reads at least as fast per byte as float32.

    .venv/bin/python benchmarks/read_ceiling.py [--reps 21] [--bf16-block 16] [--out DIR]

A decode call reads each sequence's blocks, and a block of B positions holds its keys in one
contiguous run of B x kv_heads x head_dim values, its values in another: 8 KiB each in bfloat16
and 16 KiB in float32 at B = 16 for the 56M Llama, so at the same block size bfloat16 jumps to a
new place in memory twice as often per byte. First, on one thread, for each of attention.py's
decode batches: the served kernel and a plain read of the same blocks in the same order
(attention_resident.py's read_blocks: the K and V streams, prefetched as the kernel does, no
arithmetic), in both dtypes, the four calls in turn (the order turned each round), each on the
next of its own layers' caches. Prints each one's GB/s of K/V, each kernel's rate over its own
plain read's, and bfloat16's over float32's per byte for the kernels and for the plain reads,
all call by call. Then the plain read alone over blocks of 2 to 64 KiB a stream, in rounds: the
curve both dtypes' blocks sit on. Writes read_ceiling.json and read_ceiling.png to --out.
"""
from __future__ import annotations

import argparse
import itertools
import json
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks.attention import (  # noqa: E402
    BLOCK,
    DECODES,
    HEAD_DIM,
    KV_HEADS,
    cpu_flags,
    in_turn,
    median_quartiles,
    quartiles,
    scattered_decode,
)
from benchmarks.attention_resident import (  # noqa: E402
    AHEAD_BYTES,
    block_reader,
    decode_over,
    read_over,
)
from kernels.cpu_attention import cpu_isa, load  # noqa: E402

SWEEP_KIB = [2, 4, 8, 16, 32, 64]  # bytes a block holds of each stream, keys or values
SWEEP_STREAM = 64 << 20            # bytes of keys (and of values) one sweep call reads
SWEEP_CACHES = 4                   # caches a sweep case reads in turn


def ratio(rates: dict[str, list[float]], num: str, den: str) -> list[float]:
    return [a / b for a, b in zip(rates[num], rates[den])]


def kernels_and_reads(reps: int, blocks: dict[str, int], reader) -> dict[str, dict]:
    """Per decode batch: each dtype's kernel and plain read of its blocks, in turn."""
    results = {}
    for case, lengths in DECODES.items():
        gen = torch.Generator().manual_seed(0)
        calls = {}
        for dtype in (torch.float32, torch.bfloat16):
            name = str(dtype).removeprefix("torch.")
            inputs = scattered_decode(lengths, dtype, gen, blocks[name])
            nbytes = sum(lengths) * KV_HEADS * HEAD_DIM * 2 * dtype.itemsize
            calls[f"{name} kernel"] = (decode_over(inputs), nbytes)
            calls[f"{name} read"] = (read_over(inputs, reader), nbytes)
        rates = in_turn(calls, reps)
        shares = {"float32 kernel / read": ratio(rates, "float32 kernel", "float32 read"),
                  "bfloat16 kernel / read": ratio(rates, "bfloat16 kernel", "bfloat16 read"),
                  "bfloat16 / float32 per byte, kernels":
                      ratio(rates, "bfloat16 kernel", "float32 kernel"),
                  "bfloat16 / float32 per byte, reads":
                      ratio(rates, "bfloat16 read", "float32 read")}
        gbps = "  ".join(f"{n} {statistics.median(r):5.1f}" for n, r in rates.items())
        print(f"{case:<22} GB/s: {gbps}", flush=True)
        for label, values in shares.items():
            print(f"{'':<22} {label:<38} {median_quartiles(values)}", flush=True)
        results[case] = {"gbps": {n: quartiles(r) for n, r in rates.items()},
                         "ratios": {n: quartiles(r) for n, r in shares.items()}}
    return results


def sweep_call(reader, caches: list[torch.Tensor], offsets: torch.Tensor, block_bytes: int):
    """A plain read of the blocks at `offsets`, each call on the next of `caches`."""
    turn = itertools.count()

    def call() -> None:
        cache = caches[next(turn) % len(caches)]
        reader(cache.data_ptr(), offsets.data_ptr(), offsets.numel(), block_bytes,
               cache.stride(0), AHEAD_BYTES[torch.float32])  # the float32 kernel's distance
    return call


def block_sweep(reps: int, reader) -> dict[int, dict[str, float]]:
    """The plain read over scattered blocks of each SWEEP_KIB size (K and V streams apart, as
    in the served cache), the sizes in turn."""
    gen = torch.Generator().manual_seed(0)
    calls = {}
    for kib in SWEEP_KIB:
        block_bytes = kib << 10
        n = SWEEP_STREAM // block_bytes
        caches = [torch.ones((2, n, block_bytes), dtype=torch.uint8) for _ in range(SWEEP_CACHES)]
        offsets = (torch.randperm(n, generator=gen) * block_bytes).contiguous()
        calls[str(kib)] = (sweep_call(reader, caches, offsets, block_bytes), 2 * SWEEP_STREAM)
    rates = in_turn(calls, reps)
    for kib in SWEEP_KIB:
        print(f"plain read, blocks of {kib:2d} KiB a stream: "
              f"{median_quartiles(rates[str(kib)])} GB/s", flush=True)
    return {kib: quartiles(rates[str(kib)]) for kib in SWEEP_KIB}


def plot(results: dict, sweep: dict, blocks: dict[str, int], path: Path, title: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(9, 5.5))
    kib = list(sweep)
    med = [sweep[k]["median"] for k in kib]
    err = [[m - sweep[k]["q1"] for k, m in zip(kib, med)],
           [sweep[k]["q3"] - m for k, m in zip(kib, med)]]
    ax.errorbar(kib, med, yerr=err, color="black", marker="o", capsize=3,
                label="plain read of scattered blocks (median, quartiles)")
    markers = {"decode 64x320": "s", "decode 64x2000": "^", "decode 48x320+16x3000": "D"}
    colours = {"float32": "tab:blue", "bfloat16": "tab:orange"}
    for case, r in results.items():
        for dtype, colour in colours.items():
            at = blocks[dtype] * KV_HEADS * HEAD_DIM * getattr(torch, dtype).itemsize / 1024
            for kind, face in (("kernel", colour), ("read", "none")):
                ax.scatter([at], [r["gbps"][f"{dtype} {kind}"]["median"]], marker=markers[case],
                           facecolors=face, edgecolors=colour, s=60,
                           label=f"{dtype} {kind}, {case}")
    ax.set_xscale("log", base=2)
    ax.set_xticks(kib, [str(k) for k in kib])
    ax.set_xlabel("KiB a block holds of keys (and of values)")
    ax.set_ylabel("GB/s of K/V, one thread")
    ax.set_title(title, fontsize=9)
    ax.legend(fontsize=7, loc="lower right")
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--reps", type=int, default=21, help="rounds of calls per case")
    ap.add_argument("--bf16-block", type=int, default=BLOCK,
                    help=f"bfloat16's positions per block (float32's: {BLOCK})")
    ap.add_argument("--out", type=Path, default=Path("benchmarks/results"))
    args = ap.parse_args()
    load()
    torch.set_num_threads(1)
    blocks = {"float32": BLOCK, "bfloat16": args.bf16_block}
    title = (f"decode K/V reads against the plain read's curve; CPU flags: {cpu_flags()};\n"
             f"kernels {cpu_isa()}; blocks of {BLOCK} (float32), {args.bf16_block} (bfloat16)")
    print(title.replace("\n", " ") + f"; one thread, {args.reps} rounds", flush=True)
    reader = block_reader()
    results = kernels_and_reads(args.reps, blocks, reader)
    sweep = block_sweep(args.reps, reader)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "read_ceiling.json").write_text(json.dumps(
        {"cpu_flags": cpu_flags(), "isa": cpu_isa(), "blocks": blocks, "reps": args.reps,
         "cases": results, "sweep_kib": sweep}, indent=1))
    plot(results, sweep, blocks, args.out / "read_ceiling.png", title)
    print(f"wrote {args.out / 'read_ceiling.json'} and {args.out / 'read_ceiling.png'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
