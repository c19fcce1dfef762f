"""KV transfer bandwidth per transport beside a plain memcpy of the same bytes (the bound), and the
transfer's share of TTFT for a 2k-token prompt on the tiny model, in one run.

    .venv/bin/python benchmarks/kv_transfer.py
    python benchmarks/kv_transfer.py --device cuda     # GPU caches: cuda_ipc and tcp

On a GPU (`--device cuda`) the caches have the 1B bench model's layout (16 layers, 8 KV heads of
64, bf16, 16-token blocks: 512 KiB a block) and sit in device memory: cuda_ipc copies into a
receiver process's cache (the two workers of one host), tcp sends over loopback (device to host,
socket, host to device), beside a device-to-device copy of the same bytes (the bound); each with
the blocks in one run and scattered one by one over the receiver's cache.

Every tcp and nccl frame carries a digest of its payload that the receiver checks (xxh3-128, or
HMAC-SHA256 with `--kv-secret`): the table shows both digests' own GB/s on one thread and tcp
with a secret beside tcp without, which is what integrity costs; and tcp under mutual TLS 1.3
(`--tls-dir`, certificates made for the run), which is what encryption costs.
"""
from __future__ import annotations

import argparse
import asyncio
import itertools
import shutil
import sys
import tempfile
import threading
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from common.kv_cache import PagedKVCache  # noqa: E402
from common.kv_layout import KVLayout
from common.kv_transfer.base import KVReceiver, TransferConfig  # noqa: E402
from common.kv_transfer.frames import payload_digest  # noqa: E402
from common.kv_transfer.nccl import NcclListener, NcclSender  # noqa: E402
from common.kv_transfer.shm import ShmListener, ShmSender  # noqa: E402
from common.kv_transfer.tcp import TcpListener, TcpSender  # noqa: E402
from common.tls import TLSFiles, make_certs  # noqa: E402

# tiny-model layout: 4 layers x 2 kv heads x 32 dims, fp32, 16-token blocks = 32 KiB a block
LAYOUT = KVLayout(num_layers=4, num_kv_heads=2, head_dim=32, block_size=16, dtype="float32")


_transfer_ids = itertools.count()


def transfer_seconds(receiver: KVReceiver, transport: str, sender, endpoint: str,
                     src: PagedKVCache, src_ids: list[int], dst_ids: list[int],
                     repeat: int) -> float:
    """Best time of `repeat` transfers of src's src_ids into the receiver's dst_ids, each
    expected, sent and completed as a worker pair does it."""
    def once():
        tid = f"t{next(_transfer_ids)}"
        receiver.expect(tid, tid, dst_ids, transport)
        sender.send(tid, src, src_ids, endpoint, dst_ids)
        receiver.complete(tid, dst_ids)
    return best_of(once, repeat)


