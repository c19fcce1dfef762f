"""Two builds of the CPU attention kernels side by side: each case calls one, then the
other, in turn, so both see the same machine state (this kind of VM moves 5-10% from minute to
minute, more than most kernel changes). A build is a source tree and compiler flags:

    .venv/bin/python benchmarks/kernel_ab.py --old-rev HEAD~1           # the last commit's
    .venv/bin/python benchmarks/kernel_ab.py --new-flags -DPDSERVE_NO_DECODE_DP  # a variant

`--old-rev` takes kernels/csrc of a git revision (default: this tree); `--old-flags` and
`--new-flags` add compiler flags (macros the sources read, e.g. PDSERVE_AHEAD and
PDSERVE_AHEAD_BF16, the decode's prefetch distance in float32 and bfloat16, PDSERVE_NO_DECODE_DP).
Cases are benchmarks/attention.py's decode shapes (each call on the next
of 8 caches as a step goes through its layers) and, with `--kinds prefill`, its prefill shape
(`--kinds decode prefill` for both). Prints the median [min-max] ms of each build, the ratio and
the largest difference between their outputs. `--decodes 2x2000 8x320+2x1000` takes other
decode batches, and `--caches 1` calls every rep on one cache, which then stays in the CPU's
caches: the kernel's own work per position without the memory's pace.
"""
from __future__ import annotations

import argparse
import io
import itertools
import statistics
import subprocess
import sys
import tarfile
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from benchmarks.attention import (  # noqa: E402
    BLOCK,
    DECODES,
    HEAD_DIM,
    HEADS,
    KV_HEADS,
    LAYERS,
    PREFILLS,
    scattered_blocks,
    scattered_decode,
)
from kernels.cpu_attention import (  # noqa: E402
    SOURCES,
    build_flags,
    cpu_isa,
    paged_decode_attention,
    paged_prefill_attention,
)


def sources_of(rev: str | None, into: Path) -> Path:
    """kernels/csrc of `rev` unpacked under `into` (this tree's when rev is None)."""
    if rev is None:
        return SOURCES[0].parent
    tar = subprocess.run(["git", "-C", str(ROOT), "archive", rev, "kernels/csrc"],
                         check=True, capture_output=True).stdout
    with tarfile.open(fileobj=io.BytesIO(tar)) as t:
        t.extractall(into, filter="data")
    return into / "kernels" / "csrc"


