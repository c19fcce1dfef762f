"""The model on the triton backend: same greedy tokens as the torch backend on the tiny models
(interpreted on CPU), and CUDA-graph decode steps identical to eager (GPU only)."""
import pytest
import torch

from common.models.attention import (AttentionMetadata, CpuAttentionBackend,
                                     TorchAttentionBackend, TritonAttentionBackend,
                                     create_attention_backend)
from common.models.llama import load_model
from tests.kernels.paged import DEVICE

BLOCK = 16
NUM_BLOCKS = 16
# fp32: the kernels sum in another order than torch; logits of magnitude ~10-30
TOL = dict(rtol=1e-4, atol=1e-3)


def test_auto_picks_triton_on_cuda_only():
    assert isinstance(create_attention_backend("auto", "cpu"), CpuAttentionBackend)
    assert isinstance(create_attention_backend("auto", "cuda"), TritonAttentionBackend)
    with pytest.raises(ValueError, match="known: auto, cpu, torch, triton"):
        create_attention_backend("flash", "cpu")
    with pytest.raises(ValueError, match="needs the model and its KV cache on the CPU"):
        create_attention_backend("cpu", "cuda")


def test_auto_falls_back_to_torch_when_the_cpu_kernels_cannot_be_built(monkeypatch):
    from kernels import cpu_attention

    def no_compiler(isa=None):
        raise RuntimeError("Error building extension: c++: not found")
    monkeypatch.setattr(cpu_attention, "load", no_compiler)
    assert isinstance(create_attention_backend("auto", "cpu"), TorchAttentionBackend)
    with pytest.raises(RuntimeError, match="c\\+\\+: not found"):
        create_attention_backend("cpu", "cpu")


class Runner:
    """A model, its paged cache and the steps of a test, like ModelRunner without requests."""

    def __init__(self, model_dir, backend: str, dtype=torch.float32):
        # loaded on its device: a model loaded on the CPU packs its linears for oneDNN, which a
        # later .to("cuda") cannot move
        self.model = load_model(model_dir, create_attention_backend(backend, DEVICE), dtype,
                                DEVICE)
        c = self.model.config
        self.cache = torch.zeros((c.num_layers, 2, NUM_BLOCKS, BLOCK, c.num_kv_heads, c.head_dim),
                                 dtype=dtype, device=DEVICE)

    def step(self, prefills=(), decodes=()):
        """prefills: (token_ids, num_cached, block_ids); decodes: (token_id, num_cached, block_ids)
        -> logits [num_tokens, vocab]."""
        ids = [t for t, _, _ in decodes] + [t for toks, _, _ in prefills for t in toks]
        pos = [n for _, n, _ in decodes] + [p for toks, n, _ in prefills
                                            for p in range(n, n + len(toks))]
        meta = AttentionMetadata.build([(n, b) for _, n, b in decodes],
                                       [(n, len(t), b) for t, n, b in prefills], BLOCK)
        hidden = self.model(torch.tensor(ids, device=DEVICE), torch.tensor(pos, device=DEVICE),
                            list(self.cache.unbind(0)), meta.to(DEVICE))
        return self.model.compute_logits(hidden)


