"""Tensor parallelism of the model: T rank processes over gloo (the CPU's collectives) compute
the logits one process computes, prefill and greedy decode through each rank's own paged KV
cache, for llama, qwen2 (QKV bias, tied embeddings) and qwen3 (QK norm); T = 2 splits the KV
heads, T = 4 replicates them (the tiny models have 2)."""
import os
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from common.kv_cache import PagedKVCache
from common.kv_layout import KVLayout
from common.models.attention import create_attention_backend
from common.models.llama import load_model
from common.models.parallel import TensorParallel
from common.ports import free_port
from tests.unit.test_model_vs_hf import BLOCK, NUM_BLOCKS, TOL, _forward, _run

STEPS = 8
BLOCKS = [9, 3, 41, 7, 22, 15]


def _greedy_logits(model, prompt: list[int]) -> torch.Tensor:
    """[1 + STEPS, vocab]: the prompt's last logits, then each greedy decode step's."""
    c = model.config
    cache = PagedKVCache(KVLayout(c.num_layers, model.num_kv_heads, c.head_dim, BLOCK,
                                  "float32"), NUM_BLOCKS)
    out = [_run(model, cache, prefills=[(prompt, 0, BLOCKS)])[-1]]
    seq = list(prompt)
    for _ in range(STEPS):
        seq.append(int(out[-1].argmax()))
        out.append(_run(model, cache, decodes=[(seq[-1], len(seq) - 1, BLOCKS)])[0])
    return torch.stack(out)


ARCHS = ("llama", "qwen2", "qwen3")


def _references(tiny_models, seed: int) -> tuple[dict, dict]:
    """Per arch: one process's greedy logits for a prompt of its own, and that prompt."""
    want, prompts = {}, {}
    for i, arch in enumerate(ARCHS):
        one = load_model(tiny_models[arch], create_attention_backend("cpu"), progress=False)
        g = torch.Generator().manual_seed(seed + i)
        prompts[arch] = torch.randint(0, one.config.vocab_size, (37,), generator=g).tolist()
        want[arch] = _greedy_logits(one, prompts[arch])
    return want, prompts


def _leave() -> None:
    """Ends a rank process that did its work without the interpreter's teardown. gloo's worker
    threads release the tensors of a finished collective on their own, which takes the GIL;
    a thread that asks for it while the interpreter finalizes aborts the whole process
    ("terminate called without an active exception", SIGABRT), and after the last step of a
    loaded host that release can come later than the exit. Every result is saved by now."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def _rank(rank: int, size: int, port: int, models: list[tuple[str, str, list[int]]],
          out: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=size)
    try:
        for arch, model_dir, prompt in models:
            model = load_model(model_dir, create_attention_backend("cpu"), progress=False,
                               tp=TensorParallel(rank, size))
            c, mlp = model.config, model.layers[0].mlp
            assert model.lm_head.out_features == c.vocab_size // size  # its share only
            assert mlp.down_proj.in_features == c.intermediate_size // size
            assert model.num_kv_heads == max(1, c.num_kv_heads // size)
            torch.save(_greedy_logits(model, prompt), Path(out) / f"{arch}-rank{rank}.pt")
    finally:
        dist.destroy_process_group()
    _leave()


@pytest.mark.parametrize("size", [2, 4])
def test_a_tensor_parallel_group_computes_one_process_logits(tiny_models, size, tmp_path):
    want, prompts = _references(tiny_models, seed=3)
    models = [(arch, str(tiny_models[arch]), prompts[arch]) for arch in ARCHS]
    mp.start_processes(_rank, args=(size, free_port(), models, str(tmp_path)), nprocs=size,
                       start_method="spawn")
    for arch in ARCHS:
        for rank in range(size):  # every rank has the whole logits (all-gathered)
            got = torch.load(tmp_path / f"{arch}-rank{rank}.pt")
            torch.testing.assert_close(got, want[arch], **TOL)
            assert got.argmax(-1).tolist() == want[arch].argmax(-1).tolist(), (arch, rank)


def test_a_group_that_cannot_split_the_model_is_refused(tiny_models):
    from common.models.config import ModelConfig
    cfg = ModelConfig.from_pretrained(tiny_models["llama"])
    with pytest.raises(ValueError, match="must divide"):
        TensorParallel(0, 3).check(cfg.num_heads, cfg.num_kv_heads, cfg.intermediate_size,
                                   cfg.vocab_size)
    with pytest.raises(ValueError, match="KV heads"):
        TensorParallel(0, 8).check(16, 3, 64, 64)
    with pytest.raises(ValueError, match="rank"):
        TensorParallel(2, 2)


def _stage(rank: int, world: int, tp_size: int, port: int,
           models: list[tuple[str, str, list[int], list[int]]], out: str) -> None:
    """Rank `rank` of a pipeline of world / tp_size stages, each a tensor-parallel group of
    tp_size: ranks stage * tp_size + t. Every stage runs the same steps (the reference's greedy
    tokens as input); the last stage's ranks save the logits."""
    from common.models.parallel import PipelineParallel
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world)
    try:
        stages = world // tp_size
        groups = [dist.new_group([s * tp_size + t for t in range(tp_size)])
                  for s in range(stages)]  # every rank makes every group
        stage, t = divmod(rank, tp_size)
        tp = TensorParallel(t, tp_size, groups[stage]) if tp_size > 1 else None
        pp = PipelineParallel(stage, stages, prev=rank - tp_size, next=rank + tp_size)
        for arch, model_dir, prompt, tokens in models:
            model = load_model(model_dir, create_attention_backend("cpu"), progress=False,
                               tp=tp, pp=pp)
            c = model.config
            first, last = pp.layers(c.num_layers)
            assert len(model.layers) == last - first
            assert (model.embed_tokens is None) != pp.is_first
            assert (model.lm_head is None) != pp.is_last
            cache = PagedKVCache(KVLayout(len(model.layers), model.num_kv_heads, c.head_dim,
                                          BLOCK, "float32"), NUM_BLOCKS)
            steps = [_forward(model, cache, prefills=[(prompt, 0, BLOCKS)])]
            seq = list(prompt)
            for tok in tokens:
                seq.append(tok)
                steps.append(_forward(model, cache,
                                            decodes=[(tok, len(seq) - 1, BLOCKS)]))
            pp.flush()  # an earlier stage's sends leave in the background
            if pp.is_last:
                logits = torch.stack([model.compute_logits(h)[-1] for h in steps])
                torch.save(logits, Path(out) / f"{arch}-rank{rank}.pt")
    finally:
        dist.destroy_process_group()
    _leave()


@pytest.mark.parametrize("stages,tp_size", [(2, 1), (2, 2)], ids=["P2", "T2xP2"])
def test_a_pipeline_computes_one_process_logits(tiny_models, stages, tp_size, tmp_path):
    want, prompts = _references(tiny_models, seed=7)
    models = [(arch, str(tiny_models[arch]), prompts[arch], want[arch].argmax(-1).tolist()[:STEPS])
              for arch in ARCHS]
    world = stages * tp_size
    mp.start_processes(_stage, args=(world, tp_size, free_port(), models, str(tmp_path)),
                       nprocs=world, start_method="spawn")
    for arch in ARCHS:
        for rank in range(world - tp_size, world):  # the last stage's ranks
            got = torch.load(tmp_path / f"{arch}-rank{rank}.pt")
            torch.testing.assert_close(got, want[arch], **TOL)
