"""bfloat16 prefill attention on this CPU, the tile products three ways, called in turn:
0 widened to float (lanes kernel), 1 MKL's bf16 GEMM (what serving takes with AMX), 2 the kernel's
own bf16 dot products (AVX512-BF16). Median ms over the reps, 1 and 2 threads."""
import sys, time, statistics, torch
sys.path.insert(0, '/work/main')
from benchmarks.kernel_ab import prefill_call
from kernels.cpu_attention import load
ops = load()
shapes = [(2048, 2048), (2048, 0), (952, 2048), (256, 0), (128, 0), (16, 1024), (64, 3000)]
for threads in (1, 2):
    torch.set_num_threads(threads)
    for chunk, cached in shapes:
        calls = {g: prefill_call(chunk, cached, torch.bfloat16, torch.Generator().manual_seed(0), g)
                 for g in (0, 1, 2, 3)}
        outs = {g: c(ops, 0) for g, c in calls.items()}  # warm
        diff = max((outs[g].float() - outs[1].float()).abs().max().item() for g in (0, 2, 3))
        ts = {g: [] for g in calls}
        reps = 7 if chunk >= 952 else 21
        for r in range(reps):
            for g in ([0, 1, 2, 3] if r % 2 else [3, 2, 1, 0]):
                t = time.perf_counter(); calls[g](ops, r); ts[g].append(time.perf_counter() - t)
        m = {g: statistics.median(v) * 1e3 for g, v in ts.items()}
        print(f"{threads} thr {chunk:5d} over {cached:5d}: float {m[0]:8.2f}  mkl-bf16 {m[1]:8.2f}  "
              f"dot-bf16 {m[2]:8.2f} amx {m[3]:8.2f} ms  amx/mkl {m[3]/m[1]:.2f}x  mkl/dot {m[1]/m[2]:.2f}x  mkl/float {m[1]/m[0]:.2f}x  max diff {diff:.1e}",
              flush=True)
