"""Two builds of the CPU decode attention kernel side by side: each case calls one, then the
other, in turn, so both see the same machine state (this kind of VM moves 5-10% from minute to
minute, more than most kernel changes). A build is a source tree and compiler flags:

    .venv/bin/python benchmarks/kernel_ab.py --old-rev HEAD~1           # the last commit's
    .venv/bin/python benchmarks/kernel_ab.py --new-flags -DPDSERVE_NO_DECODE_DP  # a variant

`--old-rev` takes kernels/csrc of a git revision (default: this tree); `--old-flags` and
`--new-flags` add compiler flags (macros the sources read, e.g. PDSERVE_AHEAD,
PDSERVE_NO_DECODE_DP). Cases are benchmarks/attention.py's decode shapes, each call on the next
of 8 caches as a step goes through its layers. Prints the median [min-max] ms of each build,
the ratio and the largest difference between their outputs.
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
from benchmarks.attention import BLOCK, DECODES, HEAD_DIM, HEADS, KV_HEADS, scattered_blocks  # noqa: E402
from kernels.cpu_attention import SOURCES, build_flags, cpu_isa, paged_decode_attention  # noqa: E402


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
        scale = HEAD_DIM ** -0.5
        for dtype_name, threads in itertools.product(args.dtypes, args.threads):
            dtype = getattr(torch, dtype_name)
            torch.set_num_threads(threads)
            for case, lengths in DECODES.items():
                rows, num_blocks = scattered_blocks(lengths, gen)
                width = max(map(len, rows))
                tables = torch.tensor([r + [0] * (width - len(r)) for r in rows])
                lens = torch.tensor(lengths)
                caches = [torch.randn((2, num_blocks, BLOCK, KV_HEADS, HEAD_DIM), generator=gen)
                          .to(dtype) for _ in range(8)]
                q = torch.randn((len(lengths), HEADS, HEAD_DIM), generator=gen).to(dtype)
                turn = itertools.count()
                times: dict[str, list[float]] = {"old": [], "new": []}
                outs = {k: paged_decode_attention(q, caches[0], tables, lens, scale, ops=ops)
                        for k, ops in builds.items()}
                for _ in range(args.reps):
                    for label, ops in builds.items():
                        cache = caches[next(turn) % len(caches)]
                        start = time.perf_counter()
                        paged_decode_attention(q, cache, tables, lens, scale, ops=ops)
                        times[label].append((time.perf_counter() - start) * 1e3)
                old, new = (statistics.median(times[k]) for k in ("old", "new"))
                diff = (outs["old"].float() - outs["new"].float()).abs().max().item()
                print(f"{case:24s} {dtype_name:9s} {threads} thr  old {old:7.2f} "
                      f"[{min(times['old']):.2f}-{max(times['old']):.2f}]  new {new:7.2f} "
                      f"[{min(times['new']):.2f}-{max(times['new']):.2f}]  {old / new:.2f}x  "
                      f"max diff {diff:.1e}", flush=True)


if __name__ == "__main__":
    main()
