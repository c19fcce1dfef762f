"""Same-host GPU transport: the receiver exports a CUDA IPC handle of its KV cache at
registration; the sender opens it once and copies blocks device to device, no host hop.

The endpoint carries the handle in text (hex), never a pickle:

    cuda_ipc://<GPU uuid>?num_blocks=N&handle=..&size=..&offset=..&ref=..&ref_offset=..
               &event=..&sync=0|1

The sender finds the receiver's GPU among the ones it sees by uuid (device indices differ
between processes with different CUDA_VISIBLE_DEVICES); a GPU it cannot see fails the transfer,
saying so, and the scheduler recomputes the request on its decode worker.
"""
from __future__ import annotations

from dataclasses import dataclass
from urllib.parse import parse_qs, urlencode

import torch

from common.kv_cache import PagedKVCache, copy_blocks
from common.kv_layout import KVLayout, KVShard
from common.kv_transfer.base import DirectWriteSender, KVListener, KVTransferError

SCHEME = "cuda_ipc://"


@dataclass(frozen=True)
class IpcHandle:
    """What torch's CUDA IPC export of one storage consists of (UntypedStorage._share_cuda_)."""
    gpu_uuid: str
    num_blocks: int
    handle: bytes
    size: int             # of the storage, in bytes
    offset: int           # of the storage in its CUDA allocation, in bytes
    ref: bytes            # the producer's ref counter (a shared-memory file name)
    ref_offset: int
    event: bytes          # an IPC event the consumer waits on before the first use
    sync: bool

    def endpoint(self) -> str:
        query = urlencode({"num_blocks": self.num_blocks, "handle": self.handle.hex(),
                           "size": self.size, "offset": self.offset, "ref": self.ref.hex(),
                           "ref_offset": self.ref_offset, "event": self.event.hex(),
                           "sync": int(self.sync)})
        return f"{SCHEME}{self.gpu_uuid}?{query}"

    @classmethod
    def parse(cls, endpoint: str) -> IpcHandle:
        if not endpoint.startswith(SCHEME):
            raise KVTransferError(f"not a cuda_ipc endpoint: {endpoint[:80]}")
        uuid, _, query = endpoint[len(SCHEME):].partition("?")
        fields = {k: v[0] for k, v in parse_qs(query, keep_blank_values=True).items()}
        try:
            return cls(gpu_uuid=uuid, num_blocks=int(fields["num_blocks"]),
                       handle=bytes.fromhex(fields["handle"]), size=int(fields["size"]),
                       offset=int(fields["offset"]), ref=bytes.fromhex(fields["ref"]),
                       ref_offset=int(fields["ref_offset"]),
                       event=bytes.fromhex(fields["event"]), sync=fields["sync"] == "1")
        except (KeyError, ValueError) as e:
            raise KVTransferError(f"malformed cuda_ipc endpoint ({e}): {endpoint[:80]}") from e


def gpu_uuid(device: torch.device) -> str:
    return str(torch.cuda.get_device_properties(device).uuid)


def export_cache(cache: PagedKVCache) -> IpcHandle:
    tensor = cache.tensor
    assert tensor.is_cuda and tensor.storage_offset() == 0 and tensor.is_contiguous(), \
        "cuda_ipc exports a whole, contiguous KV cache on a GPU"
    (_, handle, size, offset, ref, ref_offset, event,
     sync) = tensor.untyped_storage()._share_cuda_()
    return IpcHandle(gpu_uuid(tensor.device), cache.num_blocks, handle, size, offset, ref,
                     ref_offset, event or b"", bool(sync))


class CudaIpcSender(DirectWriteSender):
    def __init__(self, layout: KVLayout):
        super().__init__(layout)
        self._stream: torch.cuda.Stream | None = None

    def _open(self, endpoint: str) -> list[tuple[torch.Tensor, KVShard]]:
        h = IpcHandle.parse(endpoint)
        visible = [i for i in range(torch.cuda.device_count())
                   if gpu_uuid(torch.device("cuda", i)) == h.gpu_uuid]
        if not visible:
            raise KVTransferError(
                f"the receiver's GPU {h.gpu_uuid} is not visible to this process: cuda_ipc "
                "needs both workers to see it; use tcp or nccl between these two")
        need = self.layout.block_bytes * h.num_blocks
        if h.size < need:
            raise KVTransferError(
                f"the exported cache holds {h.size} bytes, the layout needs {need}")
        try:
            storage = torch.UntypedStorage._new_shared_cuda(
                visible[0], h.handle, h.size, h.offset, h.ref, h.ref_offset, h.event, h.sync)
        except RuntimeError as e:
            raise KVTransferError(f"cannot open the receiver's CUDA IPC handle: {e}") from e
        device = torch.device("cuda", visible[0])
        shape = self.layout.cache_shape(h.num_blocks)
        cache = torch.empty(0, dtype=self.layout.torch_dtype, device=device)
        # torch's stub drops set_'s `stride=[]` default (contiguous), which the op itself has
        # (a worker's whole cache: worker groups exchange KV over shm so far)
        return [(cache.set_(storage, 0, shape),  # type: ignore[call-overload]
                 KVShard.whole(self.layout))]

    def _copy(self, dst, dst_ids, src, src_ids):
        """On its own stream: the copy waits for nothing the compute stream still queues (the
        caller synchronized on what it sends: the step's sampling or the layer's event), and it
        is complete in the receiver's memory before this returns."""
        if self._stream is None:
            self._stream = torch.cuda.Stream(src.device)
        with torch.cuda.stream(self._stream):
            copy_blocks(dst, dst_ids, src, src_ids)
        self._stream.synchronize()


class CudaIpcListener(KVListener):
    """Nothing listens: the endpoint is the exported handle, and senders write directly."""

    def __init__(self, cache: PagedKVCache):
        if not cache.tensor.is_cuda:
            raise ValueError("the cuda_ipc transport needs the KV cache on a GPU (--device cuda)")
        self._endpoint = export_cache(cache).endpoint()

    def endpoint(self) -> str:
        return self._endpoint
