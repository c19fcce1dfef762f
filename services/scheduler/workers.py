"""The workers of one deployment: who may join (same model, same KV layout, a KV transport to
every peer of the other role), who is there, and the limits they share."""
from __future__ import annotations

import logging
from collections.abc import Iterator, Mapping

from common.kv_layout import DTYPE_BYTES
from common.kv_transfer import KNOWN_TRANSPORTS
from common.plans import Registration
from services.scheduler.config import SchedulerConfig
from services.scheduler.kv_cache_manager import KVCacheManager
from services.scheduler.tier import TierPool
from services.scheduler.worker_state import WorkerState, transport_between

log = logging.getLogger(__name__)


# what a registration may claim: bounds that keep a wrong or hostile one from costing the
# scheduler memory or time (MAX_BLOCKS: 4M blocks of 16 tokens, 67M tokens of KV, far past a
# 141 GB GPU's; the scheduler's bookkeeping for that many takes about 0.5 GB)
MAX_ID_CHARS = 256
MAX_BLOCKS = 1 << 22
MAX_BLOCK_SIZE = 1 << 16
MAX_SPECULATIVE_TOKENS = 64
MAX_CORES = 1 << 16
MAX_GROUP_SIZE = 1024  # ranks per tensor or pipeline dimension of a worker group


class RegistrationError(Exception):
    """A worker that cannot join this deployment."""