def _greedy(runner: Runner, a: list[int], b: list[int], num_steps: int):
    """a in two chunks (the second over a cached prefix, beside all of b), then batched decodes."""
    blocks_a, blocks_b = [5, 1], [9]
    runner.step(prefills=[(a[:7], 0, blocks_a)])
    logits = runner.step(prefills=[(a[7:], 7, blocks_a), (b, 0, blocks_b)])
    all_logits = [logits]
    seqs = [a + [int(logits[len(a) - 8].argmax())], b + [int(logits[-1].argmax())]]
    for _ in range(num_steps):
        logits = runner.step(decodes=[(s[-1], len(s) - 1, blk)
                                      for s, blk in zip(seqs, (blocks_a, blocks_b))])
        all_logits.append(logits)
        for s, row in zip(seqs, logits):
            s.append(int(row.argmax()))
    return seqs, all_logits


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_triton_backend_greedy_tokens_match_torch(tiny_models, arch):
    g = torch.Generator().manual_seed(4)
    a, b = (torch.randint(0, 2000, (n,), generator=g).tolist() for n in (12, 5))
    tokens, logits = _greedy(Runner(tiny_models[arch], "torch"), a, b, num_steps=4)
    triton_tokens, triton_logits = _greedy(Runner(tiny_models[arch], "triton"), a, b, num_steps=4)
    assert triton_tokens == tokens
    for ours, ref in zip(triton_logits, logits):
        torch.testing.assert_close(ours, ref, **TOL)


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_cuda_graph_decode_matches_eager(tiny_llama, dtype):
    """Decode steps captured once per batch-size bucket and replayed with new inputs give the
    eager forward's output bit for bit; rows past the real batch are padding (slot -1, length
    0) and leave the cache alone."""
    runner = Runner(tiny_llama, "triton", dtype)
    model, layers = runner.model, list(runner.cache.unbind(0))
    g = torch.Generator().manual_seed(5)
    buckets, max_blocks = (1, 2, 4, 8), 4
    # prompts of 3..17 tokens, + 1 sampled + at most 4 buckets x 3 steps: under 32 = 2 blocks
    prompts = [torch.randint(0, 2000, (3 + 2 * i,), generator=g).tolist() for i in range(8)]
    tables = [[i * 2, i * 2 + 1] for i in range(8)]
    runner.step(prefills=[(p, 0, t) for p, t in zip(prompts, tables)])
    seqs = [p + [int(torch.randint(0, 2000, (1,), generator=g))] for p in prompts]

    for bucket in buckets:
        real = max(1, bucket - 1)
        static = _decode_inputs(seqs[:real], tables[:real], bucket, max_blocks)
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):  # warm up: compiles the kernels outside the capture
            model(static["ids"], static["pos"], layers, static["meta"])
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            graph_out = model(static["ids"], static["pos"], layers, static["meta"])
        for step in range(3):  # new inputs copied into the captured buffers each step
            new = _decode_inputs(seqs[:real], tables[:real], bucket, max_blocks)
            for key in ("ids", "pos"):
                static[key].copy_(new[key])
            for name in ("slot_mapping", "decode_block_tables", "decode_seq_lens"):
                getattr(static["meta"], name).copy_(getattr(new["meta"], name))
            eager = model(new["ids"], new["pos"], layers, new["meta"]).clone()
            graph.replay()
            assert torch.equal(graph_out, eager), f"bucket {bucket}, step {step}"
            tokens = model.compute_logits(eager[:real]).argmax(-1).tolist()
            for s, t in zip(seqs, tokens):
                s.append(t)


def _decode_inputs(seqs, tables, bucket, max_blocks):
    """One decode token per sequence, padded to the bucket, on the device."""
    meta = AttentionMetadata.build([(len(s) - 1, t) for s, t in zip(seqs, tables)], [], BLOCK)
    pad = bucket - len(seqs)
    table = torch.zeros((bucket, max_blocks), dtype=torch.long)
    table[:len(seqs), :meta.decode_block_tables.shape[1]] = meta.decode_block_tables
    meta = AttentionMetadata(
        slot_mapping=torch.cat((meta.slot_mapping, torch.full((pad,), -1))),
        num_decodes=bucket, decode_block_tables=table,
        decode_seq_lens=torch.cat((meta.decode_seq_lens, torch.zeros(pad, dtype=torch.long))),
        prefills=[], decode_groups=[]).to(DEVICE)
    ids = torch.tensor([s[-1] for s in seqs] + [0] * pad, device=DEVICE)
    pos = torch.tensor([len(s) - 1 for s in seqs] + [0] * pad, device=DEVICE)
    return {"ids": ids, "pos": pos, "meta": meta}
