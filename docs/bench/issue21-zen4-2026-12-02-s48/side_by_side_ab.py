"""The served decode kernel over the same keys and values laid out two ways, one build: each
layer's cache [2][blocks][...] (keys of all blocks, then values) against [blocks][2][...] (a
block's keys and values side by side), calls in turn; GB/s of K/V and the ratio call by call (kernel_experiments.txt, 4).

    git apply docs/bench/issue21-zen4-2026-12-02-s48/side_by_side.diff
    .venv/bin/python docs/bench/issue21-zen4-2026-12-02-s48/side_by_side_ab.py 21 1 2
"""
import sys, time, statistics, itertools
sys.path.insert(0, str(__import__("pathlib").Path(__file__).resolve().parents[3]))
import torch
from benchmarks import attention
from kernels import cpu_attention as ca
ops = ca.load()
scale = attention.HEAD_DIM ** -0.5
reps = int(sys.argv[1]) if len(sys.argv) > 1 else 21
threads = [int(x) for x in sys.argv[2:]] or [1, 2]
def side_by_side(c):
    s = torch.empty((c.size(1), 2) + tuple(c.shape[2:]), dtype=c.dtype)
    s.copy_(c.transpose(0, 1))
    return s.transpose(0, 1)
def mk(lengths, dtype, gen):
    case = attention.decode_case(lengths, dtype, gen)
    meta, kvb = case[0], case[3]
    caches, q, k, v = attention.step_inputs(case, dtype, gen)
    calls = {}
    for name, cs in (("separate", caches), ("sbs", [side_by_side(c) for c in caches])):
        t, out = itertools.count(), torch.empty_like(q)
        def call(cs=cs, t=t, out=out):
            ca.paged_decode_attention(q, cs[next(t) % len(cs)], meta.decode_block_tables,
                                      meta.decode_seq_lens, scale, out=out, ops=ops)
            return out
        calls[(dtype, name)] = call
    a, b = calls[(dtype, "separate")]().clone(), calls[(dtype, "sbs")]().clone()
    assert torch.equal(a, b), "outputs differ"
    return calls, kvb
for th in threads:
    torch.set_num_threads(th)
    for name, lengths in attention.DECODES.items():
        gen = torch.Generator().manual_seed(0)
        calls, kvb = {}, {}
        for dtype in (torch.float32, torch.bfloat16):
            c, b = mk(lengths, dtype, gen)
            calls.update(c)
            kvb.update({k: b for k in c})
        rates = {k: [] for k in calls}
        keys = list(calls)
        for f in calls.values():
            f()
        for rep in range(reps):
            for k in (keys if rep % 2 == 0 else keys[::-1]):
                t0 = time.perf_counter(); calls[k](); rates[k].append(kvb[k] / (time.perf_counter() - t0) / 1e9)
        f32, b16 = torch.float32, torch.bfloat16
        r = lambda a, b: attention.median_quartiles([x / y for x, y in zip(rates[a], rates[b])])
        med = lambda k: statistics.median(rates[k])
        print(f"{name:<22} {th} thr GB/s: f32 {med((f32,'separate')):5.1f} sbs {med((f32,'sbs')):5.1f}  bf16 {med((b16,'separate')):5.1f} sbs {med((b16,'sbs')):5.1f}"
              f" | sbs/separate f32 {r((f32,'sbs'),(f32,'separate'))} bf16 {r((b16,'sbs'),(b16,'separate'))}"
              f" | per byte bf16/f32 separate {r((b16,'separate'),(f32,'separate'))} sbs {r((b16,'sbs'),(f32,'sbs'))}", flush=True)
