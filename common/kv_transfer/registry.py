"""The KV transports by name: the factories of their senders and listeners (the known names are
in the package, torch-free).

The one module that knows every transport. Each is imported only when asked for, so a worker
offering shm and tcp never loads torch.distributed (nccl) or the CUDA IPC code.
"""
from __future__ import annotations

from common.kv_cache import PagedKVCache
from common.kv_layout import KVLayout, KVShard
from common.kv_transfer import KNOWN_TRANSPORTS
from common.kv_transfer.base import KVListener, KVReceiver, KVSender, TransferConfig


def _unknown(transport: str) -> ValueError:
    return ValueError(f"unknown KV transport {transport!r}; known: {', '.join(KNOWN_TRANSPORTS)}")


def create_sender(transport: str, layout: KVLayout, cfg: TransferConfig,
                  shard: KVShard | None = None, model: KVShard | None = None) -> KVSender:
    """`shard`: the part of the model's KV the sending cache holds (a worker group's rank);
    None: all of it. `model`: all of the model's KV (what a receiver naming no shard holds)."""
    if transport == "shm":
        from common.kv_transfer.shm import ShmSender
        return ShmSender(layout, shard)
    if transport == "tcp":
        from common.kv_transfer.tcp import TcpSender
        return TcpSender(layout, cfg, shard, model)
    if transport == "nccl":
        from common.kv_transfer.nccl import NcclSender
        return NcclSender(layout, cfg)
    if transport == "cuda_ipc":
        from common.kv_transfer.cuda_ipc import CudaIpcSender
        return CudaIpcSender(layout)
    raise _unknown(transport)


def create_listener(transport: str, cache: PagedKVCache, receiver: KVReceiver,
                    cfg: TransferConfig, shard: KVShard | None = None) -> KVListener:
    if transport == "shm":
        from common.kv_transfer.shm import ShmListener
        return ShmListener(cache, shard)
    if transport == "tcp":
        from common.kv_transfer.tcp import TcpListener
        return TcpListener(cache, receiver, cfg, shard)
    if transport == "nccl":
        from common.kv_transfer.nccl import NcclListener
        return NcclListener(cache, receiver, cfg)
    if transport == "cuda_ipc":
        from common.kv_transfer.cuda_ipc import CudaIpcListener
        return CudaIpcListener(cache)
    raise _unknown(transport)
