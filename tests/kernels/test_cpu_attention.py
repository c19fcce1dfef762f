"""The CPU paged attention kernels (kernels/csrc/paged_attention.cpp) against kernels.reference.

Both builds that can run here are checked: the one this CPU takes (AVX2 or AVX512) and the
portable DEFAULT one, on 1 and 2 threads (the work split by cost, long contexts in partitions).
"""
import functools
import os

import pytest
import torch

from kernels import cpu_attention, reference
from tests.kernels import paged
from tests.kernels.paged import ATTN_TOL, HEADS, param_id

# CPU kernels: host tensors, also on a machine with a GPU (where the Triton tests' helpers
# default to it)
random_cache = functools.partial(paged.random_cache, device="cpu")
block_tables = functools.partial(paged.block_tables, device="cpu")

# contexts of 1 to 3000 in one batch: the query alone, block-size remainders, several partitions
SEQ_LENS = [1, 15, 33, 600, 3000, 17, 1100]


def _tol(dtype):
    # the kernel reads bf16 K/V and accumulates in fp32; the reference runs in fp32 on the same
    # bf16 values, so only the bf16 rounding of the output and of P (prefill; decode where the
    # CPU has AVX512-BF16) separates them
    return ATTN_TOL[dtype]


def _decode_case(seq_lens, dtype, head_dim, gqa, block_size, seed=0):
    gen = torch.Generator().manual_seed(seed)
    heads, kv_heads = HEADS[gqa] if gqa in HEADS else gqa  # or (heads, kv_heads)
    num_blocks = sum(-(-n // block_size) for n in seq_lens) + 3
    cache = random_cache(num_blocks, block_size, kv_heads, head_dim, dtype, gen)
    tables = block_tables(seq_lens, block_size, num_blocks, gen)
    q = torch.randn((len(seq_lens), heads, head_dim), generator=gen).to(dtype)
    return q, cache, tables, torch.tensor(seq_lens)


def _check_decode(ops, seq_lens, dtype, head_dim, gqa, block_size, seed=0):
    """The kernel's decode of a _decode_case against the reference's, within dtype's tolerance."""
    q, cache, tables, lens = _decode_case(seq_lens, dtype, head_dim, gqa, block_size, seed)
    scale = head_dim ** -0.5
    out = cpu_attention.paged_decode_attention(q, cache, tables, lens, scale, ops=ops)
    ref = reference.decode_attention(q.float(), cache.float(), tables, lens, scale)
    torch.testing.assert_close(out.float(), ref, **_tol(dtype))


@pytest.mark.parametrize("block_size", [16, 32])
@pytest.mark.parametrize("gqa", [1, 2, 4, 8])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=param_id)
def test_decode_matches_reference(ops, threads, dtype, gqa, block_size):
    _check_decode(ops, SEQ_LENS, dtype, 64, gqa, block_size)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=param_id)
def test_decode_of_a_sequence_is_the_same_in_any_batch_on_any_threads(ops, dtype):
    """Partitions of a fixed size: a sequence's output, bit for bit, does not depend on what
    shares its step or on the thread count (seeded sampling repeats however steps are made)."""
    q, cache, tables, lens = _decode_case(SEQ_LENS, dtype, 64, 2, 16, seed=3)
    scale = 64 ** -0.5
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        whole = cpu_attention.paged_decode_attention(q, cache, tables, lens, scale, ops=ops)
        torch.set_num_threads(2)
        for i in (0, 3, 4, 6):
            alone = cpu_attention.paged_decode_attention(q[i:i + 1], cache, tables[i:i + 1],
                                                         lens[i:i + 1], scale, ops=ops)
            assert torch.equal(alone[0], whole[i]), i
    finally:
        torch.set_num_threads(before)


