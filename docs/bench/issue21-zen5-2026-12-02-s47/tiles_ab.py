"""kernel_experiments.txt, 5 (tiles_ab.txt): the served decode kernel and the tile kernel, float32 and
bfloat16, calls in turn; GB/s of K/V and bfloat16 per byte over float32.

    git apply docs/bench/issue21-zen5-2026-12-02-s47/tiles.diff
    .venv/bin/python docs/bench/issue21-zen5-2026-12-02-s47/tiles_ab.py REPS THREADS...
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
def mk(lengths, dtype, gen, tiles):
    case = attention.decode_case(lengths, dtype, gen)
    meta, kvb = case[0], case[3]
    caches, q, k, v = attention.step_inputs(case, dtype, gen)
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
        calls = {"f32": mk(lengths, torch.float32, gen, False), "bf16": mk(lengths, torch.bfloat16, gen, False),
                 "f32 tiles": mk(lengths, torch.float32, gen, True), "bf16 tiles": mk(lengths, torch.bfloat16, gen, True)}
        rates = {k: [] for k in calls}
        for c, _ in calls.values(): c()
        keys = list(calls)
        for rep in range(reps):
            order = keys[rep % 4:] + keys[:rep % 4]
            for k in order:
                c, kvb = calls[k]
                s = time.perf_counter(); c(); rates[k].append(kvb / (time.perf_counter() - s) / 1e9)
        def ratio(a, b):
            x = sorted(y / z for z, y in zip(rates[a], rates[b]))
            return f"{statistics.median(x):.2f} [{x[len(x)//4]:.2f},{x[3*len(x)//4]:.2f}]"
        print(f"{name:22s} {th} thr GB/s: " + " ".join(f"{k} {statistics.median(v):5.1f}" for k, v in rates.items())
              + f" | per byte bf16/f32: served {ratio('f32','bf16')} tiles {ratio('f32 tiles','bf16 tiles')} bf16 tiles/f32 served {ratio('f32','bf16 tiles')} | f32 tiles/served {ratio('f32','f32 tiles')}", flush=True)
