"""The CPU kernels (kernels/csrc): builder and launchers. Paged attention
(paged_attention.cpp), the sampler's exponential race (sampling.cpp), the decoder's fused
element-wise steps (elementwise.cpp) and the float32 linears over packed panels (linear.cpp) are
one extension.

The extension is compiled once per instruction set; a worker runs the one torch itself
dispatches to on this CPU (`torch.backends.cpu.get_cpu_capability()`: AVX512, AVX2 or DEFAULT),
so kernels built for one machine never run on a CPU that lacks their instructions. Builds are
cached on disk (`PDSERVE_KERNEL_CACHE`, default ~/.cache/pdserve/kernels) and rebuilt only when
the source, the flags or torch change: `make install` builds the one this machine needs, and a
worker loads it before it reports ready. Processes that start together build once: each holds an
advisory lock on the build directory (`fcntl.flock`, freed by the kernel when its holder dies)
for at most BUILD_WAIT_S, so a build killed half-way (an OOM kill during `make install`) leaves
nothing that blocks the next one.
"""
from __future__ import annotations

import contextlib
import fcntl
import functools
import os
import threading
import time
from pathlib import Path

import torch

CSRC = Path(__file__).parent / "csrc"
# with isa.h, vec_helpers.h and ops.h; the dispatcher's header only in registration.cpp
SOURCES = [CSRC / "paged_attention.cpp", CSRC / "sampling.cpp", CSRC / "elementwise.cpp",
           CSRC / "linear.cpp", CSRC / "pool.cpp", CSRC / "registration.cpp"]

# PDSERVE_ISA selects the kernels' target and at::vec's vector width; the library's load-time
# code is baseline, so every build loads anywhere (an image can carry all three)
ISA_FLAGS = {"AVX512": ["-DPDSERVE_ISA=2"], "AVX2": ["-DPDSERVE_ISA=1"],
             "DEFAULT": ["-DPDSERVE_ISA=0"]}

BUILD_WAIT_S = 900.0  # the longest a process waits for another's build of the same kernels

_lock = threading.Lock()
_loaded: dict[str, object] = {}
_failed: dict[str, Exception] = {}  # a build that failed is not tried again in this process


def cpu_isa() -> str:
    """The widest instruction set this CPU runs that a build exists for."""
    cap = torch.backends.cpu.get_cpu_capability()
    if cap.startswith("AVX512"):
        return "AVX512"
    return cap if cap in ISA_FLAGS else "DEFAULT"


def cache_dir() -> Path:
    root = os.environ.get("PDSERVE_KERNEL_CACHE") or Path.home() / ".cache" / "pdserve" / "kernels"
    return Path(root)


@contextlib.contextmanager
def _build_lock(build: Path, wait_s: float):
    """Holds the build directory against every other process that loads these kernels; raises
    TimeoutError after `wait_s` seconds of another holding it."""
    with open(build / "pdserve.lock", "a") as f:
        deadline = time.monotonic() + wait_s
        while True:
            try:
                fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() >= deadline:
                    raise TimeoutError(f"another process has been building the CPU kernels in "
                                       f"{build} for over {wait_s:.0f} s") from None
                time.sleep(0.2)
        try:
            # torch's own marker (a file it deletes when its build ends): with the flock held
            # nobody is building, so one found here is left by a build that was killed
            (build / "lock").unlink(missing_ok=True)
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def build_flags(name: str, isa: str, extra: list[str] | None = None
                ) -> tuple[list[str], list[str]]:
    """cpp_extension.load's compiler and linker flags for the build `name` of the kernels for
    `isa` (`extra`: more compiler flags, macros the sources read)."""
    # at::parallel_for is inline OpenMP: the same libgomp as torch's (already loaded, same
    # soname), so one thread pool
    return (["-O3", "-fopenmp", f"-DPDSERVE_OPS={name}", *ISA_FLAGS[isa], *(extra or [])],
            ["-fopenmp"])