# 128 (compiled for), 32 (the tiny model, run-time loop), 40 and 36 (not whole AVX-512 / AVX2
# vectors: the scalar tails); bfloat16 at 128 and 32 takes the pairwise bf16 dot products where
# the CPU has AVX512-BF16 (head dims of whole 32-value vectors)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=param_id)
@pytest.mark.parametrize("head_dim", [128, 32, 40, 36])
def test_decode_head_dims(ops, head_dim, dtype):
    _check_decode(ops, [1, 70, 700], dtype, head_dim, 4, 16, seed=1)


# groups of query heads per kv head as the bfloat16 key pass takes them (at most four heads'
# queries in registers at head dims 64 and 128; only the first group of a kv head asks for the
# rows ahead): 1 and 3 in one group, 5 = 4 + 1, 6 = 4 + 2, 7 = 4 + 3, 12 = 4 + 4 + 4
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=param_id)
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("heads", [(2, 2), (6, 2), (10, 2), (12, 2), (14, 2), (24, 2)],
                         ids=lambda h: f"G{h[0] // h[1]}")
def test_decode_odd_groups(ops, threads, heads, head_dim, dtype):
    _check_decode(ops, [1, 40, 530], dtype, head_dim, heads, 16, seed=2)


# several kv heads' queries held in registers at once by the bfloat16 key pass (as many as fit
# 16 vectors: 4 kv heads of 2 query heads at head dim 64, 8 of 1, 2 of 3 or 4; 2 of 2 at 128),
# then the kv heads left over one at a time
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=param_id)
@pytest.mark.parametrize("heads, head_dim", [((10, 5), 64), ((12, 12), 64), ((9, 3), 64),
                                             ((20, 5), 64), ((6, 3), 128)],
                         ids=lambda x: f"{x[0]}q{x[1]}kv" if isinstance(x, tuple) else f"D{x}")
def test_decode_kv_heads_side_by_side(ops, threads, heads, head_dim, dtype):
    _check_decode(ops, [1, 40, 530], dtype, head_dim, heads, 16, seed=4)


