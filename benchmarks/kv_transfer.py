"""KV transfer bandwidth per transport beside a plain memcpy of the same bytes (the bound), and the
transfer's share of TTFT for a 2k-token prompt on the tiny model, in one run.

    .venv/bin/python benchmarks/kv_transfer.py

Every tcp and nccl frame carries a digest of its payload that the receiver checks (xxh3-128, or
HMAC-SHA256 with `--kv-secret`): the table shows both digests' own GB/s on one thread and tcp
with a secret beside tcp without, which is what integrity costs; and tcp under mutual TLS 1.3
(`--tls-dir`, certificates made for the run), which is what encryption costs.
"""
from __future__ import annotations

import argparse
import asyncio
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
    args = p.parse_args()
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
    n = 0
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
                def once():
                    nonlocal n
                    n += 1
                    receiver.expect(f"t{n}", f"r{n}", ids, name.split()[0])
                    sender.send(f"t{n}", src, ids, endpoint, ids)
                    receiver.complete(f"t{n}", ids)
                row.append(nbytes / best_of(once, args.repeat) / 1e9)
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
        def once():
            tid = f"ttft-{name}-{time.perf_counter_ns()}"
            receiver.expect(tid, tid, list(range(blocks)), name.split()[0])
            sender.send(tid, cache, list(range(blocks)), endpoint, list(range(blocks)))
            receiver.complete(tid, list(range(blocks)))
        t = best_of(once, 3)
        print(f"  {name:>16}: transfer {t * 1e3:6.2f} ms = {t / (prefill + t):6.1%} of "
              f"prefill + transfer")


if __name__ == "__main__":
    sys.exit(main())