def load(isa: str | None = None, verbose: bool = False, wait_s: float = BUILD_WAIT_S):
    """The ops of the build for `isa` (default: this CPU's), compiling it on first use.
    Returns the `torch.ops` namespace holding paged_decode_attention, paged_prefill_attention,
    write_kv, exponential_race, argmax_rows, the decoder's fused element-wise ops (silu_mul,
    rms_norm, rope) and the panel linears (pack_linear_weight, packed_linear). A build that
    failed raises the same error on every later call (the attention backend and the sampler
    both ask for it at a worker's start). Waits at most `wait_s` for another process's build
    of the same kernels (TimeoutError, not cached: a later call waits again)."""
    isa = isa or cpu_isa()
    if isa not in ISA_FLAGS:
        raise ValueError(f"unknown instruction set {isa!r}; known: {', '.join(ISA_FLAGS)}")
    with _lock:
        if isa in _failed:
            raise _failed[isa]
        if isa not in _loaded:
            from torch.utils import cpp_extension
            name = f"pdserve_attention_{isa.lower()}"
            build = cache_dir() / f"torch{torch.__version__}" / name
            build.mkdir(parents=True, exist_ok=True)
            with _build_lock(build, wait_s):
                try:
                    cflags, ldflags = build_flags(name, isa)
                    cpp_extension.load(name=name, sources=[str(p) for p in SOURCES],
                                       build_directory=str(build), extra_cflags=cflags,
                                       extra_ldflags=ldflags, is_python_module=False,
                                       verbose=verbose)
                except Exception as e:
                    _failed[isa] = e
                    raise
            _loaded[isa] = getattr(torch.ops, name)
        return _loaded[isa]


@functools.cache
def has_fast_bf16_gemm() -> bool:
    """Whether oneDNN computes bfloat16 GEMMs natively here (AVX512-BF16 or AMX): packed
    bfloat16 linears pay only then."""
    return has_avx512_bf16() or has_amx()


@functools.cache
def has_amx() -> bool:
    """Whether the CPU has AMX tiles."""
    return bool(getattr(getattr(torch, "cpu", None), "_is_amx_tile_supported", lambda: False)())


@functools.cache
def has_avx512_bf16() -> bool:
    return bool(getattr(getattr(torch, "cpu", None), "_is_avx512_bf16_supported",
                        lambda: False)())


# How the prefill kernel multiplies bfloat16 tiles: 0 converted to float (the AVX-512 and AVX2
# builds' float32 lanes kernel, the portable build's float32 GEMMs); 1 MKL's bfloat16 GEMM;
# 2 its own bfloat16 dot products (AVX512-BF16 without AMX: MKL's bfloat16 GEMM ran the score
# and value tiles (256 keys x 128 rows x head_dim) about 10% slower there than converting them
# to float, and converting halves the multiply rate); 3 AMX's tiles, its own products on the
# tile unit (where MKL's GEMMs ran them at about 120 GFLOP/s a thread). The kernel runs 1 where
# it cannot take 3 (no AMX, Linux refusing the tiles, a head dim that is no multiple of 64),
# and 0 where the build or the head dim cannot take 2.
PREFILL_FLOAT, PREFILL_MKL_BF16, PREFILL_DOT_BF16, PREFILL_AMX = 0, 1, 2, 3


def prefill_gemm(dtype: torch.dtype) -> int:
    if dtype != torch.bfloat16:
        return PREFILL_FLOAT
    if has_amx():
        return PREFILL_AMX
    return PREFILL_DOT_BF16 if has_avx512_bf16() else PREFILL_FLOAT


def paged_decode_attention(q: torch.Tensor, kv_cache: torch.Tensor, block_tables: torch.Tensor,
                           seq_lens: torch.Tensor, scale: float, out: torch.Tensor | None = None,
                           ops=None) -> torch.Tensor:
    """One query per sequence over its paged keys/values.

    q: [batch, heads, head_dim]; kv_cache: [2, num_blocks, block_size, kv_heads, head_dim] of
    q's dtype; block_tables: [batch, max_blocks] int64; seq_lens: [batch] int64 (the query's
    own key included, already written). Returns out [batch, heads, head_dim].
    """
    if out is None:
        out = torch.empty_like(q, memory_format=torch.contiguous_format)
    (ops or load()).paged_decode_attention(q, kv_cache, block_tables, seq_lens, scale, out)
    return out


def write_kv(key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor,
             slot_mapping: torch.Tensor, ops=None) -> None:
    """key/value: [num_tokens, kv_heads, head_dim] -> their slots in the paged cache
    (reference.write_kv), each row copied once from where it lies (rows made contiguous
    first where they are not)."""
    key, value = _rows(key), _rows(value)
    (ops or load()).write_kv(key, value, kv_cache, slot_mapping)