def _prefill_case(specs, dtype, head_dim, gqa, block_size, seed=0):
    """specs: (num_cached, chunk) per sequence; the chunks' keys are already in the cache."""
    gen = torch.Generator().manual_seed(seed)
    heads, kv_heads = HEADS[gqa] if gqa in HEADS else gqa  # or (heads, kv_heads)
    totals = [a + n for a, n in specs]
    num_blocks = sum(-(-t // block_size) for t in totals) + 3
    cache = random_cache(num_blocks, block_size, kv_heads, head_dim, dtype, gen)
    tables = block_tables(totals, block_size, num_blocks, gen)
    q = torch.randn((sum(n for _, n in specs), heads, head_dim), generator=gen).to(dtype)
    starts = torch.tensor([0] + [n for _, n in specs]).cumsum(0)
    return q, cache, tables, starts, torch.tensor([a for a, _ in specs])


def _prefill_reference(q, cache, tables, starts, num_cached, scale):
    out = []
    for i, a in enumerate(num_cached.tolist()):
        qi = q[starts[i]:starts[i + 1]].float()
        k, v = reference.gather_kv(cache.float(), tables[i])
        n = qi.shape[0]
        out.append(reference.prefill_attention(qi, k[a:a + n], v[a:a + n], cache.float(),
                                               tables[i], a, scale))
    return torch.cat(out)


# chunks over cached prefixes that end on a block boundary and off it, a fresh prompt, one
# token, and chunks longer than a query tile (128 rows) and a key tile (256 keys)
PREFILLS = [(0, 1), (16, 16), (5, 3), (37, 100), (0, 300), (250, 261), (512, 17)]


@pytest.mark.parametrize("block_size", [16, 32])
@pytest.mark.parametrize("gqa", [1, 2, 4, 8])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=param_id)
def test_prefill_over_cached_prefix_matches_reference(ops, threads, dtype, gqa, block_size):
    q, cache, tables, starts, cached = _prefill_case(PREFILLS, dtype, 64, gqa, block_size)
    scale = 64 ** -0.5
    out = cpu_attention.paged_prefill_attention(q, cache, tables, starts, cached, scale, ops=ops)
    ref = _prefill_reference(q, cache, tables, starts, cached, scale)
    torch.testing.assert_close(out.float(), ref, **_tol(dtype))


@pytest.mark.parametrize("heads, block_size, head_dim", [((6, 2), 12, 40), ((12, 1), 16, 4),
                                                         ((10, 2), 16, 64)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=param_id)
def test_prefill_odd_groups_blocks_and_head_dims(ops, threads, dtype, heads, block_size,
                                                 head_dim):
    """Groups of 3, 12 and 5 heads (no divisor of a 128-row query tile; 5 none of the AVX2
    lanes kernel's 144 rows either, whose last 24-row strip then holds padding rows), blocks
    of 12 slots (no divisor of a 256-key tile) and head dims of 40 and 4 (the last columns past
    whole micro-tiles, or no whole micro-tile at all)."""
    q, cache, tables, starts, cached = _prefill_case(PREFILLS, dtype, head_dim, heads,
                                                     block_size, seed=7)
    scale = head_dim ** -0.5
    out = cpu_attention.paged_prefill_attention(q, cache, tables, starts, cached, scale, ops=ops)
    ref = _prefill_reference(q, cache, tables, starts, cached, scale)
    torch.testing.assert_close(out.float(), ref, **_tol(dtype))


@pytest.mark.parametrize("gqa", [1, 4])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=param_id)
def test_prefill_over_a_long_prefix_beside_short_ones(ops, threads, dtype, gqa):
    """Chunks over a prefix of 2048 or more positions run in taller query tiles (kernel's
    kQueryRowsLong) than the others of the same step: both in one call, a chunk longer than a
    tall tile, one ending off a block boundary, one token."""
    specs = [(2048, 300), (0, 40), (2100, 5), (2049, 1), (100, 60)]
    q, cache, tables, starts, cached = _prefill_case(specs, dtype, 64, gqa, 16, seed=6)
    scale = 64 ** -0.5
    out = cpu_attention.paged_prefill_attention(q, cache, tables, starts, cached, scale, ops=ops)
    ref = _prefill_reference(q, cache, tables, starts, cached, scale)
    torch.testing.assert_close(out.float(), ref, **_tol(dtype))


@pytest.mark.parametrize("dtype, gemm", [
    (torch.float32, cpu_attention.PREFILL_FLOAT),
    (torch.bfloat16, cpu_attention.PREFILL_FLOAT),
    (torch.bfloat16, cpu_attention.PREFILL_DOT_BF16),
    (torch.bfloat16, cpu_attention.PREFILL_AMX)], ids=param_id)
def test_prefill_with_peaked_scores(ops, threads, dtype, gemm):
    """Scores tens of units apart (the query scaled by 30), as trained models' attention can
    give: most probabilities underflow to 0 and the running max jumps between key tiles, so
    the softmax's exponentials run far below 0 and earlier tiles are rescaled by tiny factors
    (the random cases above keep every score within a few units of its row's max). bfloat16
    both with its tiles widened to float and on its own dot products, where the CPU has them."""
    q, cache, tables, starts, cached = _prefill_case([(600, 77), (250, 261), (0, 40)], dtype,
                                                     64, 2, 16, seed=8)
    q = (q.float() * 30).to(dtype)
    scale = 64 ** -0.5
    out = cpu_attention.paged_prefill_attention(q, cache, tables, starts, cached, scale, ops=ops,
                                                gemm=gemm)
    ref = _prefill_reference(q, cache, tables, starts, cached, scale)
    torch.testing.assert_close(out.float(), ref, **_tol(dtype))


@pytest.mark.parametrize("head_dim", [128, 36])
def test_prefill_head_dims(ops, head_dim):
    q, cache, tables, starts, cached = _prefill_case([(40, 30), (0, 9)], torch.float32,
                                                     head_dim, 2, 16, seed=2)
    scale = head_dim ** -0.5
    out = cpu_attention.paged_prefill_attention(q, cache, tables, starts, cached, scale, ops=ops)
    ref = _prefill_reference(q, cache, tables, starts, cached, scale)
    torch.testing.assert_close(out, ref, **ATTN_TOL[torch.float32])


@pytest.mark.parametrize("gemm", [cpu_attention.PREFILL_FLOAT, cpu_attention.PREFILL_MKL_BF16,
                                  cpu_attention.PREFILL_DOT_BF16, cpu_attention.PREFILL_AMX])
@pytest.mark.parametrize("head_dim", [64, 128, 36])
def test_bf16_prefill_every_gemm(ops, threads, gemm, head_dim):
    """bfloat16 tiles converted to float, through MKL's bf16 GEMM, through the kernel's own
    bf16 dot products (AVX512-BF16; a build, CPU or head dim without them runs the first), or
    on AMX's tiles (without them, or for head dim 36, MKL's GEMM): the same answer. Query tiles
    of 64 tokens and key tiles of 256 with ragged ends, GQA 2."""
    q, cache, tables, starts, cached = _prefill_case([(33, 40), (250, 261), (0, 1)],
                                                     torch.bfloat16, head_dim, 2, 16, seed=4)
    scale = head_dim ** -0.5
    ref = _prefill_reference(q, cache, tables, starts, cached, scale)
    out = cpu_attention.paged_prefill_attention(q, cache, tables, starts, cached, scale,
                                                ops=ops, gemm=gemm)
    torch.testing.assert_close(out.float(), ref, **_tol(torch.bfloat16))


def test_writes_only_its_rows_of_a_shared_output(ops):
    """The backend hands out[:num_decodes] and out[num_decodes:] of one tensor."""
    q, cache, tables, lens = _decode_case([20, 5], torch.float32, 64, 4, 16, seed=3)
    big = torch.full((4, 8, 64), 7.0)
    cpu_attention.paged_decode_attention(q, cache, tables, lens, 0.125, out=big[1:3], ops=ops)
    ref = reference.decode_attention(q, cache, tables, lens, 0.125)
    torch.testing.assert_close(big[1:3], ref, **ATTN_TOL[torch.float32])
    assert (big[0] == 7).all() and (big[3] == 7).all()


def test_a_bad_plan_raises_instead_of_reading_outside_the_cache(ops, threads):
    """Only the blocks a sequence's positions need are read, and checked: on every thread
    count (the check runs inside the parallel region)."""
    q, cache, tables, lens = _decode_case([20, 5], torch.float32, 64, 4, 16, seed=4)
    bad = tables.clone()
    bad[1, 0] = cache.shape[1]  # one past the last block
    with pytest.raises(RuntimeError, match="outside the cache"):
        cpu_attention.paged_decode_attention(q, cache, bad, lens, 0.125, ops=ops)
    bad = tables.clone()
    bad[0, 1] = -1  # the second block of a sequence of 20 positions
    with pytest.raises(RuntimeError, match="block id -1 outside the cache"):
        cpu_attention.paged_decode_attention(q, cache, bad, lens, 0.125, ops=ops)
    bad = tables.clone()
    bad[1, 1:] = cache.shape[1]  # past what a sequence of 5 positions reads: harmless
    out = cpu_attention.paged_decode_attention(q, cache, bad, lens, 0.125, ops=ops)
    torch.testing.assert_close(out, reference.decode_attention(q, cache, tables, lens, 0.125),
                               **ATTN_TOL[torch.float32])
    with pytest.raises(RuntimeError, match="block table holds"):
        cpu_attention.paged_decode_attention(q, cache, tables, torch.tensor([20, 33]), 0.125,
                                             ops=ops)
    with pytest.raises(RuntimeError, match="share a dtype"):
        cpu_attention.paged_decode_attention(q.bfloat16(), cache, tables, lens, 0.125, ops=ops)



@pytest.mark.parametrize("dtype, gemm", [
    (torch.float32, cpu_attention.PREFILL_FLOAT), (torch.bfloat16, cpu_attention.PREFILL_FLOAT),
    (torch.bfloat16, cpu_attention.PREFILL_MKL_BF16),
    (torch.bfloat16, cpu_attention.PREFILL_DOT_BF16),
    (torch.bfloat16, cpu_attention.PREFILL_AMX)], ids=["fp32", "bf16-float", "bf16-mkl",
                                                       "bf16-dot", "bf16-amx"])
def test_a_bad_prefill_plan_raises_instead_of_reading_outside_the_cache(ops, threads, dtype,
                                                                        gemm):
    """A block of the cached prefix or of the chunk outside the cache, in every prefill path."""
    q, cache, tables, starts, cached = _prefill_case([(40, 30), (0, 9)], dtype, 64, 2, 16,
                                                     seed=5)
    for seq, block in ((0, 1), (0, 4), (1, 0)):  # prefix, chunk, a sequence without a prefix
        bad = tables.clone()
        bad[seq, block] = cache.shape[1]
        with pytest.raises(RuntimeError, match="outside the cache"):
            cpu_attention.paged_prefill_attention(q, cache, bad, starts, cached, 0.125,
                                                  ops=ops, gemm=gemm)


def test_a_scale_that_is_not_positive_is_refused(ops):
    q, cache, tables, seq_lens = _decode_case([5, 20], torch.float32, 64, 2, 16)
    pq, pcache, ptables, starts, cached = _prefill_case([(16, 8)], torch.float32, 64, 2, 16)
    for scale in (0.0, -0.125):
        with pytest.raises(RuntimeError, match="attention scale must be positive"):
            cpu_attention.paged_decode_attention(q, cache, tables, seq_lens, scale, ops=ops)
        with pytest.raises(RuntimeError, match="attention scale must be positive"):
            cpu_attention.paged_prefill_attention(pq, pcache, ptables, starts, cached, scale,
                                                  ops=ops)


@pytest.mark.parametrize("tokens", [1, 60, 700])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=param_id)
def test_write_kv_equals_the_reference(ops, threads, dtype, tokens):
    """Every row lands in its slot bit for bit, from rows that are views of one projection
    (as a step's k and v are) or contiguous; nothing else of the cache changes."""
    gen = torch.Generator().manual_seed(tokens)
    kv_heads, dim, block = 4, 64, 16
    cache = random_cache(64, block, kv_heads, dim, dtype, gen)
    slots = torch.randperm(64 * block, generator=gen)[:tokens]
    qkv = torch.randn((tokens, (8 + 2 * kv_heads) * dim), generator=gen).to(dtype)
    _, k, v = qkv.split([8 * dim, kv_heads * dim, kv_heads * dim], dim=1)
    k, v = k.view(tokens, kv_heads, dim), v.view(tokens, kv_heads, dim)
    for key, value in ((k, v), (k.contiguous(), v.contiguous()),
                       (k.transpose(1, 2).contiguous().transpose(1, 2), v)):
        ref, out = cache.clone(), cache.clone()
        reference.write_kv(key, value, ref, slots)
        cpu_attention.write_kv(key, value, out, slots, ops=ops)
        assert torch.equal(out, ref)


