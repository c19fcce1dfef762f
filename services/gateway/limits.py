"""How many generation requests one API key may have in flight in a gateway process
(--max-concurrent-requests-per-key): one more gets 429 with Retry-After. The key is the request's
bearer credential (`Authorization: Bearer <key>`); requests without one share a single budget.
A streamed request holds its slot until its response ends, however it ends."""

from __future__ import annotations

import hashlib
from collections import Counter
from collections.abc import Callable

from fastapi import Request

from services.gateway.errors import RETRY_AFTER_S, GatewayError


def too_many(limit: int) -> GatewayError:
    return GatewayError(
        429, f"This API key already has {limit} requests in flight "
        "(--max-concurrent-requests-per-key); retry when one ends.", "rate_limit_error",
        code="concurrency_limit_exceeded", retry_after=RETRY_AFTER_S,
    )


class InFlight:
    def __init__(self, limit: int) -> None:
        self.limit = limit  # 0: none
        self.counts: Counter[bytes] = Counter()

    @staticmethod
    def key(request: Request) -> bytes:
        """A digest of the credential (the key itself is not kept)."""
        return hashlib.sha256(request.headers.get("authorization", "").encode()).digest()

    def acquire(self, request: Request) -> Callable[[], None]:
        """Takes a slot of the request's key; raises 429 when it has none left. Returns the
        release, which may be called any number of times."""
        if not self.limit:
            return lambda: None
        key = self.key(request)
        if self.counts[key] >= self.limit:
            raise too_many(self.limit)
        self.counts[key] += 1
        held = True

        def release() -> None:
            nonlocal held
            if held:
                held = False
                self.counts[key] -= 1
                if not self.counts[key]:
                    del self.counts[key]
        return release