class Workers(Mapping[str, WorkerState]):
    """worker id -> its state, in registration order."""

    def __init__(self, config: SchedulerConfig):
        self.config = config
        self._by_id: dict[str, WorkerState] = {}
        # second KV tiers shared by workers of a host: tier id -> (its index, their ids)
        self._shared_tiers: dict[str, tuple[TierPool, set[str]]] = {}

    def __iter__(self) -> Iterator[str]:
        return iter(self._by_id)

    def __len__(self) -> int:
        return len(self._by_id)

    def __getitem__(self, worker_id: str) -> WorkerState:
        return self._by_id[worker_id]

    def of_role(self, role: str) -> list[WorkerState]:
        """The workers of a role that take new requests (not those leaving)."""
        return [w for w in self._by_id.values() if w.role == role and not w.leaving]

    @property
    def has_prefill(self) -> bool:
        return bool(self.of_role("prefill"))

    @property
    def can_serve(self) -> bool:
        """Whether a request can run to its end: every request decodes on a decode worker,
        which prefills it itself when no prefill worker is attached (colocated, or a prefill
        pool that is gone); prefill workers alone finish nothing."""
        return bool(self.of_role("decode"))

    @property
    def has_disaggregated_path(self) -> bool:
        """A prefill worker and a decode worker to hand its KV to (join() refuses a pair with
        no transport between them)."""
        return self.has_prefill and self.can_serve

    @property
    def max_model_len(self) -> int:
        """The smallest limit of the workers and the scheduler's flag."""
        limits = [w.max_model_len for w in self._by_id.values() if w.max_model_len > 0]
        if self.config.max_model_len:
            limits.append(self.config.max_model_len)
        return min(limits, default=1 << 30)

    @property
    def block_size(self) -> int:
        return next(iter(self._by_id.values())).layout.block_size

    def join(self, reg: Registration) -> WorkerState:
        """Raises RegistrationError, saying why, for a worker that cannot serve beside the
        others."""
        self._check(reg)
        w = WorkerState(worker_id=reg.worker_id, role=reg.role, fingerprint=reg.model_fingerprint,
                        layout=reg.layout, max_model_len=reg.max_model_len,
                        transports=reg.transports, host_id=reg.host_id, tier_id=reg.tier_id,
                        cpu_cores=reg.cpu_cores,
                        num_speculative_tokens=reg.num_speculative_tokens,
                        endpoints=dict(reg.kv_endpoints),
                        kv=KVCacheManager(reg.num_blocks, reg.layout.block_size,
                                          self.config.enable_prefix_caching,
                                          tier=self._tier(reg), owner=reg.worker_id))
        for other in self._by_id.values():
            if other.role != w.role:
                p, d = (w, other) if w.role == "prefill" else (other, w)
                if not transport_between(p, d):
                    raise RegistrationError(
                        f"no KV transport from prefill worker {p.worker_id} ({_offer(p)}) to "
                        f"decode worker {d.worker_id} ({_offer(d)}); shm works only within one "
                        "host id: offer tcp (or nccl) on both")
        self._by_id[w.worker_id] = w
        if reg.tier_id and reg.num_tier_blocks:
            self._shared_tiers[reg.tier_id][1].add(w.worker_id)
        cached = w.kv.seed(reg.cached_blocks)  # what it kept through a scheduler's restart
        log.info("worker %s joined: role=%s blocks=%d (%d of them cached), tier blocks=%d",
                 w.worker_id, w.role, reg.num_blocks, cached, reg.num_tier_blocks)
        return w

    def leave(self, worker_id: str) -> WorkerState | None:
        w = self._by_id.pop(worker_id, None)
        tier_id = w.tier_id if w is not None else ""
        if tier_id in self._shared_tiers:
            holders = self._shared_tiers[tier_id][1]
            holders.discard(worker_id)
            if not holders:  # its memory goes with the last worker that mapped it
                del self._shared_tiers[tier_id]
        return w

    def shared_tiers(self) -> dict[str, TierPool]:
        """Tier id -> the second tier the workers of a host share, while any of them is here."""
        return {tier_id: pool for tier_id, (pool, holders) in self._shared_tiers.items()
                if holders}

    def _tier(self, reg: Registration) -> TierPool | None:
        """The worker's second tier: none, its own, or the one it shares with its host's
        workers (one index for all of them)."""
        if not reg.num_tier_blocks:
            return None
        if not reg.tier_id:
            return TierPool(reg.num_tier_blocks)
        shared = self._shared_tiers.get(reg.tier_id)
        if shared is None or not shared[1]:  # new, or left by a worker that failed to join
            shared = self._shared_tiers[reg.tier_id] = (TierPool(reg.num_tier_blocks), set())
        return shared[0]

    def _check(self, reg: Registration) -> None:
        if reg.role not in ("prefill", "decode"):
            raise RegistrationError(f"unknown role {reg.role!r}; known: prefill, decode")
        if not 0 < len(reg.worker_id) <= MAX_ID_CHARS or not reg.worker_id.isprintable():
            raise RegistrationError(f"a worker id is 1 to {MAX_ID_CHARS} printable characters")
        if reg.worker_id in self._by_id:
            raise RegistrationError(f"worker id {reg.worker_id} is already registered")
        if not 1 <= reg.num_blocks <= MAX_BLOCKS:
            raise RegistrationError(f"a worker has 1 to {MAX_BLOCKS} KV blocks, not "
                                    f"{reg.num_blocks}")
        if not 0 <= reg.num_tier_blocks <= MAX_BLOCKS:
            raise RegistrationError(f"a worker's KV tier has 0 to {MAX_BLOCKS} blocks, not "
                                    f"{reg.num_tier_blocks}")
        shared = self._shared_tiers.get(reg.tier_id) if reg.tier_id else None
        if shared is not None and shared[1]:
            if shared[0].num_slots != reg.num_tier_blocks:
                raise RegistrationError(f"KV tier {reg.tier_id} has {shared[0].num_slots} "
                                        f"blocks, not {reg.num_tier_blocks}")
            hosts = {self._by_id[h].host_id for h in shared[1]}
            if hosts != {reg.host_id}:
                raise RegistrationError(f"KV tier {reg.tier_id} is shared on host "
                                        f"{', '.join(sorted(hosts))}, not {reg.host_id}")
        if len(reg.tier_id) > MAX_ID_CHARS or not reg.tier_id.isprintable():
            raise RegistrationError(f"a tier id is at most {MAX_ID_CHARS} printable characters")
        lay = reg.layout
        if min(lay.num_layers, lay.num_kv_heads, lay.head_dim, lay.block_size) < 1 \
                or lay.block_size > MAX_BLOCK_SIZE or lay.dtype not in DTYPE_BYTES:
            raise RegistrationError(f"KV layout {lay} is not one a cache can have")
        if not (1 <= lay.tensor_parallel_size <= MAX_GROUP_SIZE
                and 1 <= lay.pipeline_parallel_size <= min(lay.num_layers, MAX_GROUP_SIZE)):
            raise RegistrationError(f"KV layout {lay}: a group's tensor and pipeline parallel "
                                    f"sizes are 1 to {MAX_GROUP_SIZE} (and the layers)")
        if reg.max_model_len < 0:
            raise RegistrationError("max_model_len must be >= 0")
        if not 0 <= reg.num_speculative_tokens <= MAX_SPECULATIVE_TOKENS:
            raise RegistrationError("num_speculative_tokens must be in "
                                    f"0..{MAX_SPECULATIVE_TOKENS}")
        unknown = sorted(set(reg.transports) - set(KNOWN_TRANSPORTS))
        if unknown:
            raise RegistrationError(f"unknown KV transports {', '.join(map(repr, unknown))}; "
                                    f"known: {', '.join(KNOWN_TRANSPORTS)}")
        if len(reg.cpu_cores) > MAX_CORES or any(c < 0 for c in reg.cpu_cores):
            raise RegistrationError("cpu_cores must be core numbers >= 0")
        for other in self._by_id.values():
            if other.fingerprint != reg.model_fingerprint:
                raise RegistrationError(
                    f"model fingerprint {reg.model_fingerprint} differs from worker "
                    f"{other.worker_id}'s {other.fingerprint}: every worker must serve the same "
                    "model")
            if not other.layout.same_model(reg.layout):  # group shapes may differ
                raise RegistrationError(
                    f"KV layout {reg.layout} differs from worker {other.worker_id}'s "
                    f"{other.layout}")
        if reg.role == "prefill" and self.config.mode == "colocated":
            raise RegistrationError("the scheduler runs --mode colocated: decode workers only")


def _offer(w: WorkerState) -> str:
    return f"transports {', '.join(w.transports) or 'none'}, host id {w.host_id or '?'}"
