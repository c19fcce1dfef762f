"""The cuda_ipc transport: its endpoint (a CUDA IPC handle in text, no pickle), where it may be
used, and (on a GPU host) blocks copied into another process's cache."""
import subprocess
import sys
import textwrap

import pytest
import torch

from common.kv_layout import KVLayout
from common.kv_cache import PagedKVCache
from common.kv_transfer.base import KVTransferError
from common.kv_transfer.cuda_ipc import CudaIpcSender, IpcHandle
from common.worker.config import WorkerConfig
from services.scheduler.kv_cache_manager import KVCacheManager
from services.scheduler.worker_state import WorkerState, transport_between

LAYOUT = KVLayout(num_layers=2, num_kv_heads=2, head_dim=8, block_size=4, dtype="float16")


def test_endpoint_round_trips_and_refuses_malformed_ones():
    h = IpcHandle("GPU-1234", 16, bytes(range(64)), 4096, 512, b"/torch_1_2", 8, b"\x01" * 64,
                  True)
    assert IpcHandle.parse(h.endpoint()) == h
    for bad in ("tcp://x:1", "cuda_ipc://GPU-1?num_blocks=2", h.endpoint().replace("size=", "s=")):
        with pytest.raises(KVTransferError, match="endpoint"):
            IpcHandle.parse(bad)


def test_a_sender_refuses_blocks_out_of_range_or_mismatched(monkeypatch):
    peer = torch.zeros(LAYOUT.cache_shape(4), dtype=torch.float16)
    sender = CudaIpcSender(LAYOUT)
    sender._peers["cuda_ipc://x"] = peer
    cache = PagedKVCache(LAYOUT, 4)
    with pytest.raises(KVTransferError, match="out of range"):
        sender.send("t", cache, [0], "cuda_ipc://x", [4])
    with pytest.raises(KVTransferError, match="1 source blocks, 2 destination"):
        sender.send("t", cache, [0], "cuda_ipc://x", [1, 2])


def test_cuda_ipc_needs_a_gpu_cache_and_one_host():
    with pytest.raises(ValueError, match="cuda_ipc KV transport needs the KV cache on a GPU"):
        WorkerConfig(role="decode", model="m", kv_transports=("cuda_ipc", "tcp"), device="cpu")
    # the default: device to device on a GPU, shared memory on CPU, tcp between hosts
    assert WorkerConfig(role="decode", model="m", device="cuda").kv_transports == (
        "cuda_ipc", "tcp")
    assert WorkerConfig(role="decode", model="m", device="cpu").kv_transports == ("shm", "tcp")

    def worker(host):
        return WorkerState(worker_id=host, role="decode", fingerprint="f",
                           layout=LAYOUT, max_model_len=0,
                           transports=("cuda_ipc", "nccl"), kv=KVCacheManager(4, 4),
                           host_id=host)
    assert transport_between(worker("a"), worker("a")) == "cuda_ipc"
    assert transport_between(worker("a"), worker("b")) == "nccl"


RECEIVER = textwrap.dedent("""
    import sys, torch
    from common.kv_transfer.cuda_ipc import CudaIpcListener
    from common.kv_layout import KVLayout
    from common.kv_cache import PagedKVCache
    layout = KVLayout(num_layers=2, num_kv_heads=2, head_dim=8, block_size=4, dtype="float16")
    cache = PagedKVCache(layout, 8, device="cuda")
    print(CudaIpcListener(cache).endpoint(), flush=True)
    sys.stdin.readline()  # the sender copied
    torch.cuda.synchronize()
    print(" ".join(str(float(cache.tensor[:, :, b].sum())) for b in range(8)), flush=True)
""")


@pytest.mark.cuda
def test_blocks_land_in_another_process_gpu_cache():
    proc = subprocess.Popen([sys.executable, "-c", RECEIVER], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, text=True)
    try:
        endpoint = proc.stdout.readline().strip()
        cache = PagedKVCache(LAYOUT, 8, device="cuda")
        for b in range(8):
            cache.tensor[:, :, b] = b + 1
        sender = CudaIpcSender(LAYOUT)
        moved = sender.send_layers("t", cache, [1, 2, 5], endpoint, [6, 3, 0], 0, 1, last=False)
        moved += sender.send_layers("t", cache, [1, 2, 5], endpoint, [6, 3, 0], 1, 2, last=True)
        assert moved == 3 * LAYOUT.block_bytes
        proc.stdin.write("done\n")
        proc.stdin.flush()
        sums = [float(x) for x in proc.stdout.readline().split()]
        per_block = LAYOUT.block_bytes // 2  # float16 elements of one block, all layers
        assert sums == [6 * per_block, 0, 0, 3 * per_block, 0, 0, 2 * per_block, 0]
        sender.close()
    finally:
        proc.kill()
        proc.wait(30)
