"""kernel_experiments.txt, 5: the served kernel ("rows"), the tile kernel on separate key and value
halves ("tiles") and on keys and values of a (block, kv head) side by side ("inter"), both dtypes,
calls in turn; GB/s of K/V and bfloat16 per byte over float32 rows.

    git apply docs/bench/issue21-zen5-2026-12-02-s47/tiles.diff
    git apply docs/bench/issue21-zen5-2026-12-02-s47/tiles_strides.diff
    .venv/bin/python docs/bench/issue21-zen5-2026-12-02-s47/interleaved.py REPS THREADS...
"""
import sys, time, statistics, itertools
sys.path.insert(0, str(__import__("pathlib").Path(__file__).resolve().parents[3]))
import torch
from benchmarks import attention
from kernels import cpu_attention as ca, reference
ops = ca.load()
scale = attention.HEAD_DIM ** -0.5
reps = int(sys.argv[1]); threads = [int(x) for x in sys.argv[2:]]
def interleaved(t):
    """tiles [2, nb, kvh, bs, D] -> the same as a view of [nb, kvh, 2, bs, D] memory."""
    return t.permute(1, 2, 0, 3, 4).contiguous().permute(2, 0, 1, 3, 4)
def mk(lengths, dtype, gen, kind):
    case = attention.decode_case(lengths, dtype, gen)
    meta, kvb = case[0], case[3]
    caches, q, k, v = attention.step_inputs(case, dtype, gen)
    if kind == "tiles": caches = [reference.tile_cache(c).contiguous() for c in caches]
    if kind == "inter": caches = [interleaved(reference.tile_cache(c)) for c in caches]
    t = itertools.count()
    f = ca.paged_decode_attention if kind == "rows" else ca.paged_decode_attention_tiles
    out = torch.empty_like(q)
    def call():
        f(q, caches[next(t) % len(caches)], meta.decode_block_tables, meta.decode_seq_lens, scale, out=out, ops=ops)
    return call, kvb
for th in threads:
    torch.set_num_threads(th)
    for name, lengths in attention.DECODES.items():
        gen = torch.Generator().manual_seed(0)
        calls = {}
        for kind in ("rows", "tiles", "inter"):
            for d in (torch.float32, torch.bfloat16):
                calls[(kind, d)] = mk(lengths, d, gen, kind)
        rates = {k: [] for k in calls}
        for c, _ in calls.values(): c()
        keys = list(calls)
        for rep in range(reps):
            for k in keys[rep % 6:] + keys[:rep % 6]:
                c, kvb = calls[k]
                s = time.perf_counter(); c(); rates[k].append(kvb / (time.perf_counter() - s) / 1e9)
        def pb(a, b):
            x = sorted(y / z for z, y in zip(rates[a], rates[b])); return f"{statistics.median(x):.2f} [{x[len(x)//4]:.2f},{x[3*len(x)//4]:.2f}]"
        f32, b16 = torch.float32, torch.bfloat16
        print(f"{name:22s} {th} thr GB/s " + " ".join(f"{k[0]}/{str(k[1])[6:]} {statistics.median(v):5.1f}" for k, v in rates.items())
              + f" | bf16 per byte over f32 rows: rows {pb(('rows', f32), ('rows', b16))} tiles {pb(('rows', f32), ('tiles', b16))} inter {pb(('rows', f32), ('inter', b16))}; f32 inter/rows {pb(('rows', f32), ('inter', f32))}", flush=True)
