"""tiles_ab.py (s47) with bfloat16 also at blocks of 32 (as many bytes a block as float32's 16):
float32 served at 16 against bfloat16 served and on tiles at 16 and at 32, calls in turn
(kernel_experiments.txt, 6).

    git apply docs/bench/issue21-zen5-2026-12-02-s47/tiles.diff \
        docs/bench/issue21-zen5-2026-12-02-s47/tiles_blocks_outer.diff
    .venv/bin/python docs/bench/issue21-zen4-2026-12-02-s48/tiles_ab32.py 21 1 2
"""
import sys, time, statistics, itertools
sys.path.insert(0, str(__import__("pathlib").Path(__file__).resolve().parents[3]))
import torch
from benchmarks import attention
from kernels import cpu_attention as ca, reference
ops = ca.load()
scale = attention.HEAD_DIM ** -0.5
reps = int(sys.argv[1]) if len(sys.argv) > 1 else 21
threads = [int(x) for x in sys.argv[2:]] or [1, 2]
def mk(lengths, dtype, gen, tiles, block):
    case = attention.decode_case(lengths, dtype, gen, block)
    meta, kvb = case[0], case[3]
    caches, q, k, v = attention.step_inputs(case, dtype, gen, block)
    if tiles:
        caches = [reference.tile_cache(c).contiguous() for c in caches]
    t = itertools.count()
    f = ca.paged_decode_attention_tiles if tiles else ca.paged_decode_attention
    out = torch.empty_like(q)
    def call():
        f(q, caches[next(t) % len(caches)], meta.decode_block_tables, meta.decode_seq_lens, scale, out=out, ops=ops)
    return call, kvb
for th in threads:
    torch.set_num_threads(th)
    for name, lengths in attention.DECODES.items():
        gen = torch.Generator().manual_seed(0)
        b = torch.bfloat16
        calls = {"f32": mk(lengths, torch.float32, gen, False, 16), "bf16": mk(lengths, b, gen, False, 16),
                 "bf16@32": mk(lengths, b, gen, False, 32), "bf16 tiles": mk(lengths, b, gen, True, 16),
                 "bf16 tiles@32": mk(lengths, b, gen, True, 32)}
        rates = {k: [] for k in calls}
        for c, _ in calls.values(): c()
        keys = list(calls)
        for rep in range(reps):
            for k in keys[rep % 5:] + keys[:rep % 5]:
                c, kvb = calls[k]
                s = time.perf_counter(); c(); rates[k].append(kvb / (time.perf_counter() - s) / 1e9)
        def ratio(b):
            x = sorted(y / z for z, y in zip(rates["f32"], rates[b]))
            return f"{statistics.median(x):.2f} [{x[len(x)//4]:.2f},{x[3*len(x)//4]:.2f}]"
        print(f"{name:22s} {th} thr GB/s: " + " ".join(f"{k} {statistics.median(v):5.1f}" for k, v in rates.items())
              + " | per byte over f32 served: " + "  ".join(f"{k} {ratio(k)}" for k in keys[1:]), flush=True)
