"""A worker's prefix cache outlives its scheduler: the scheduler tells each worker which blocks
became cached (KVCacheManager announcements, in the next plan); the worker keeps block -> hash
until something writes the block again (a forward, a KV receive, a fork's copy), and reports what
it keeps when it registers; a new scheduler seeds its block pool with it (free, cached blocks)."""
import uuid

import pytest

from common.plans import BlockCopy, KVRecv, NewRequest, ScheduledTokens, StepPlan
from common.sampling_params import SamplingParams
from common.worker.config import WorkerConfig
from common.worker.service import build_worker
from services.scheduler.block_hash import extend_block_hashes
from services.scheduler.kv_cache_manager import KVCacheManager

BS = 16


def hashes(tokens: list[int]) -> list[bytes]:
    out: list[bytes] = []
    extend_block_hashes(out, tokens, BS)
    return out


def test_announcements_are_the_blocks_cached_since_the_last_plan_and_still_cached():
    kv = KVCacheManager(8, BS)
    tokens = list(range(3 * BS))
    h = hashes(tokens)
    assert kv.allocate_slots("a", 3 * BS) == [0, 1, 2]
    kv.cache_blocks("a", h, 2 * BS)
    assert kv.take_announcements() == [(0, h[0]), (1, h[1])]
    assert kv.take_announcements() == []
    kv.cache_blocks("a", h, 3 * BS)
    kv.free("a")  # free queue: 3 4 5 6 7 2 1 0
    assert kv.allocate_slots("b", 6 * BS) == [3, 4, 5, 6, 7, 2]  # block 2 evicted
    assert kv.take_announcements() == []  # its announcement went with it
    assert kv.find_prefix(h, 3 * BS + 1) == [0, 1]


def test_a_new_scheduler_seeds_its_pool_from_a_report():
    h = hashes(list(range(4 * BS)))
    kv = KVCacheManager(8, BS)
    report = [(5, h[0]), (2, h[1]), (9, h[2]), (3, b"short"), (6, h[1])]  # 9: no such block
    assert kv.seed(report) == 2  # block 6 repeats h[1]: it stays anonymous
    assert kv.num_free_blocks == 8
    assert kv.find_prefix(h, 4 * BS) == [5, 2]
    assert kv.pool.free_block_ids() == [0, 1, 3, 4, 6, 7, 5, 2]  # the cached ones last
    assert kv.allocate_slots("r", 4 * BS, [5, 2]) == [0, 1]
    assert kv.take_announcements() == []  # the worker knows these already


@pytest.fixture(scope="module")
def worker(tiny_llama):
    w, _ = build_worker(WorkerConfig(role="decode", model=str(tiny_llama), device="cpu",
                                     worker_id=f"report-{uuid.uuid4().hex[:6]}",
                                     num_kv_blocks=32, dtype="float32"))
    yield w
    w.close()


def new(rid: str, n: int, blocks: tuple[int, ...], computed: int = 0) -> NewRequest:
    return NewRequest(rid, tuple(range(100, 100 + n)), n, computed, blocks,
                      SamplingParams(max_tokens=4))


def test_the_worker_keeps_announced_blocks_until_they_are_written(worker):
    h = [bytes([i]) * 32 for i in range(8)]
    # a 40-token prompt in blocks 0 1 2; its plan announces blocks 0 and 1 (computed by it)
    worker.execute(StepPlan(1, new_requests=[new("a", 40, (0, 1, 2))],
                            scheduled=[ScheduledTokens("a", 40)],
                            cached_blocks=[(0, h[0]), (1, h[1])]))
    assert worker.block_hashes == {0: h[0], 1: h[1]}
    # a prefix hit on block 0 writes blocks 3 and 4 only; block 5 was announced earlier
    worker.execute(StepPlan(2, new_requests=[new("b", 40, (0, 3, 4), computed=BS)],
                            scheduled=[ScheduledTokens("b", 24)], cached_blocks=[(5, h[5])]))
    assert worker.block_hashes == {0: h[0], 1: h[1], 5: h[5]}
    # block 1 given to another request and written; block 5 receives KV; block 0 a fork's copy
    worker.execute(StepPlan(3, new_requests=[new("c", 20, (1, 6))],
                            scheduled=[ScheduledTokens("c", 20)],
                            recvs=[KVRecv("t1", "d", (5,), "shm")],
                            copies=[BlockCopy(2, 0, "a", "a")]))
    assert worker.block_hashes == {}
    worker.reset()  # a scheduler lost: requests go, what the cache holds does not
    worker.execute(StepPlan(4, cached_blocks=[(7, h[7])]))
    worker.reset()
    assert worker.block_hashes == {7: h[7]}
