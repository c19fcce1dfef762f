"""Worker groups on this host: step times of groups of T = 1, 2 tensor-parallel ranks and P = 2
pipeline stages (with and without micro-batches) and the time spent in their collectives, and KV
transfer between groups of different shapes beside same-shape ones.

    .venv/bin/python benchmarks/tensor_parallel.py --model DIR [--dtype bfloat16]

Steps: each rank runs the worker's forward (ModelRunner, micro-batches on a pipeline stage) on
its share over its own paged cache, the group's cores split between the ranks as a worker group
splits them (`--cores`, default all of this process's): a prefill of `--prompt` tokens, and
decode steps of `--batch` sequences at that context; the median of `--reps`, timed on the last
rank (the last stage ends the step). "collectives": the time that rank spent in all-reduces,
all-gathers and receives from the stage before (over gloo), waiting included.

Transfers: `--blocks` blocks of the model's KV over shm and tcp (loopback) from a sending group to
a receiving one (common/kv_transfer: every sending rank writes or sends its heads straight to each
receiving cache that holds them), the sending ranks each on a thread of their own as their
processes would be.

Prints a table, writes JSON and a PNG (matplotlib) to --out. Two CPU cores make a small group:
the figures say what the split costs and gains here, not on a GPU host.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
import threading
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from common.kv_cache import PagedKVCache  # noqa: E402
from common.kv_layout import KVLayout, KVShard  # noqa: E402
from common.kv_transfer.base import KVReceiver, TransferConfig  # noqa: E402
from common.kv_transfer.registry import create_listener, create_sender  # noqa: E402
from common.models.attention import create_attention_backend  # noqa: E402
from common.models.config import ModelConfig  # noqa: E402
from common.models.llama import load_model  # noqa: E402
from common.worker.config import WorkerConfig  # noqa: E402
from common.worker.group import connect, rank_cores, rendezvous  # noqa: E402
from common.worker.model_runner import ModelRunner  # noqa: E402
from common.worker.sampler import Sampler  # noqa: E402

BLOCK = 16


SHAPES = [(1, 1, 1), (2, 1, 1), (1, 2, 1), (1, 2, 2)]  # (T, P, micro-batches)


def _timed_collectives(spent: list[float]) -> None:
    """This rank's collectives and point-to-point receives, timed (parallel.py calls them
    through `dist`)."""
    for name in ("all_reduce", "all_gather", "recv"):
        op = getattr(dist, name)

        def timed(*a, _op=op, **kw):
            start = time.perf_counter()
            out = _op(*a, **kw)
            spent.append(time.perf_counter() - start)
            return out
        setattr(dist, name, timed)


def _rank(rank: int, shape: tuple[int, int, int], port: int, args, out: str) -> None:
    t, p, micro = shape
    size = t * p
    cores = rank_cores(tuple(args.cores), size, rank)
    os.sched_setaffinity(0, cores)
    torch.set_num_threads(len(cores) if len(args.cores) >= size else
                          max(1, len(args.cores) // size))
    place = None
    if size > 1:
        cfg = WorkerConfig(role="decode", model=args.model, dtype=args.dtype,
                           tensor_parallel_size=t, pipeline_parallel_size=p)
        place = connect(cfg, rank, port)
    spent: list[float] = []
    _timed_collectives(spent)
    dtype = getattr(torch, args.dtype)
    model = load_model(args.model, create_attention_backend("cpu"), dtype, progress=False,
                       tp=place.tp if place else None, pp=place.pp if place else None)
    c = model.config
    layout = KVLayout(len(model.layers), model.num_kv_heads, c.head_dim, BLOCK, args.dtype)
    per_seq = -(-(args.prompt + args.reps + 2) // BLOCK)
    cache = PagedKVCache(layout, per_seq * args.batch + 1)
    runner = ModelRunner(model, cache, Sampler(c.vocab_size))
    runner.micro_batches = micro
    tables = [list(range(1 + i * per_seq, 1 + (i + 1) * per_seq)) for i in range(args.batch)]
    g = torch.Generator().manual_seed(0)

    def step(prefills, decodes) -> tuple[float, float]:
        ids = [t for t, _, _ in decodes] + [t for toks, _, _ in prefills for t in toks]
        pos = [p for _, p, _ in decodes] + \
            [p for toks, start, _ in prefills for p in range(start, start + len(toks))]
        if size > 1:
            dist.barrier()
        spent.clear()
        start = time.perf_counter()
        hidden = runner._forward(torch.tensor(ids), torch.tensor(pos),
                                 [(q, b) for _, q, b in decodes],
                                 [(s, len(toks), b) for toks, s, b in prefills], None)
        if runner.samples:
            model.compute_logits(hidden[-1:] if prefills else hidden)
        return time.perf_counter() - start, sum(spent)

    prompt = [torch.randint(0, c.vocab_size, (args.prompt,), generator=g).tolist()
              for _ in range(args.batch)]
    prefill = [step([(prompt[0], 0, tables[0])], []) for _ in range(args.reps)]
    for i in range(1, args.batch):  # every sequence's context, once
        step([(prompt[i], 0, tables[i])], [])
    decode = [step([], [(1, args.prompt + r, tables[i]) for i in range(args.batch)])
              for r in range(args.reps)]
    if rank == size - 1:  # the last stage ends the step
        Path(out).write_text(json.dumps({"prefill": prefill, "decode": decode}))
    if size > 1:
        dist.barrier()
    sys.stdout.flush()
    os._exit(0)  # gloo's threads and an interpreter teardown do not mix (worker/group.py)


def steps(args, shape: tuple[int, int, int]) -> dict:
    t, p, micro = shape
    out = Path(args.out) / f".steps-{t}-{p}-{micro}.json"
    # every rank joins the store as a client; this process holds it until they are done
    store = rendezvous(WorkerConfig(role="decode", model=args.model, dtype=args.dtype,
                                    tensor_parallel_size=t, pipeline_parallel_size=p))
    port = store.port
    ctx = mp.get_context("spawn")
    procs = [ctx.Process(target=_rank, args=(r, shape, port, args, str(out)))
             for r in range(t * p)]
    for proc in procs:
        proc.start()
    for proc in procs:
        proc.join(1800)
        assert proc.exitcode == 0, f"a rank of {shape} failed ({proc.exitcode})"
    got = json.loads(out.read_text())
    out.unlink()
    return {kind: {"step_ms": statistics.median(t for t, _ in runs) * 1e3,
                   "step_ms_min": min(t for t, _ in runs) * 1e3,
                   "step_ms_max": max(t for t, _ in runs) * 1e3,
                   "collectives_ms": statistics.median(s for _, s in runs) * 1e3}
            for kind, runs in got.items()}


def _label(shape: tuple[int, int, int]) -> str:
    t, p, micro = shape
    return f"T={t} P={p}" + (f" x{micro} micro" if p > 1 else "")


def _group(model: KVLayout, t: int) -> KVLayout:
    return KVLayout(model.num_layers, model.num_kv_heads, model.head_dim, BLOCK, model.dtype,
                    tensor_parallel_size=t)


def transfer(model: KVLayout, src_t: int, dst_t: int, blocks: int, reps: int,
             transport: str) -> float:
    """Median seconds to move `blocks` blocks from a group of src_t ranks to one of dst_t over
    `transport` (shm, or tcp over loopback: each receiving rank's listener on an event loop of
    its own, as in its process)."""
    src_group, dst_group = _group(model, src_t), _group(model, dst_t)
    ids = list(range(blocks))
    cfg = TransferConfig(timeout_s=120)
    src = []
    for r in range(src_t):
        shard = src_group.shard(r)
        cache = PagedKVCache(src_group.shard_layout(shard), blocks)
        cache.tensor.normal_()
        src.append((cache, create_sender(transport, cache.layout, cfg, shard,
                                         KVShard.whole(model))))
    dst, loops, listeners = [], [], []
    for r in range(dst_t):
        shard = dst_group.shard(r)
        cache = PagedKVCache(dst_group.shard_layout(shard), blocks,
                             shm_name=f"pdserve-kv-bench-tp-{os.getpid()}-{r}")
        receiver = KVReceiver()
        listener = create_listener(transport, cache, receiver, cfg, shard)
        loop = asyncio.new_event_loop()
        threading.Thread(target=loop.run_forever, daemon=True).start()
        asyncio.run_coroutine_threadsafe(listener.start(), loop).result(30)
        dst.append((cache, receiver))
        loops.append(loop)
        listeners.append(listener)
    endpoint = ",".join(listener.endpoint() for listener in listeners)
    times = []
    try:
        for rep in range(reps + 1):  # the first maps the segments, opens the connections
            tid = f"t{rep}"
            for _, receiver in dst:
                receiver.expect(tid, "bench", ids, transport)
            threads = [threading.Thread(target=sender.send,
                                        args=(tid, cache, ids, endpoint, ids))
                       for cache, sender in src]
            start = time.perf_counter()
            for th in threads:
                th.start()
            for th in threads:
                th.join()
            times.append(time.perf_counter() - start)
            for _, receiver in dst:
                receiver.complete(tid, ids)  # raises if it did not all land
    finally:
        for _, sender in src:
            sender.close()
        for listener, loop in zip(listeners, loops):
            asyncio.run_coroutine_threadsafe(listener.close(), loop).result(30)
            loop.call_soon_threadsafe(loop.stop)
        for cache, _ in dst:
            cache.close()
    return statistics.median(times[1:])


def plot(result: dict, path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, (a, b) = plt.subplots(1, 2, figsize=(11, 4))
    kinds = ["prefill", "decode"]
    width = 0.8 / len(result["steps"])
    for i, (name, s) in enumerate(result["steps"].items()):
        total = [s[k]["step_ms"] for k in kinds]
        coll = [s[k]["collectives_ms"] for k in kinds]
        x = [j + i * width for j in range(len(kinds))]
        a.bar(x, total, width * 0.95, label=name)
        a.bar(x, coll, width * 0.95, hatch="//", fill=False, edgecolor="black", linewidth=0.5,
              label="waiting in collectives" if i == 0 else None)
    a.set_xticks([j + 0.4 - width / 2 for j in range(len(kinds))], [
        f"prefill {result['prompt']} tokens", f"decode x{result['batch']}"])
    a.set_ylabel("ms (median)")
    a.set_title("step time (hatched: waiting in collectives)")
    a.legend(fontsize=8)
    names = list(result["transfers"])
    b.bar(names, [result["transfers"][n]["gb_s"] for n in names])
    b.set_ylabel("GB/s")
    b.set_title(f"KV transfer, {result['blocks']} blocks, by transport and group shapes")
    b.tick_params(axis="x", labelrotation=45, labelsize=7)
    fig.suptitle(result["machine"], fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", required=True)
    p.add_argument("--dtype", default="float32")
    p.add_argument("--prompt", type=int, default=256)
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--reps", type=int, default=9)
    p.add_argument("--blocks", type=int, default=256)
    p.add_argument("--cores", type=lambda s: [int(c) for c in s.split(",")],
                   default=sorted(os.sched_getaffinity(0)))
    p.add_argument("--out", default="benchmarks/results/tensor_parallel")
    args = p.parse_args()
    Path(args.out).mkdir(parents=True, exist_ok=True)
    flags = open("/proc/cpuinfo").read()
    isa = [f for f in ("avx2", "avx512f", "avx512_bf16", "amx_bf16") if f" {f}" in flags]
    result: dict = {"machine": f"{len(args.cores)} cores, {' '.join(isa)}, {args.dtype}",
                    "prompt": args.prompt, "batch": args.batch, "blocks": args.blocks,
                    "steps": {}, "transfers": {}}
    for shape in SHAPES:
        result["steps"][_label(shape)] = steps(args, shape)
    c = ModelConfig.from_pretrained(args.model)
    model = KVLayout(c.num_layers, c.num_kv_heads, c.head_dim, BLOCK, args.dtype)
    nbytes = model.block_bytes * args.blocks
    for transport in ("shm", "tcp"):
        for src_t, dst_t in ((1, 1), (2, 2), (2, 1), (1, 2)):
            t = transfer(model, src_t, dst_t, args.blocks, args.reps, transport)
            result["transfers"][f"{transport} T={src_t}->{dst_t}"] = {
                "ms": t * 1e3, "gb_s": nbytes / t / 1e9}

    print(f"{result['machine']}; model {args.model}")
    print(f"{'step':<16}{'group':>20}{'ms median':>11}{'[min-max]':>18}{'collectives ms':>16}"
          f"{'share':>7}")
    for name, s in result["steps"].items():
        for kind, v in s.items():
            label = f"prefill {args.prompt}" if kind == "prefill" else f"decode x{args.batch}"
            spread = f"[{v['step_ms_min']:.1f}-{v['step_ms_max']:.1f}]"
            print(f"{label:<16}{name:>20}{v['step_ms']:>11.2f}{spread:>18}"
                  f"{v['collectives_ms']:>16.2f}{v['collectives_ms'] / v['step_ms']:>7.0%}")
    print(f"\nKV transfer, {args.blocks} blocks ({nbytes / 1e6:.1f} MB):")
    for name, v in result["transfers"].items():
        print(f"  {name:<14}{v['ms']:>9.2f} ms {v['gb_s']:>7.2f} GB/s")
    out = Path(args.out)
    (out / "tensor_parallel.json").write_text(json.dumps(result, indent=1))
    plot(result, out / "tensor_parallel.png")
    print(f"\nwrote {out / 'tensor_parallel.json'} and {out / 'tensor_parallel.png'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
