"""Chained block hashes: a full block is identified by its parent's hash and its own tokens, so
equal hashes mean equal prefixes. A per-request salt isolates tenants' caches."""
from __future__ import annotations

import hashlib
from array import array

HASH_BYTES = 32  # sha256


def salt_hash(cache_salt: str) -> bytes:
    return hashlib.sha256(b"pdserve-salt\0" + cache_salt.encode()).digest()


def extend_block_hashes(hashes: list[bytes], token_ids: list[int], block_size: int,
                        cache_salt: str = "") -> None:
    """Appends the hashes of the full blocks of token_ids that `hashes` does not cover yet."""
    parent = hashes[-1] if hashes else salt_hash(cache_salt)
    for start in range(len(hashes) * block_size, len(token_ids) - block_size + 1, block_size):
        block = array("i", token_ids[start:start + block_size]).tobytes()
        parent = hashlib.sha256(parent + block).digest()
        hashes.append(parent)
