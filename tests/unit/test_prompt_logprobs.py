"""Prompt logprobs as the worker computes them (common/worker/prompt_logprobs.py through the
ModelRunner) equal HuggingFace's log_softmax of its logits on the same weights: whole prompts
and chunked ones, beside decodes and other prefills in one batch, sliced into few rows."""
import pytest
import torch
import transformers

from common.kv_cache import PagedKVCache
from common.kv_layout import KVLayout
from common.models.attention import create_attention_backend
from common.models.llama import load_model
from common.sampling_params import SamplingParams
from common.worker import prompt_logprobs as module
from common.worker.model_runner import ModelRunner, RequestState
from common.worker.sampler import Sampler

BLOCK = 16
ATOL = 1e-3  # as test_model_vs_hf.py: fp32 logits of magnitude ~10-30 differ by ~1e-4


def _hf(model_dir):
    return transformers.AutoModelForCausalLM.from_pretrained(
        model_dir, dtype=torch.float32, attn_implementation="eager").eval()


def _runner(model_dir):
    model = load_model(model_dir, create_attention_backend("cpu"))
    c = model.config
    cache = PagedKVCache(KVLayout(c.num_layers, c.num_kv_heads, c.head_dim, BLOCK, "float32"), 64)
    return ModelRunner(model, cache, Sampler(c.vocab_size)), c.vocab_size


def _request(rid, prompt, blocks, prompt_logprobs, output=()):
    return RequestState(rid, list(prompt) + list(output), len(prompt), 0, blocks,
                        SamplingParams(max_tokens=4, prompt_logprobs=prompt_logprobs), [])


def _reference(hf, prompt):
    with torch.no_grad():
        logits = hf(torch.tensor([prompt])).logits[0, :-1]  # position i predicts token i + 1
    return torch.log_softmax(logits, dim=-1)  # [len - 1, vocab]


def _check(scored, ref, prompt, k):
    """scored: TokenLogprobs of prompt tokens 1.. in order."""
    assert len(scored) == len(prompt) - 1
    targets = torch.tensor(prompt[1:])
    got = torch.tensor([s.logprob for s in scored])
    want = ref[torch.arange(len(targets)), targets]
    torch.testing.assert_close(got, want, rtol=0, atol=ATOL)
    ranks = (ref > want.unsqueeze(1)).sum(dim=1) + 1
    near = (ref - want.unsqueeze(1)).abs() < 2 * ATOL  # a near tie may rank either way
    for s, rank, n in zip(scored, ranks.tolist(), near.sum(dim=1).tolist()):
        assert rank <= s.rank <= rank + n - 1
    for s, row in zip(scored, ref):
        assert len(s.top) == k
        values, ids = row.topk(k)
        torch.testing.assert_close(torch.tensor([t.logprob for t in s.top]), values,
                                   rtol=0, atol=ATOL)
        assert {t.token_id for t in s.top} <= set(row.topk(k + 2).indices.tolist())


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3"])
def test_whole_prompt_matches_hf(tiny_models, arch):
    hf = _hf(tiny_models[arch])
    runner, vocab = _runner(tiny_models[arch])
    prompt = torch.randint(0, vocab, (29,), generator=torch.Generator().manual_seed(4)).tolist()
    req = _request("a", prompt, [3, 9], prompt_logprobs=5)
    sampled, stats = runner.execute([(req, len(prompt))])
    (scored,) = stats.prompt_logprobs
    assert (scored.request_id, scored.start) == ("a", 1)
    _check(scored.logprobs, _reference(hf, prompt), prompt, 5)
    assert len(sampled) == 1  # the first token is sampled as always


def test_chunks_beside_other_requests_score_each_token_once(tiny_models, monkeypatch):
    """a: three chunks (16, 16, 5) of a 37-token prompt, the second beside b's whole prompt and
    c's decode, in batches where its rows sit after others'; rows sliced 7 at a time."""
    monkeypatch.setattr(module, "ROWS_PER_SLICE", 7)
    hf = _hf(tiny_models["llama"])
    runner, vocab = _runner(tiny_models["llama"])
    g = torch.Generator().manual_seed(5)
    pa, pb, pc = (torch.randint(0, vocab, (n,), generator=g).tolist() for n in (37, 12, 6))
    a = _request("a", pa, [0, 1, 2], prompt_logprobs=2)
    b = _request("b", pb, [3], prompt_logprobs=0)
    c = _request("c", pc, [4], prompt_logprobs=-1)

    _, first = runner.execute([(c, 6), (a, 16)])
    assert [(p.request_id, p.start, len(p.logprobs)) for p in first.prompt_logprobs] == [
        ("a", 1, 16)]  # c asked for none
    _, second = runner.execute([(c, 1), (b, 12), (a, 16)])  # c decodes: its rows come first
    assert [(p.request_id, p.start, len(p.logprobs)) for p in second.prompt_logprobs] == [
        ("b", 1, 11), ("a", 17, 16)]
    _, last = runner.execute([(a, 5)])
    assert [(p.request_id, p.start, len(p.logprobs)) for p in last.prompt_logprobs] == [
        ("a", 33, 4)]  # its last position predicts the first output token, not a prompt token

    a_scored = [lp for s in (first, second, last) for p in s.prompt_logprobs
                if p.request_id == "a" for lp in p.logprobs]
    _check(a_scored, _reference(hf, pa), pa, 2)
    _check(second.prompt_logprobs[0].logprobs, _reference(hf, pb), pb, 0)


def test_a_recomputed_prompt_and_a_one_token_chunk_score_nothing(tiny_models):
    runner, vocab = _runner(tiny_models["llama"])
    prompt = list(range(10, 30))
    # recomputed after a preemption: its prompt logprobs went out with its first token
    resumed = _request("r", prompt, [0, 1], prompt_logprobs=3, output=[5, 6])
    _, stats = runner.execute([(resumed, 22)])
    assert stats.prompt_logprobs == []
    fresh = _request("f", prompt, [2, 3], prompt_logprobs=3)
    _, stats = runner.execute([(fresh, 19)])
    assert [p.start for p in stats.prompt_logprobs] == [1]
    _, stats = runner.execute([(fresh, 1)])  # the last position: it scores the next token only
    assert stats.prompt_logprobs == []
