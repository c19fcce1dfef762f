"""How contiguous a decode pool's block tables are under random 256/64 traffic, 60 at once, with
the served BlockPool (kernel_experiments.txt, 8): the share of a table's consecutive blocks that
are consecutive ids. SORT: each prompt's blocks sorted by id after they are taken.

    .venv/bin/python docs/bench/issue21-zen4-2026-12-02-s48/pool_sim.py BLOCKS [sort]
"""
import random, sys
sys.path.insert(0, str(__import__("pathlib").Path(__file__).resolve().parents[3]))
from services.scheduler.block_pool import BlockPool
rng = random.Random(0)
SORT = len(sys.argv) > 2
N = int(sys.argv[1]) if len(sys.argv) > 1 else 4096
pool = BlockPool(N)
active = {}  # seq -> [tables, tokens, left]
seq_id = 0
adj = tot = 0
runs = []
for step in range(20000):
    while len(active) < 60:
        prompt = 256
        need = -(-(prompt + 1) // 16)
        active[seq_id] = [sorted(pool.allocate(need)) if SORT else pool.allocate(need), prompt + 1, rng.randint(40, 64)]
        seq_id += 1
    for s in list(active):
        t = active[s]
        t[1] += 1; t[2] -= 1
        if t[1] > len(t[0]) * 16:
            t[0] += pool.allocate(1)
        if t[2] <= 0:
            pool.free(t[0]); del active[s]
    if step > 2000 and step % 50 == 0:
        for t in active.values():
            ids = t[0]
            adj += sum(b == a + 1 for a, b in zip(ids, ids[1:])); tot += len(ids) - 1
            r = 1
            for a, b in zip(ids, ids[1:]):
                if b == a + 1: r += 1
                else: runs.append(r); r = 1
            runs.append(r)
print(f"pool {N} blocks: consecutive pairs {adj / tot:.2f}, mean run {sum(runs) / len(runs):.1f} blocks, "
      f"runs of 1: {sum(r == 1 for r in runs) / len(runs):.2f}")
for t in list(active.values())[:3]:
    print(t[0])