def test_write_kv_refuses_a_slot_outside_the_cache_and_writes_nothing(ops):
    gen = torch.Generator().manual_seed(9)
    cache = random_cache(4, 16, 2, 64, torch.float32, gen)
    before = cache.clone()
    k = torch.randn((3, 2, 64), generator=gen)
    for bad in (4 * 16, -1):
        with pytest.raises(RuntimeError, match="outside the cache"):
            cpu_attention.write_kv(k, k, cache, torch.tensor([0, bad, 5]), ops=ops)
        assert torch.equal(cache, before)
    with pytest.raises(RuntimeError, match="the cache's dtype"):
        cpu_attention.write_kv(k.bfloat16(), k.bfloat16(), cache, torch.tensor([0, 1, 2]),
                               ops=ops)


def test_backend_writes_the_step_and_attends_like_the_reference():
    """CpuAttentionBackend over a mixed step (decodes, a chunk over a prefix, a fresh prompt)
    equals TorchAttentionBackend, the readable reference."""
    from common.models.attention import (
        AttentionMetadata,
        CpuAttentionBackend,
        TorchAttentionBackend,
    )
    gen = torch.Generator().manual_seed(5)
    block, heads, kv_heads, dim = 16, 8, 2, 64
    cache = random_cache(40, block, kv_heads, dim, torch.float32, gen)
    meta = AttentionMetadata.build(decodes=[(20, [3, 9]), (0, [4]), (47, [1, 2, 5, 6])],
                                   prefills=[(16, 21, [7, 8, 10]), (0, 9, [11])],
                                   block_size=block)
    tokens = 3 + 21 + 9
    q = torch.randn((tokens, heads, dim), generator=gen)
    k = torch.randn((tokens, kv_heads, dim), generator=gen)
    v = torch.randn((tokens, kv_heads, dim), generator=gen)
    ref_cache = cache.clone()
    out = CpuAttentionBackend().forward(q, k, v, cache, meta, 0.125)
    ref = TorchAttentionBackend().forward(q, k, v, ref_cache, meta, 0.125)
    assert torch.equal(cache, ref_cache)
    torch.testing.assert_close(out, ref, **ATTN_TOL[torch.float32])


