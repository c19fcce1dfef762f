"""Plain read of scattered blocks: K and V of a block in separate regions (the served cache,
[2][blocks][bytes]) against side by side ([blocks][2][bytes]); median GB/s over rounds. (kernel_experiments.txt, 3).

    .venv/bin/python docs/bench/issue21-zen4-2026-12-02-s48/read_adjacent.py 11
"""
import sys, statistics, time, os
sys.path.insert(0, str(__import__("pathlib").Path(__file__).resolve().parents[3]))
import torch
from benchmarks.attention_resident import block_reader
fn = block_reader()
torch.manual_seed(0)
TOTAL = 64 * 2000 * 4 * 64 * 4
layers, reps = 8, int(sys.argv[1]) if len(sys.argv) > 1 else 11
cases = {}
for bb in (8192, 16384):
    n = TOTAL // bb
    perm = torch.randperm(n + 64)[:n].to(torch.int64)
    sep = [torch.ones((2, n + 64, bb), dtype=torch.uint8) for _ in range(layers)]
    cases[(bb, "separate")] = (sep, (perm * bb).contiguous(), n, bb, lambda c: c.stride(0))
    adj = [torch.ones((n + 64, 2, bb), dtype=torch.uint8) for _ in range(layers)]
    cases[(bb, "side by side")] = (adj, (perm * 2 * bb).contiguous(), n, bb, lambda c: c.stride(1))
rates = {k: [] for k in cases}
keys = list(cases)
for rep in range(reps):
    for k in (keys if rep % 2 == 0 else keys[::-1]):
        caches, offs, n, bb, vo = cases[k]
        c = caches[rep % layers]
        t = time.perf_counter()
        fn(c.data_ptr(), offs.data_ptr(), n, bb, vo(c), 16384)
        rates[k].append(2 * TOTAL / (time.perf_counter() - t) / 1e9)
for k in keys:
    r = sorted(rates[k])
    print(f"K block {k[0]//1024:3d} KiB  K and V {k[1]:<13s} {statistics.median(r):5.1f} GB/s [{r[len(r)//4]:.1f}, {r[3*len(r)//4]:.1f}]")