def _rows(t: torch.Tensor) -> torch.Tensor:
    return t if t.stride(-1) == 1 and t.stride(-2) == t.size(-1) else t.contiguous()


def paged_prefill_attention(q: torch.Tensor, kv_cache: torch.Tensor, block_tables: torch.Tensor,
                            query_start_loc: torch.Tensor, num_cached: torch.Tensor, scale: float,
                            out: torch.Tensor | None = None, ops=None,
                            gemm: int | None = None) -> torch.Tensor:
    """Causal attention of every prefill chunk of a step, each over its cached prefix and
    itself, all keys read from the paged cache (the chunk's own keys written first).

    q: [num_tokens, heads, head_dim], chunk i at rows [query_start_loc[i], query_start_loc[i+1])
    at positions [num_cached[i], num_cached[i] + its length); block_tables: [seqs, max_blocks].
    """
    if out is None:
        out = torch.empty_like(q, memory_format=torch.contiguous_format)
    (ops or load()).paged_prefill_attention(q, kv_cache, block_tables, query_start_loc,
                                            num_cached, scale, gemm if gemm is not None
                                            else prefill_gemm(q.dtype), out)
    return out


def exponential_race(probs: torch.Tensor, keys: list[int], logits: bool = False,
                     ops=None, cut: torch.Tensor | None = None) -> torch.Tensor:
    """[rows] one token per row of probs [rows, vocab] (float32, rows need not sum to 1; with
    `logits`, log-weights, exponentiated in passing): the exponential race, its noise a function
    of the row's 64-bit key (unsigned) and the token alone (reference.exponential_race). `cut`
    [rows] (with `logits`): a row's logits below its cut weigh nothing, as if masked to -inf."""
    signed = torch.tensor([k - (1 << 64) if k >= 1 << 63 else k for k in keys],
                          dtype=torch.long)  # the kernel reads the 64 bits back unsigned
    out = torch.empty(probs.shape[0], dtype=torch.long)
    if cut is not None:
        cut = cut.float().contiguous()
    (ops or load()).exponential_race(probs.float().contiguous(), signed, logits, cut, out)
    return out


def divide_rows(x: torch.Tensor, d: torch.Tensor, ops=None) -> torch.Tensor:
    """x / d[:, None] of a float32 [rows, n] CPU tensor with contiguous rows and d [rows] (the
    same bits as torch's division), on the kernels' threads (csrc/sampling.cpp)."""
    out = torch.empty_like(x, memory_format=torch.contiguous_format)
    (ops or load()).divide_rows(x, d.float().contiguous(), out)
    return out


def argmax_rows(x: torch.Tensor, ops=None) -> torch.Tensor:
    """[rows] torch.argmax(x, dim=-1) of a float32 [rows, n > 0] CPU tensor (ties to the lowest
    index, a NaN as the largest), in the race kernel's file (csrc/sampling.cpp)."""
    out = torch.empty(x.shape[0], dtype=torch.long)
    (ops or load()).argmax_rows(x.float().contiguous(), out)
    return out


def pack_linear_weight(weight: torch.Tensor, ops=None) -> torch.Tensor:
    """A float32 linear weight [out_features, in_features] as the panels packed_linear reads
    (csrc/linear.cpp): [ceil(out / width), in_features, width], zeros past out_features, width
    two of the build's float vectors (16 on AVX2 and the portable build, 32 on AVX-512)."""
    return (ops or load()).pack_linear_weight(weight.detach().float())


def packed_linear(x: torch.Tensor, packed: torch.Tensor, out_features: int,
                  bias: torch.Tensor | None = None, ops=None) -> torch.Tensor:
    """x [..., in_features] float32 times a weight packed by pack_linear_weight (of the same
    build), plus bias: [..., out_features]. Rows of a 2-D x may be strided (a slice of a wider
    tensor); other shapes are taken as rows of their last dimension."""
    rows = x if x.dim() == 2 and x.stride(-1) == 1 else x.reshape(-1, x.shape[-1])
    if rows.stride(-1) != 1:
        rows = rows.contiguous()
    out = torch.empty(rows.shape[0], out_features, dtype=torch.float32)
    (ops or load()).packed_linear(rows, packed, bias, out)
    return out.view(*x.shape[:-1], out_features)