def best_of(fn, repeat: int) -> float:
    times = []
    for _ in range(repeat):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return min(times)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--sizes-mib", type=int, nargs="+", default=[1, 4, 16, 64, 256])
    p.add_argument("--repeat", type=int, default=3)
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    args = p.parse_args()
    if args.device == "cuda":
        return gpu_main(args.sizes_mib, args.repeat)
    max_blocks = max(args.sizes_mib) * (1 << 20) // LAYOUT.block_bytes
    src = PagedKVCache(LAYOUT, max_blocks)
    src.tensor.normal_()
    dst = PagedKVCache(LAYOUT, max_blocks, shm_name="pdserve-kv-bench-dst")
    loop = asyncio.new_event_loop()
    threading.Thread(target=loop.run_forever, daemon=True).start()
    receiver = KVReceiver()
    tcp = TcpListener(dst, receiver, TransferConfig(timeout_s=120))
    asyncio.run_coroutine_threadsafe(tcp.start(), loop).result()
    keyed = TransferConfig(timeout_s=120, secret=b"bench-secret")
    tcp_keyed = TcpListener(dst, receiver, keyed)
    asyncio.run_coroutine_threadsafe(tcp_keyed.start(), loop).result()
    certs = tempfile.mkdtemp(prefix="pdserve-bench-certs-")
    make_certs(certs)
    tls = TransferConfig(timeout_s=120, tls=TLSFiles.in_dir(certs, "worker"))
    tcp_tls = TcpListener(dst, receiver, tls)
    asyncio.run_coroutine_threadsafe(tcp_tls.start(), loop).result()
    gloo = NcclListener(dst, receiver, TransferConfig(timeout_s=120))
    asyncio.run_coroutine_threadsafe(gloo.start(), loop).result()
    senders = {"shm": (ShmSender(LAYOUT), ShmListener(dst).endpoint()),
               "tcp (loopback)": (TcpSender(LAYOUT, TransferConfig(timeout_s=120)),
                                  tcp.endpoint()),
               "tcp + secret": (TcpSender(LAYOUT, keyed), tcp_keyed.endpoint()),
               "tcp + TLS": (TcpSender(LAYOUT, tls), tcp_tls.endpoint()),
               "nccl (gloo, lo)": (NcclSender(LAYOUT, TransferConfig(timeout_s=120)),
                                   gloo.endpoint())}
    digests = {"xxh3-128": b"", "hmac-sha256": keyed.secret}
    print(f"{'MiB':>6} {'blocks':>7} {'memcpy GB/s':>12} " +
          " ".join(f"{name + ' GB/s':>16}" for name in digests) + " " +
          " ".join(f"{name + ' GB/s':>20}" for name in senders))
    try:
        for mib in args.sizes_mib:
            blocks = mib * (1 << 20) // LAYOUT.block_bytes
            ids = list(range(blocks))
            nbytes = blocks * LAYOUT.block_bytes
            flat_src = src.tensor[:, :, :blocks].contiguous()
            flat_dst = torch.empty_like(flat_src)
            row = [nbytes / best_of(lambda: flat_dst.copy_(flat_src), args.repeat) / 1e9]
            raw = flat_src.view(torch.uint8).numpy().data
            for secret in digests.values():
                row.append(nbytes / best_of(lambda: payload_digest(secret, raw), args.repeat) / 1e9)
            for name, (sender, endpoint) in senders.items():
                t = transfer_seconds(receiver, name.split()[0], sender, endpoint, src, ids, ids,
                                     args.repeat)
                row.append(nbytes / t / 1e9)
            assert torch.equal(dst.tensor[:, :, :blocks], flat_src)
            print(f"{mib:>6} {blocks:>7} {row[0]:>12.2f} "
                  + " ".join(f"{v:>16.2f}" for v in row[1:1 + len(digests)]) + " "
                  + " ".join(f"{v:>20.2f}" for v in row[1 + len(digests):]))
        ttft_share(senders, receiver)
    finally:
        for sender, _ in senders.values():
            sender.close()
        for listener in (tcp, tcp_keyed, tcp_tls, gloo):
            asyncio.run_coroutine_threadsafe(listener.close(), loop).result()
        dst.close()
        shutil.rmtree(certs, ignore_errors=True)
    return 0


def ttft_share(senders, receiver) -> None:
    """Prefill of a 2048-token prompt on the tiny model (the TTFT floor) versus moving its KV."""
    from common.models.attention import AttentionMetadata, create_attention_backend
    from common.models.llama import load_model
    from common.models.tiny import make_tiny_model

    model_dir = Path("models/tiny-llama")
    if not (model_dir / "config.json").exists():
        make_tiny_model(model_dir)
    model = load_model(model_dir, create_attention_backend("torch"))
    tokens = 2048
    blocks = tokens // LAYOUT.block_size
    cache = PagedKVCache(LAYOUT, blocks)
    ids = torch.randint(0, model.config.vocab_size, (tokens,))
    meta = AttentionMetadata.build([], [(0, tokens, list(range(blocks)))], LAYOUT.block_size)
    prefill = best_of(lambda: model(ids, torch.arange(tokens), cache.layers, meta), 3)
    print(f"\n2048-token prompt, tiny model, {torch.get_num_threads()} threads: prefill "
          f"{prefill * 1e3:.1f} ms; KV {blocks * LAYOUT.block_bytes / (1 << 20):.0f} MiB")
    for name, (sender, endpoint) in senders.items():
        ids = list(range(blocks))
        t = transfer_seconds(receiver, name.split()[0], sender, endpoint, cache, ids, ids, 3)
        print(f"  {name:>16}: transfer {t * 1e3:6.2f} ms = {t / (prefill + t):6.1%} of "
              f"prefill + transfer")


GPU_LAYOUT = KVLayout(num_layers=16, num_kv_heads=8, head_dim=64, block_size=16,
                      dtype="bfloat16")
