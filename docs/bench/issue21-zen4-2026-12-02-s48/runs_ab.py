"""The served decode kernel over block tables whose blocks come in runs of R consecutive ids
(R = 1: every block somewhere else, as attention.py's scattered tables), both dtypes, all cases'
calls in turn; GB/s of K/V and each R's rate over R = 1's call by call (kernel_experiments.txt, 8).

    .venv/bin/python docs/bench/issue21-zen4-2026-12-02-s48/runs_ab.py 15 1 2
"""
import sys, time, statistics, itertools
sys.path.insert(0, str(__import__("pathlib").Path(__file__).resolve().parents[3]))
import torch
from benchmarks import attention
from kernels import cpu_attention as ca
ops = ca.load()
scale = attention.HEAD_DIM ** -0.5
reps = int(sys.argv[1]) if len(sys.argv) > 1 else 15
threads = [int(x) for x in sys.argv[2:]] or [1]
RUNS = (1, 2, 4, 8)
B = attention.BLOCK
def run_tables(lengths, run, gen):
    need = [-(-n // B) for n in lengths]
    runs = [-(-n // run) for n in need]
    slots = torch.randperm(sum(runs) + 1, generator=gen).tolist()
    tables, at = [], 0
    for n, r in zip(need, runs):
        ids = [s * run + i for s in slots[at:at + r] for i in range(run)][:n]
        tables.append(ids)
        at += r
    return attention.padded_tables(tables), (sum(runs) + 1) * run
def mk(lengths, dtype, run, gen):
    tables, num_blocks = run_tables(lengths, run, gen)
    shape = (2, num_blocks, B, attention.KV_HEADS, attention.HEAD_DIM)
    nl = attention.layer_count(torch.Size(shape).numel() * dtype.itemsize)
    caches = [torch.randn(shape, generator=gen).to(dtype) for _ in range(nl)]
    q = torch.randn((len(lengths), attention.HEADS, attention.HEAD_DIM), generator=gen).to(dtype)
    lens = torch.tensor(lengths)
    t, out = itertools.count(), torch.empty_like(q)
    kvb = sum(lengths) * attention.KV_HEADS * attention.HEAD_DIM * 2 * dtype.itemsize
    def call():
        ca.paged_decode_attention(q, caches[next(t) % nl], tables, lens, scale, out=out, ops=ops)
    return call, kvb
for th in threads:
    torch.set_num_threads(th)
    for name, lengths in attention.DECODES.items():
        gen = torch.Generator().manual_seed(0)
        calls = {(d, r): mk(lengths, d, r, gen) for d in (torch.float32, torch.bfloat16) for r in RUNS}
        rates = {k: [] for k in calls}
        for c, _ in calls.values(): c()
        keys = list(calls)
        for rep in range(reps):
            for k in (keys if rep % 2 == 0 else keys[::-1]):
                c, kvb = calls[k]
                s = time.perf_counter(); c(); rates[k].append(kvb / (time.perf_counter() - s) / 1e9)
        for d in (torch.float32, torch.bfloat16):
            dn = str(d).removeprefix("torch.")
            line = "  ".join(f"R={r} {statistics.median(rates[(d, r)]):5.1f}" + ("" if r == 1 else
                   f" ({attention.median_quartiles([a / b for a, b in zip(rates[(d, r)], rates[(d, 1)])])})") for r in RUNS)
            print(f"{name:<22} {th} thr {dn:<8} GB/s: {line}", flush=True)
        print(f"{name:<22} {th} thr bfloat16/float32 per byte: " + "  ".join(
            f"R={r} {attention.median_quartiles([b / a for a, b in zip(rates[(torch.float32, r)], rates[(torch.bfloat16, r)])])}" for r in RUNS), flush=True)
