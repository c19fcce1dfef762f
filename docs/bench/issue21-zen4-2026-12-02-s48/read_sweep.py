"""Plain read of scattered blocks (K and V streams, attention_resident's read_blocks) against
bytes per block and prefetch distance; all cases in rounds, median GB/s. (kernel_experiments.txt, 2).

    [AHEADS='8 16 32'] [THP_MEM_ALLOC_ENABLE=1] .venv/bin/python docs/bench/issue21-zen4-2026-12-02-s48/read_sweep.py 9
"""
import sys, statistics, time, itertools
sys.path.insert(0, str(__import__("pathlib").Path(__file__).resolve().parents[3]))
import torch
from benchmarks.attention_resident import block_reader
fn = block_reader()
torch.manual_seed(0)
TOTAL = 64 * 2000 * 4 * 64 * 4          # bytes of K per call (fp32 64x2000: 131 MB), same for every case
layers = 8
AHEADS = [int(a) * 1024 for a in (__import__("os").environ.get("AHEADS", "8 16 32").split())]
reps = int(sys.argv[1]) if len(sys.argv) > 1 else 9
cases = {}
for bb in (4096, 8192, 16384, 32768):
    n = TOTAL // bb
    caches = [torch.empty((2, n + 64, bb), dtype=torch.uint8).fill_(1) for _ in range(layers)]
    offs = (torch.randperm(n + 64)[:n].to(torch.int64) * bb).contiguous()
    for ahead in AHEADS:
        cases[(bb, ahead)] = (caches, offs, n, bb, ahead)
rates = {k: [] for k in cases}
keys = list(cases)
for rep in range(reps):
    order = keys if rep % 2 == 0 else keys[::-1]
    for k in order:
        caches, offs, n, bb, ahead = cases[k]
        c = caches[rep % layers]
        t = time.perf_counter()
        fn(c.data_ptr(), offs.data_ptr(), n, bb, c.stride(0), ahead)
        rates[k].append(2 * TOTAL / (time.perf_counter() - t) / 1e9)
for k in keys:
    r = sorted(rates[k])
    print(f"block {k[0]//1024:3d} KiB  ahead {k[1]//1024:3d} KiB  {statistics.median(r):5.1f} GB/s [{r[len(r)//4]:.1f}, {r[3*len(r)//4]:.1f}]")
