"""Same-host CPU transport: the sender maps the receiver's shared-memory KV cache and copies the
blocks straight into it, one indexed copy per run of blocks for all layers.

Endpoint: `shm://<segment>?num_blocks=N&layers=A-B&heads=C-D`, the segment holding layers [A, B)
and KV heads [C, D) of the model; a worker group's names each rank's cache, comma separated."""
from __future__ import annotations

from pathlib import Path
from urllib.parse import parse_qs

import torch

from common.kv_cache import PagedKVCache, map_shared
from common.kv_layout import KVShard, shard_of
from common.kv_transfer.base import DirectWriteSender, KVListener, KVTransferError
from common.shm_segments import SHM_DIR

SCHEME = "shm://"


class ShmSender(DirectWriteSender):
    def _open(self, endpoint: str) -> list[tuple[torch.Tensor, KVShard]]:
        return [self._open_one(part) for part in endpoint.split(",")]

    def _open_one(self, endpoint: str) -> tuple[torch.Tensor, KVShard]:
        if not endpoint.startswith(SCHEME):
            raise KVTransferError(f"not an shm endpoint: {endpoint}")
        name, _, query = endpoint[len(SCHEME):].partition("?")
        path = SHM_DIR / name
        try:
            q = parse_qs(query, strict_parsing=True)
            blocks = int(q["num_blocks"][0])
            shard = shard_of(query)
            if "/" in name or not name or blocks < 1:
                raise ValueError("bad segment name or block count")
        except (KeyError, ValueError) as e:
            raise KVTransferError(f"malformed shm endpoint {endpoint} ({e})") from None
        shape = (shard.layer_end - shard.layer_start, 2, blocks, self.layout.block_size,
                 shard.head_end - shard.head_start, self.layout.head_dim)
        try:
            return map_shared(path, shape, self.layout.torch_dtype, create=False), shard
        except (OSError, ValueError, RuntimeError) as e:
            raise KVTransferError(f"cannot map {path}: {e}") from e


class ShmListener(KVListener):
    def __init__(self, cache: PagedKVCache, shard: KVShard | None = None):
        assert cache.shm_path is not None, "the shm transport needs a KV cache in shared memory"
        s = shard or KVShard.whole(cache.layout)
        self._endpoint = (f"{SCHEME}{Path(cache.shm_path).name}?num_blocks={cache.num_blocks}"
                          f"&layers={s.layer_start}-{s.layer_end}"
                          f"&heads={s.head_start}-{s.head_end}")

    def endpoint(self) -> str:
        return self._endpoint
