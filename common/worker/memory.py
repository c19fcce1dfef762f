"""How many KV blocks a worker allocates.

    --num-kv-blocks N          exactly N
    --kv-cache-memory-mib M    M MiB of blocks
    neither, on CPU            1 GiB of blocks (shared memory)
    neither, on a GPU          --gpu-memory-utilization x the device's memory, less what the
                               weights and the activations of the largest step take (measured by
                               running one step of --max-num-batched-tokens tokens)

Each worker's fraction is its own: two workers sharing one GPU take 0.45 each, say; a worker
that would need memory another process holds refuses to start, saying so.
"""
from __future__ import annotations

import logging

import torch

from common.kv_cache import PagedKVCache, on_device
from common.kv_layout import KVLayout
from common.models.attention import AttentionMetadata
from common.models.llama import LlamaForCausalLM

log = logging.getLogger(__name__)

MIB = 1 << 20
GIB = 1 << 30
CPU_KV_CACHE_MIB = 1024
SAMPLED_ROWS = 256  # the scheduler's default --max-num-seqs


class MemoryBudgetError(Exception):
    """The KV cache cannot have the memory the flags ask for."""


def kv_cache_bytes(total: int, utilization: float, in_use: int, free: int) -> int:
    """Bytes the KV cache may take on a device of `total` bytes, `free` of them free now, when
    this worker may use `utilization` of it and already uses `in_use` at its peak."""
    budget = int(total * utilization) - in_use
    if budget <= 0:
        raise MemoryBudgetError(
            f"--gpu-memory-utilization {utilization} allows {total * utilization / GIB:.2f} GiB, "
            f"but the weights and the largest step's activations take {in_use / GIB:.2f} GiB: "
            "raise it, or lower --max-num-batched-tokens")
    if budget > free:
        raise MemoryBudgetError(
            f"the KV cache would take {budget / GIB:.2f} GiB, but only {free / GIB:.2f} GiB of "
            "the device are free (other processes hold the rest): lower "
            "--gpu-memory-utilization so that the workers sharing it add up to less than 1")
    return budget


def _scratch_forward(model: LlamaForCausalLM, cache: PagedKVCache,
                     decodes: list[tuple[int, list[int]]],
                     prefills: list[tuple[int, int, list[int]]], device: torch.device
                     ) -> torch.Tensor:
    """The hidden states of one step (decodes and prefills as AttentionMetadata.build takes
    them) through the model on a scratch cache, every token id 0."""
    meta = AttentionMetadata.build(decodes, prefills, cache.layout.block_size).to(device)
    positions = [n for n, _ in decodes] + [p for n, k, _ in prefills for p in range(n, n + k)]
    positions_t = torch.tensor(positions, dtype=torch.long) % model.config.max_position_embeddings
    ids = torch.zeros(len(positions), dtype=torch.long, device=device)
    return model(ids, positions_t.to(device), cache.layers, meta)


def profile_step(model: LlamaForCausalLM, layout: KVLayout, num_tokens: int,
                 device: torch.device) -> None:
    """One prefill of num_tokens through the model on a scratch cache: the largest step the
    worker will be planned for, so that its activations reach their peak."""
    num_blocks = -(-num_tokens // layout.block_size)
    cache = PagedKVCache(layout, num_blocks, device=device)
    hidden = _scratch_forward(model, cache, [], [(0, num_tokens, list(range(num_blocks)))],
                              device)
    # a decode step samples up to a row per token: logits and the sampler's sort and softmax
    logits = model.compute_logits(hidden[:min(num_tokens, SAMPLED_ROWS)])
    logits.sort(dim=-1)
    logits.softmax(dim=-1)
    cache.close()


def warm_up_kernels(model: LlamaForCausalLM, layout: KVLayout, device: torch.device) -> None:
    """Steps over a scratch cache that reach every variant the GPU attention kernels compile (a
    decode whose context splits and one whose context does not, a prefill over a cached prefix
    at an unaligned width, a mixed step), so that no user's request waits for a compilation:
    CUDA graph capture covers only pure decode batches, and the memory profile runs only where
    neither --num-kv-blocks nor --kv-cache-memory-mib is given. Block ids repeat: attention
    reads whatever the blocks hold."""
    span = 640  # past two of the decode kernel's shortest splits: batch 1 splits it
    cache = PagedKVCache(layout, 2, device=device)
    steps = [([(span - 1, [0] * -(-span // layout.block_size))], []),     # split
             ([(4, [0]), (5, [1]), (6, [0])], []),                          # not split
             ([(8, [1])], [(16, 17, [0, 1, 0]), (0, 16, [1])])]             # mixed, prefix
    for decodes, prefills in steps:
        hidden = _scratch_forward(model, cache, decodes, prefills, device)
        if model.lm_head is not None:  # the last pipeline stage
            model.compute_logits(hidden[:len(decodes)])
    cache.close()


def num_kv_blocks(num_blocks: int, memory_mib: int, utilization: float, max_step_tokens: int,
                  model: LlamaForCausalLM, layout: KVLayout, device: torch.device) -> int:
    """The worker's KV block count, by the rules in this module's docstring."""
    if num_blocks:
        return num_blocks
    if memory_mib or device.type == "cpu":
        return max(1, (memory_mib or CPU_KV_CACHE_MIB) * MIB // layout.block_bytes)
    torch.cuda.reset_peak_memory_stats(device)
    with on_device(device):
        profile_step(model, layout, max_step_tokens, device)
    torch.cuda.synchronize(device)
    in_use = torch.cuda.max_memory_allocated(device)
    torch.cuda.empty_cache()
    free, total = torch.cuda.mem_get_info(device)
    budget = kv_cache_bytes(total, utilization, in_use, free)
    blocks = budget // layout.block_bytes
    if blocks < 1:
        raise MemoryBudgetError(f"{budget} bytes hold no KV block of {layout.block_bytes} bytes")
    log.info("KV cache: %d blocks, %.2f GiB (%.0f%% of %.1f GiB less %.2f GiB for weights and "
             "activations)", blocks, blocks * layout.block_bytes / GIB, utilization * 100,
             total / GIB, in_use / GIB)
    return blocks
