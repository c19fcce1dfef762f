"""Same-host CPU transport: the sender maps the receiver's shared-memory KV cache and copies the
blocks straight into it, one indexed copy for all layers."""
from __future__ import annotations

from pathlib import Path

import torch

from common.kv_cache import SHM_DIR, PagedKVCache, map_shared
from common.kv_transfer.base import DirectWriteSender, KVListener, KVTransferError

SCHEME = "shm://"


class ShmSender(DirectWriteSender):
    def _open(self, endpoint: str) -> torch.Tensor:
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


class ShmListener(KVListener):
    def __init__(self, cache: PagedKVCache):
        assert cache.shm_path is not None, "the shm transport needs a KV cache in shared memory"
        self._endpoint = f"{SCHEME}{Path(cache.shm_path).name}?num_blocks={cache.num_blocks}"

    def endpoint(self) -> str:
        return self._endpoint
