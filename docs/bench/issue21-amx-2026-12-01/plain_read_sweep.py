import sys, time, statistics, torch
sys.path.insert(0, '/work/main')
from benchmarks import attention_resident as ar
from benchmarks.attention import scattered_decode
ar.scattered_decode = scattered_decode
fn = ar.block_reader()
torch.set_num_threads(1)
for dtype in (torch.float32, torch.bfloat16):
    for ctx in (320, 2000):
        inputs = ar.scattered_decode([ctx] * ar.BATCH, dtype, torch.Generator().manual_seed(0))
        _, caches, tables, _ = inputs
        block_bytes = ar.BLOCK * ar.KV_HEADS * ar.HEAD_DIM * dtype.itemsize
        offsets = (tables[:, :ctx // ar.BLOCK].reshape(-1) * block_bytes).contiguous()
        nbytes = offsets.numel() * block_bytes * 2
        res = []
        for ahead in (0, 4096, 8192, 12288, 16384, 24576, 32768, 49152):
            ts = []
            for rep in range(16):
                cache = caches[rep % len(caches)]
                t = time.perf_counter()
                fn(cache.data_ptr(), offsets.data_ptr(), offsets.numel(), block_bytes, cache.stride(0) * dtype.itemsize, ahead)
                ts.append(time.perf_counter() - t)
            res.append(f"{ahead//1024}K {nbytes/statistics.median(ts)/1e9:.1f}")
        print(dtype, ctx, " ".join(res), flush=True)
