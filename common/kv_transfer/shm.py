"""Same-host CPU transport: the sender maps the receiver's shared-memory KV cache and copies the
blocks straight into it, one indexed copy for all layers."""
from __future__ import annotations

from pathlib import Path

import torch

from common.kv_transfer.base import KVListener, KVSender, KVTransferError
from common.worker.kv_cache import SHM_DIR, KVLayout, PagedKVCache, copy_blocks, map_shared

SCHEME = "shm://"


class ShmSender(KVSender):
    def __init__(self, layout: KVLayout):
        self.layout = layout
        self._peers: dict[str, torch.Tensor] = {}  # endpoint -> mapped cache

    def _peer(self, endpoint: str) -> torch.Tensor:
        peer = self._peers.get(endpoint)
        if peer is None:
            peer = self._map(endpoint)
            self._peers[endpoint] = peer
        return peer

    def _map(self, endpoint: str) -> torch.Tensor:
        if not endpoint.startswith(SCHEME):
            raise KVTransferError(f"not an shm endpoint: {endpoint}")
        name, _, blocks = endpoint[len(SCHEME):].partition("?num_blocks=")
        path = SHM_DIR / name
        if "/" in name or not name or not blocks.isdigit():
            raise KVTransferError(f"malformed shm endpoint {endpoint}")
        try:
            return map_shared(path, self.layout.cache_shape(int(blocks)), self.layout.torch_dtype,
                              create=False)
        except (OSError, ValueError) as e:
            raise KVTransferError(f"cannot map {path}: {e}") from e

    def send_layers(self, transfer_id, cache, src_block_ids, dst_endpoint, dst_block_ids,
                    layer_start, layer_end, last):
        if len(src_block_ids) != len(dst_block_ids):
            raise KVTransferError(f"transfer {transfer_id}: {len(src_block_ids)} source blocks, "
                                  f"{len(dst_block_ids)} destination blocks")
        peer = self._peer(dst_endpoint)
        num_blocks = peer.shape[2]
        if any(not 0 <= b < num_blocks for b in dst_block_ids):
            raise KVTransferError(f"transfer {transfer_id}: destination block out of range")
        copy_blocks(peer[layer_start:layer_end], dst_block_ids,
                    cache.tensor[layer_start:layer_end], src_block_ids)
        return (len(src_block_ids) * self.layout.block_bytes // self.layout.num_layers
                * (layer_end - layer_start))

    def close(self):
        self._peers.clear()


class ShmListener(KVListener):
    def __init__(self, cache: PagedKVCache):
        assert cache.shm_path is not None, "the shm transport needs a KV cache in shared memory"
        self._endpoint = f"{SCHEME}{Path(cache.shm_path).name}?num_blocks={cache.num_blocks}"

    def endpoint(self) -> str:
        return self._endpoint