GPU_RECEIVER = """
import sys, torch
from common.kv_cache import PagedKVCache
from common.kv_layout import KVLayout
from common.kv_transfer.cuda_ipc import CudaIpcListener
layout = KVLayout(num_layers=16, num_kv_heads=8, head_dim=64, block_size=16, dtype="bfloat16")
cache = PagedKVCache(layout, int(sys.argv[1]), device="cuda")
print(CudaIpcListener(cache).endpoint(), flush=True)
for line in sys.stdin:  # block ids to checksum, after the sender's copies
    torch.cuda.synchronize()
    ids = torch.tensor([int(b) for b in line.split()], device="cuda")
    print(float(cache.tensor[:, :, ids].float().sum()), flush=True)
"""


def gpu_main(sizes_mib: list[int], repeat: int) -> int:
    """cuda_ipc into another process's GPU cache and tcp over loopback, beside device memcpy."""
    import subprocess

    from common.kv_transfer.cuda_ipc import CudaIpcSender

    layout = GPU_LAYOUT
    max_blocks = max(sizes_mib) * (1 << 20) // layout.block_bytes
    src = PagedKVCache(layout, max_blocks, device="cuda")
    src.tensor.normal_()
    dst = PagedKVCache(layout, max_blocks, device="cuda")
    proc = subprocess.Popen([sys.executable, "-c", GPU_RECEIVER, str(max_blocks)],
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                            cwd=Path(__file__).resolve().parents[1])
    loop = asyncio.new_event_loop()
    threading.Thread(target=loop.run_forever, daemon=True).start()
    receiver = KVReceiver()
    tcp = TcpListener(dst, receiver, TransferConfig(timeout_s=120))
    asyncio.run_coroutine_threadsafe(tcp.start(), loop).result()
    try:
        ipc_endpoint = proc.stdout.readline().strip()
        senders = {"cuda_ipc": (CudaIpcSender(layout), ipc_endpoint),
                   "tcp (loopback)": (TcpSender(layout, TransferConfig(timeout_s=120)),
                                      tcp.endpoint())}
        print(f"{torch.cuda.get_device_name()}; {layout.block_bytes >> 10} KiB a block")
        print(f"{'MiB':>6} {'blocks':>7} {'ids':>9} {'d2d copy GB/s':>14} "
              + " ".join(f"{name + ' GB/s':>20}" for name in senders))
        for mib in sizes_mib:
            blocks = mib * (1 << 20) // layout.block_bytes
            nbytes = blocks * layout.block_bytes
            flat_src = src.tensor[:, :, :blocks].contiguous()
            flat_dst = torch.empty_like(flat_src)

            def d2d():
                flat_dst.copy_(flat_src)
                torch.cuda.synchronize()
            bound = nbytes / best_of(d2d, repeat) / 1e9
            src_ids = list(range(blocks))
            generator = torch.Generator().manual_seed(mib)
            scattered = torch.randperm(max_blocks, generator=generator)[:blocks].tolist()
            for label, dst_ids in (("in a run", src_ids), ("scattered", scattered)):
                row = []
                for name, (sender, endpoint) in senders.items():
                    torch.cuda.synchronize()
                    t = transfer_seconds(receiver, name.split()[0], sender, endpoint, src,
                                         src_ids, dst_ids, repeat)
                    row.append(nbytes / t / 1e9)
                want = float(src.tensor[:, :, :blocks].float().sum())
                proc.stdin.write(" ".join(map(str, dst_ids)) + "\n")
                proc.stdin.flush()
                got_ipc = float(proc.stdout.readline())
                got_tcp = float(dst.tensor[:, :, torch.tensor(dst_ids, device="cuda")]
                                .float().sum())
                assert abs(got_ipc - want) <= 1e-3 * abs(want) + 1, (got_ipc, want)
                assert abs(got_tcp - want) <= 1e-3 * abs(want) + 1, (got_tcp, want)
                print(f"{mib:>6} {blocks:>7} {label:>9} {bound:>14.1f} "
                      + " ".join(f"{v:>20.2f}" for v in row))
        for sender, _ in senders.values():
            sender.close()
    finally:
        asyncio.run_coroutine_threadsafe(tcp.close(), loop).result()
        proc.kill()
        proc.wait(30)
    return 0


if __name__ == "__main__":
    sys.exit(main())
