"""The kernels' own thread pool (kernels/csrc/pool.h), beside the reference tests that run on it
(conftest's `threads`): the same bits as one thread for every kernel of a step, an error in a
chunk raised to the caller with the pool usable after it, two callers at once, a forked child,
and a worker whose linears are the panel kernel's running its steps on the pool."""
import multiprocessing as mp
import os
import threading
import time
import uuid
from pathlib import Path

import pytest
import torch

from common.models.packed_linear import panel_kernels
from common.worker.config import WorkerConfig
from common.worker.service import build_worker
from common.worker.step_threads import StepThreads
from kernels import cpu_attention
from tests.kernels.test_cpu_attention import PREFILLS, SEQ_LENS, _decode_case, _prefill_case


def _step_kernels(ops) -> list[torch.Tensor]:
    """Each kernel of a decode and a prefill step, on fixed inputs."""
    gen = torch.Generator().manual_seed(7)
    q, cache, tables, lens = _decode_case(SEQ_LENS, torch.float32, 64, 2, 16, seed=5)
    pq, pcache, ptables, starts, cached = _prefill_case(PREFILLS, torch.float32, 64, 2, 16,
                                                        seed=6)
    w = torch.randn(1408, 512, generator=gen)
    x = torch.randn(61, 512, generator=gen)
    packed = cpu_attention.pack_linear_weight(w, ops=ops)
    gate, up = torch.randn(61, 1408, generator=gen), torch.randn(61, 1408, generator=gen)
    silu = torch.empty_like(gate)
    ops.silu_mul(gate, up, silu)
    residual, norm = x.clone(), torch.empty_like(x)
    ops.rms_norm(torch.randn(61, 512, generator=gen), residual, torch.rand(512, generator=gen),
                 1e-6, norm)
    return [cpu_attention.paged_decode_attention(q, cache, tables, lens, 0.125, ops=ops),
            cpu_attention.paged_prefill_attention(pq, pcache, ptables, starts, cached, 0.125,
                                                  ops=ops),
            cpu_attention.packed_linear(x, packed, 1408, ops=ops), silu, residual, norm,
            cpu_attention.argmax_rows(torch.randn(61, 32000, generator=gen), ops=ops)]


def _on(ops, pool: int, torch_threads: int = 1):
    torch.set_num_threads(torch_threads)
    ops.set_pool_threads(pool)


@pytest.fixture
def native():
    ops = cpu_attention.load()
    before = torch.get_num_threads()
    yield ops
    ops.set_pool_threads(0)
    torch.set_num_threads(before)


def test_the_pool_computes_the_bits_of_one_thread(native):
    _on(native, 0)
    alone = _step_kernels(native)
    for n in (2, 3):
        _on(native, n)
        pooled = _step_kernels(native)
        for i, (a, b) in enumerate(zip(alone, pooled)):
            assert torch.equal(a, b), (n, i)


def test_an_error_in_a_chunk_reaches_the_caller_and_the_pool_goes_on(native):
    _on(native, 2)
    q, cache, tables, lens = _decode_case(SEQ_LENS, torch.float32, 64, 4, 16, seed=4)
    good = cpu_attention.paged_decode_attention(q, cache, tables, lens, 0.125, ops=native)
    bad = tables.clone()
    bad[4, 100] = cache.shape[1]  # the 3000-position sequence: a chunk of its own
    for _ in range(3):
        with pytest.raises(RuntimeError, match="outside the cache"):
            cpu_attention.paged_decode_attention(q, cache, bad, lens, 0.125, ops=native)
    assert torch.equal(cpu_attention.paged_decode_attention(q, cache, tables, lens, 0.125,
                                                            ops=native), good)


def test_two_callers_at_once_both_get_their_results(native):
    """The ops release the GIL: a second caller's loop runs while the first one's region holds
    the pool (the second runs its chunks on its own thread)."""
    _on(native, 2)
    gen = torch.Generator().manual_seed(1)
    w = torch.randn(4096, 512, generator=gen)
    packed = cpu_attention.pack_linear_weight(w, ops=native)
    xs = [torch.randn(64, 512, generator=gen) for _ in range(2)]
    want = [cpu_attention.packed_linear(x, packed, 4096, ops=native) for x in xs]
    wrong: list[int] = []

    def call(i: int) -> None:
        for _ in range(30):
            if not torch.equal(cpu_attention.packed_linear(xs[i], packed, 4096, ops=native),
                               want[i]):
                wrong.append(i)

    callers = [threading.Thread(target=call, args=(i,)) for i in range(2)]
    for t in callers:
        t.start()
    for t in callers:
        t.join(60)
    assert not any(t.is_alive() for t in callers) and wrong == []


