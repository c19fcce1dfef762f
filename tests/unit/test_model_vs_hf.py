"""The model over the paged KV cache computes HuggingFace's logits on the same weights."""
import pytest
import torch
import transformers

from common.kv_layout import KVLayout
from common.kv_cache import PagedKVCache
from common.models.attention import AttentionMetadata, create_attention_backend
from common.models.llama import load_model

BLOCK = 16
NUM_BLOCKS = 64
# fp32, logits of magnitude ~10-30: summation order alone moves them by ~1e-4
TOL = dict(rtol=1e-4, atol=1e-3)


def _hf(model_dir):
    return transformers.AutoModelForCausalLM.from_pretrained(
        model_dir, dtype=torch.float32, attn_implementation="eager").eval()


# the readable reference, and the compiled kernels that serve by default on CPU
BACKENDS = ["torch", "cpu"]


def _ours(model_dir, backend):
    model = load_model(model_dir, create_attention_backend(backend))
    c = model.config
    cache = PagedKVCache(KVLayout(c.num_layers, c.num_kv_heads, c.head_dim, BLOCK, "float32"),
                         NUM_BLOCKS)
    return model, cache


def _hf_logits(hf, ids):
    with torch.no_grad():
        return hf(torch.tensor([ids])).logits[0]  # [len, vocab]


def _forward(model, cache, prefills=(), decodes=()):
    """The hidden states of one step. prefills: (token_ids, num_cached, block_ids); decodes:
    (token_id, num_cached, block_ids)."""
    ids, pos = [], []
    for tok, n, _ in decodes:
        ids.append(tok)
        pos.append(n)
    for toks, n, _ in prefills:
        ids += toks
        pos += range(n, n + len(toks))
    meta = AttentionMetadata.build([(n, b) for _, n, b in decodes],
                                   [(n, len(t), b) for t, n, b in prefills], BLOCK)
    return model(torch.tensor(ids), torch.tensor(pos), cache.layers, meta)


def _run(model, cache, prefills=(), decodes=()):
    """The logits of one step (_forward's arguments)."""
    return model.compute_logits(_forward(model, cache, prefills, decodes))


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3"])
def test_prefill_then_decode_match_hf(tiny_models, arch, backend):
    hf = _hf(tiny_models[arch])
    model, cache = _ours(tiny_models[arch], backend)
    g = torch.Generator().manual_seed(1)
    prompt = torch.randint(0, model.config.vocab_size, (37,), generator=g).tolist()
    blocks = [9, 3, 41, 7, 22, 15]  # scattered on purpose: paging, not contiguity
    logits = _run(model, cache, prefills=[(prompt, 0, blocks)])
    torch.testing.assert_close(logits, _hf_logits(hf, prompt), **TOL)

    seq = list(prompt)
    for _ in range(30):  # greedy, one token at a time through the paged cache
        seq.append(int(logits[-1].argmax()))
        logits = _run(model, cache, decodes=[(seq[-1], len(seq) - 1, blocks)])
        torch.testing.assert_close(logits[0], _hf_logits(hf, seq)[-1], **TOL)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_chunked_prefill_and_mixed_batch_match_hf(tiny_models, arch, backend):
    hf = _hf(tiny_models[arch])
    model, cache = _ours(tiny_models[arch], backend)
    g = torch.Generator().manual_seed(2)
    a = torch.randint(0, model.config.vocab_size, (40,), generator=g).tolist()
    b = torch.randint(0, model.config.vocab_size, (21,), generator=g).tolist()
    blocks_a, blocks_b = [5, 1, 30], [2, 8]
    # a: first chunk of 17 tokens alone, then its other 23 beside b's whole prompt
    _run(model, cache, prefills=[(a[:17], 0, blocks_a)])
    logits = _run(model, cache, prefills=[(a[17:], 17, blocks_a), (b, 0, blocks_b)])
    torch.testing.assert_close(logits[:23], _hf_logits(hf, a)[17:], **TOL)
    torch.testing.assert_close(logits[23:], _hf_logits(hf, b), **TOL)
    # then both decode in one batch while a third prompt prefills beside them
    c = torch.randint(0, model.config.vocab_size, (5,), generator=g).tolist()
    na, nb = a + [int(logits[22].argmax())], b + [int(logits[-1].argmax())]
    logits = _run(model, cache, decodes=[(na[-1], 40, blocks_a), (nb[-1], 21, blocks_b)],
                  prefills=[(c, 0, [11])])
    torch.testing.assert_close(logits[0], _hf_logits(hf, na)[-1], **TOL)
    torch.testing.assert_close(logits[1], _hf_logits(hf, nb)[-1], **TOL)
    torch.testing.assert_close(logits[2:], _hf_logits(hf, c), **TOL)


@pytest.mark.parametrize("backend", BACKENDS)
def test_decodes_of_very_different_lengths_match_hf(tiny_models, backend):
    """A batch whose contexts differ a lot (the torch backend splits it into groups; the cpu
    kernels split long rows into partitions); every row stays exact."""
    hf = _hf(tiny_models["llama"])
    model, cache = _ours(tiny_models["llama"], backend)
    g = torch.Generator().manual_seed(3)
    lens = [3, 70, 5, 130, 20]
    seqs, tables, nxt = [], [], 0
    for n in lens:
        seqs.append(torch.randint(0, model.config.vocab_size, (n,), generator=g).tolist())
        blocks = -(-(n + 1) // BLOCK)
        tables.append(list(range(nxt, nxt + blocks)))
        nxt += blocks
    _run(model, cache, prefills=[(s[:-1], 0, t) for s, t in zip(seqs, tables)])
    meta = AttentionMetadata.build([(len(s) - 1, t) for s, t in zip(seqs, tables)], [], BLOCK)
    assert len(meta.decode_groups) > 1
    logits = _run(model, cache, decodes=[(s[-1], len(s) - 1, t) for s, t in zip(seqs, tables)])
    for i, s in enumerate(seqs):
        torch.testing.assert_close(logits[i], _hf_logits(hf, s)[-1], **TOL)
