"""kernel_experiments.txt, 5: a plain read of scattered blocks with `work` dependent multiply-adds
on each line's data (overlap.c), against the same work on 4 cache-resident blocks and the read
alone: how much of a computation this machine overlaps with scattered reads.

    gcc -O2 -march=native -shared -fPIC -o docs/bench/issue21-zen4-2026-12-02-s48/overlap.so \
        docs/bench/issue21-zen4-2026-12-02-s48/overlap.c
    [VECTOR=1] [WORKS='0 4 8 16 32'] .venv/bin/python docs/bench/issue21-zen4-2026-12-02-s48/overlap.py 7

VECTOR=1: the work is rounds of 8 independent 512-bit FMAs (read_vwork) instead of a chain of
scalar multiplies.
"""
import ctypes, statistics, time, sys, torch
WORKS = [int(w) for w in __import__('os').environ.get('WORKS', '0 4 8 16 32').split()]
import os
fn = getattr(ctypes.CDLL(str(__import__("pathlib").Path(__file__).with_name("overlap.so"))),
             "read_vwork" if os.environ.get("VECTOR") else "read_work")
fn.restype = ctypes.c_uint64
fn.argtypes = [ctypes.c_void_p, ctypes.c_void_p] + [ctypes.c_int64] * 5
STREAM = 64 << 20
gen = torch.Generator().manual_seed(0)
reps = int(sys.argv[1]) if len(sys.argv) > 1 else 9
calls = {}
for kib in (8, 16):
    bb = kib << 10; n = STREAM // bb
    caches = [torch.ones((2, n, bb), dtype=torch.uint8) for _ in range(4)]
    offs = (torch.randperm(n, generator=gen) * bb).contiguous()
    small = torch.ones((2, 4, bb), dtype=torch.uint8)
    soffs = torch.arange(4).repeat(n // 4) * bb
    for work in WORKS:
        calls[(kib, work, "scattered")] = (caches, offs, n, bb, work)
        calls[(kib, work, "resident")] = ([small], soffs.contiguous(), n, bb, work)
rates = {k: [] for k in calls}
keys = list(calls)
for rep in range(reps):
    for k in (keys if rep % 2 == 0 else keys[::-1]):
        cs, offs, n, bb, work = calls[k]
        c = cs[rep % len(cs)]
        t = time.perf_counter()
        fn(c.data_ptr(), offs.data_ptr(), n, bb, c.stride(0), 16384, work)
        rates[k].append(time.perf_counter() - t)
for kib in (8, 16):
    for work in WORKS:
        s = statistics.median(rates[(kib, work, "scattered")]); r = statistics.median(rates[(kib, work, "resident")])
        m0 = statistics.median(rates[(kib, 0, "scattered")])
        print(f"blocks {kib:2d} KiB work {work:2d}: scattered {2*STREAM/s/1e9:5.1f} GB/s ({s*1e3:6.1f} ms)  resident {r*1e3:6.1f} ms  "
              f"read alone {m0*1e3:6.1f} ms  sum {m0*1e3 + r*1e3:6.1f}  max {max(m0, r)*1e3:6.1f}")