def test_unknown_instruction_set_is_refused():
    with pytest.raises(ValueError, match="known: AVX512, AVX2, DEFAULT"):
        cpu_attention.load("NEON9")


def test_a_failed_build_is_not_tried_again(monkeypatch):
    """The attention backend and the sampler both load the kernels at a worker's start: where
    the build fails (no compiler), the second asks without compiling again."""
    from torch.utils import cpp_extension
    calls = []

    def no_compiler(**kwargs):
        calls.append(kwargs["name"])
        raise RuntimeError("Error building extension: c++: not found")
    monkeypatch.setattr(cpp_extension, "load", no_compiler)
    monkeypatch.setattr(cpu_attention, "_loaded", {})
    monkeypatch.setattr(cpu_attention, "_failed", {})
    for _ in range(2):
        with pytest.raises(RuntimeError, match="c\\+\\+: not found"):
            cpu_attention.load("DEFAULT")
    assert calls == ["pdserve_attention_default"]


def test_a_build_killed_half_way_does_not_block_the_next(tmp_path):
    """torch marks a build in progress with a `lock` file it deletes when done; one killed
    half-way (an OOM kill during `make install`) left it behind and every later load waited on
    it forever. A load now finds it stale under its own flock and builds (here: nothing to do)."""
    import fcntl
    import shutil
    import subprocess
    import sys
    isa = cpu_attention.cpu_isa()
    cpu_attention.load(isa)
    version = f"torch{torch.__version__}"
    name = f"pdserve_attention_{isa.lower()}"
    shutil.copytree(cpu_attention.cache_dir() / version / name, tmp_path / version / name)
    build = tmp_path / version / name
    (build / "lock").touch()
    load = f"from kernels import cpu_attention; cpu_attention.load({isa!r}, wait_s=60)"
    env = {**os.environ, "PDSERVE_KERNEL_CACHE": str(tmp_path)}
    done = subprocess.run([sys.executable, "-c", load], env=env, timeout=120,
                          capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    assert not (build / "lock").exists()

    # a live build elsewhere (its flock held) is waited for, up to the deadline
    with open(build / "pdserve.lock", "a") as held:
        fcntl.flock(held, fcntl.LOCK_EX)
        waited = subprocess.run([sys.executable, "-c", load.replace("60", "0.5")], env=env,
                                timeout=120, capture_output=True, text=True)
    assert waited.returncode != 0
    assert "TimeoutError: another process has been building the CPU kernels" in waited.stderr
