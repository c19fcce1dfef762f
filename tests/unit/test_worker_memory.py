"""KV cache sizing: explicit flags, the CPU default, and the GPU budget from a memory fraction."""
import pytest
import torch

from common.kv_layout import KVLayout
from common.models.attention import create_attention_backend
from common.models.llama import load_model
from common.worker.memory import (GIB, MIB, MemoryBudgetError, kv_cache_bytes, num_kv_blocks,
                                  profile_step)


def test_budget_is_the_fraction_less_what_the_worker_uses():
    assert kv_cache_bytes(80 * GIB, 0.45, 10 * GIB, 70 * GIB) == 26 * GIB
    # two workers on one GPU: the second sees the first's 36 GiB as taken, and fits beside it
    assert kv_cache_bytes(80 * GIB, 0.45, 10 * GIB, 80 * GIB - 36 * GIB - 10 * GIB) == 26 * GIB


def test_budget_errors_say_which_flag_to_change():
    with pytest.raises(MemoryBudgetError, match="raise it, or lower --max-num-batched-tokens"):
        kv_cache_bytes(80 * GIB, 0.1, 9 * GIB, 70 * GIB)
    with pytest.raises(MemoryBudgetError, match="add up to less than 1"):
        kv_cache_bytes(80 * GIB, 0.9, 10 * GIB, 40 * GIB)  # another process holds 30 GiB


def test_explicit_flags_and_the_cpu_default(tiny_llama):
    model = load_model(str(tiny_llama), create_attention_backend("torch", torch.device("cpu")),
                       torch.float32, torch.device("cpu"))
    mc = model.config
    layout = KVLayout(num_layers=mc.num_layers, num_kv_heads=mc.num_kv_heads,
                      head_dim=mc.head_dim, block_size=16, dtype="float32")
    cpu = torch.device("cpu")
    assert num_kv_blocks(7, 0, 0.9, 64, model, layout, cpu) == 7
    assert num_kv_blocks(0, 3, 0.9, 64, model, layout, cpu) == 3 * MIB // layout.block_bytes
    assert num_kv_blocks(0, 0, 0.9, 64, model, layout, cpu) == 1024 * MIB // layout.block_bytes
    profile_step(model, layout, 37, cpu)  # the profiling step runs on any device


@pytest.mark.cuda
def test_gpu_cache_takes_its_fraction(tiny_llama):
    device = torch.device("cuda")
    model = load_model(str(tiny_llama), create_attention_backend("triton", device),
                       torch.float16, device)
    mc = model.config
    layout = KVLayout(num_layers=mc.num_layers, num_kv_heads=mc.num_kv_heads,
                      head_dim=mc.head_dim, block_size=16, dtype="float16")
    free, total = torch.cuda.mem_get_info(device)
    blocks = num_kv_blocks(0, 0, 0.2, 2048, model, layout, device)
    assert 0.15 * total < blocks * layout.block_bytes <= 0.2 * total
    with pytest.raises(MemoryBudgetError):
        num_kv_blocks(0, 0, 1.0, 2048, model, layout, device)  # the CUDA context takes some
