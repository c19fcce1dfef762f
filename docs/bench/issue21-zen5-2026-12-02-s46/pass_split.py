"""Each decode pass alone (kernel_experiments.txt, 7): three builds of this tree with
pass_split.diff applied (git apply, then revert: the macros skip a pass and the outputs are then
wrong, for timing only), one thread, 64 x 320, resident and scattered, both dtypes.

    git apply docs/bench/issue21-zen5-2026-12-02-s46/pass_split.diff
    .venv/bin/python docs/bench/issue21-zen5-2026-12-02-s46/pass_split.py
    git apply -R docs/bench/issue21-zen5-2026-12-02-s46/pass_split.diff
"""
import sys, tempfile, statistics, time, itertools
from pathlib import Path
import torch
sys.path.insert(0, str(Path(__file__).resolve().parents[3]))
from benchmarks.kernel_ab import build
from benchmarks.attention import BLOCK, HEAD_DIM, HEADS, KV_HEADS, scattered_decode
from kernels.cpu_attention import SOURCES, paged_decode_attention
torch.set_num_threads(1)
BATCH, CTX = 64, 320
variants = {"full": [], "keys": ["-DDIAG_NO_VALUES"], "values": ["-DDIAG_NO_KEYS"]}
extra = sys.argv[1:]
with tempfile.TemporaryDirectory() as tmp:
    ops = {k: build(f"diag_{k}", SOURCES[0].parent, f + extra, Path(tmp)) for k, f in variants.items()}
    for dtype in (torch.float32, torch.bfloat16):
        gen = torch.Generator().manual_seed(0)
        q = torch.randn((BATCH, HEADS, HEAD_DIM), generator=gen).to(dtype)
        blocks = CTX // BLOCK
        res = (q, [torch.randn((2, blocks, BLOCK, KV_HEADS, HEAD_DIM), generator=gen).to(dtype)],
               torch.arange(blocks).repeat(BATCH, 1), torch.full((BATCH,), CTX))
        sc = scattered_decode([CTX] * BATCH, dtype, gen)
        for case, (qq, caches, tables, lens) in (("resident", res), ("scattered", sc)):
            times = {k: [] for k in ops}
            turn = itertools.count()
            for rep in range(25):
                for k, o in ops.items():
                    cache = caches[next(turn) % len(caches)]
                    t = time.perf_counter()
                    paged_decode_attention(qq, cache, tables, lens, HEAD_DIM ** -0.5, ops=o)
                    times[k].append(time.perf_counter() - t)
            per = {k: statistics.median(v) / (BATCH * CTX * KV_HEADS) * 1e9 for k, v in times.items()}
            print(f"{str(dtype):15s} {case:9s} " + "  ".join(f"{k} {v:5.1f}" for k, v in per.items()) + " ns/pos/kvhead")