def _cpu_s_by_thread() -> dict[int, float]:
    """Each thread of this process: the CPU seconds it has had (the scheduler's count to the
    ns where the kernel keeps one, else utime + stime in clock ticks)."""
    out = {}
    for task in Path("/proc/self/task").iterdir():
        try:
            if (task / "schedstat").exists():
                out[int(task.name)] = int((task / "schedstat").read_text().split()[0]) / 1e9
            else:
                fields = (task / "stat").read_text().rsplit(")", 1)[1].split()
                out[int(task.name)] = (int(fields[11]) + int(fields[12])) / \
                    os.sysconf("SC_CLK_TCK")
        except OSError:  # the thread ended
            continue
    return out


def test_a_region_on_fewer_threads_leaves_the_later_helpers_out(native):
    """Helpers made for 4 threads, then a second of steps planned on 2 (a worker that gave lent
    cores back): the caller and one helper compute, the other helpers sleep rather than take
    the cores given back."""
    _on(native, 4)
    _step_kernels(native)  # the pool makes its three helpers
    _on(native, 2)
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(512, 512, generator=gen)
    packed = cpu_attention.pack_linear_weight(torch.randn(1408, 512, generator=gen), ops=native)
    before = _cpu_s_by_thread()
    start = time.monotonic()
    while time.monotonic() - start < 1.0:
        cpu_attention.packed_linear(x, packed, 1408, ops=native)
    gained = sorted(t - before.get(tid, 0.0) for tid, t in _cpu_s_by_thread().items())
    assert len([g for g in gained if g > 0.2 * gained[-1]]) == 2, gained


def _in_child(ops_isa: str, q, cache, tables, lens, out) -> None:
    ops = cpu_attention.load(ops_isa)
    ops.set_pool_threads(2)
    got = cpu_attention.paged_decode_attention(q, cache, tables, lens, 0.125, ops=ops)
    out.put(got.numpy().tobytes())  # bytes: a tensor would go as a shared-memory handle


def test_a_forked_child_gets_a_pool_of_its_own(native):
    """A child forked after the pool's threads started (none of them came with it) computes
    the same, on a pool of its own."""
    _on(native, 2)
    q, cache, tables, lens = _decode_case(SEQ_LENS, torch.float32, 64, 2, 16, seed=2)
    want = cpu_attention.paged_decode_attention(q, cache, tables, lens, 0.125, ops=native)
    ctx = mp.get_context("fork")
    out = ctx.Queue()
    child = ctx.Process(target=_in_child, args=(cpu_attention.cpu_isa(), q, cache, tables, lens,
                                                out))
    child.start()
    try:
        got = out.get(timeout=60)
    finally:
        child.join(10)
        if child.is_alive():
            child.kill()
    assert got == want.numpy().tobytes() and child.exitcode == 0


def test_step_threads_set_the_pool_or_torch(native):
    _on(native, 0, 3)
    threads = StepThreads(native)
    assert threads.pooled and threads.get() == 3 and native.pool_threads() == 3
    assert torch.get_num_threads() == 1
    threads.set(2)
    assert native.pool_threads() == 2 and torch.get_num_threads() == 1
    plain = StepThreads()
    native.set_pool_threads(0)
    plain.set(2)
    assert not plain.pooled and plain.get() == 2 == torch.get_num_threads()


def test_a_worker_with_panel_linears_steps_on_the_pool(tiny_llama, native):
    torch.set_num_threads(2)
    worker, _ = build_worker(WorkerConfig(role="decode", model=str(tiny_llama), device="cpu",
                                          worker_id=f"pool-{uuid.uuid4().hex[:6]}",
                                          num_kv_blocks=16, dtype="float32"))
    try:
        panels = panel_kernels(worker.runner.model) is not None
        assert panels == (cpu_attention.cpu_isa() == "AVX2")
        assert worker.threads.pooled == panels
        if panels:
            assert worker.threads.get() == 2 and torch.get_num_threads() == 1
    finally:
        worker.close()