def build(name: str, src: Path, flags: list[str], build_root: Path):
    from torch.utils import cpp_extension
    out = build_root / name
    out.mkdir(parents=True, exist_ok=True)
    cflags, ldflags = build_flags(name, cpu_isa(), flags)
    # every .cpp of that revision's csrc (a revision's file list may differ from this tree's)
    cpp_extension.load(name=name, sources=sorted(str(p) for p in src.glob("*.cpp")),
                       build_directory=str(out), extra_cflags=cflags, extra_ldflags=ldflags,
                       is_python_module=False)
    return getattr(torch.ops, name)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--old-rev", help="git revision of the old build's sources (default: this "
                                      "tree)")
    ap.add_argument("--old-flags", default="")
    ap.add_argument("--new-flags", default="")
    ap.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"])
    ap.add_argument("--reps", type=int, default=15)
    ap.add_argument("--kinds", nargs="+", choices=["decode", "prefill"], default=["decode"])
    ap.add_argument("--prefills", nargs="+", metavar="CHUNKxCACHED",
                    help="prefill shapes instead of attention.py's, e.g. 1024x2048 128x0")
    ap.add_argument("--decodes", nargs="+", metavar="NxLEN[+NxLEN]", type=decode_batch,
                    help="decode batches instead of attention.py's, e.g. 2x2000 48x320+16x3000")
    ap.add_argument("--caches", type=int, default=LAYERS, choices=range(1, LAYERS + 1),
                    metavar=f"1..{LAYERS}",
                    help="layers' caches the decode calls go through in turn (1: one cache, "
                         "read again each call from the CPU's caches when it fits)")
    ap.add_argument("--prefill-gemm", type=int, choices=[0, 1, 2, 3],
                    help="the prefill's bfloat16 tile products (cpu_attention.PREFILL_*: 0 "
                         "widened to float, 1 MKL's bf16 GEMM, 2 bf16 dot products, 3 AMX "
                         "tiles); default: what serving takes on this CPU")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        tmp_path = Path(tmp)
        old_src = sources_of(args.old_rev, tmp_path / "old")
        builds = {"old": build("pdserve_ab_old", old_src, args.old_flags.split(), tmp_path),
                  "new": build("pdserve_ab_new", SOURCES[0].parent, args.new_flags.split(),
                               tmp_path)}
        print(f"{cpu_isa()} builds; old: {args.old_rev or 'this tree'} {args.old_flags}; "
              f"new: this tree {args.new_flags}")
        gen = torch.Generator().manual_seed(0)
        prefills = PREFILLS if not args.prefills else {
            f"prefill {c} over {a}": (int(c), int(a))
            for c, a in (shape.split("x") for shape in args.prefills)}
        decodes = DECODES if not args.decodes else dict(args.decodes)
        for dtype_name, threads in itertools.product(args.dtypes, args.threads):
            dtype = getattr(torch, dtype_name)
            torch.set_num_threads(threads)
            cases = [(case, decode_call(lengths, dtype, gen, args.caches))
                     for case, lengths in decodes.items()
                     if "decode" in args.kinds]
            cases += [(case, prefill_call(chunk, cached, dtype, gen, args.prefill_gemm))
                      for case, (chunk, cached) in prefills.items() if "prefill" in args.kinds]
            for case, call in cases:
                times: dict[str, list[float]] = {"old": [], "new": []}
                outs = {k: call(ops, 0) for k, ops in builds.items()}
                for rep in range(args.reps):  # the order turned each rep: the second call
                    order = list(builds.items())  # of a pair can find the first's lines warm
                    for label, ops in (order if rep % 2 == 0 else order[::-1]):
                        start = time.perf_counter()
                        call(ops, rep + 1)
                        times[label].append((time.perf_counter() - start) * 1e3)
                old, new = (statistics.median(times[k]) for k in ("old", "new"))
                diff = (outs["old"].float() - outs["new"].float()).abs().max().item()
                print(f"{case:24s} {dtype_name:9s} {threads} thr  old {old:7.2f} "
                      f"[{min(times['old']):.2f}-{max(times['old']):.2f}]  new {new:7.2f} "
                      f"[{min(times['new']):.2f}-{max(times['new']):.2f}]  {old / new:.2f}x  "
                      f"max diff {diff:.1e}", flush=True)


def decode_batch(shape: str) -> tuple[str, list[int]]:
    """"48x320+16x3000" -> ("decode 48x320+16x3000", 48 lengths of 320 and 16 of 3000)."""
    lengths = []
    for part in shape.split("+"):
        count, _, length = part.partition("x")
        if not (count.isdigit() and length.isdigit() and int(count) > 0 and int(length) > 0):
            raise argparse.ArgumentTypeError(f"{shape!r}: expected COUNTxLENGTH[+...], e.g. 2x2000")
        lengths += [int(length)] * int(count)
    return f"decode {shape}", lengths


def decode_call(lengths: list[int], dtype: torch.dtype, gen: torch.Generator,
                layers: int = LAYERS):
    """call(ops, i): one decode over scattered blocks, on the i-th of `layers` layers' caches
    (in turn across both builds, as a step goes through its layers)."""
    q, caches, tables, lens = scattered_decode(lengths, dtype, gen)
    caches = caches[:layers]
    return lambda ops, i: paged_decode_attention(q, caches[i % len(caches)], tables, lens,
                                                 HEAD_DIM ** -0.5, ops=ops)


def prefill_call(chunk: int, cached: int, dtype: torch.dtype, gen: torch.Generator,
                 gemm: int | None = None):
    """call(ops, i): a chunk's causal attention over its cached prefix and itself, in the
    cache's dtype with the tile products serving uses for it (or `gemm`'s)."""
    rows, num_blocks = scattered_blocks([cached + chunk], gen)
    cache = torch.randn((2, num_blocks, BLOCK, KV_HEADS, HEAD_DIM), generator=gen).to(dtype)
    q = torch.randn((chunk, HEADS, HEAD_DIM), generator=gen).to(dtype)
    tables, starts, done = torch.tensor(rows), torch.tensor([0, chunk]), torch.tensor([cached])
    return lambda ops, i: paged_prefill_attention(q, cache, tables, starts, done,
                                                  HEAD_DIM ** -0.5, gemm=gemm, ops=ops)

if __name__ == "__main__":
    main()
