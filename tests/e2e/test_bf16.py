"""End to end in bfloat16: both workers serve the tiny model in bf16 (weights and KV cache), the
cpu attention kernels reading the bf16 cache. Two bf16 implementations round differently (on
this model HuggingFace's own bf16 and float32 logprobs differ by up to ~0.35), so greedy
continuations may part after a near tie: the first token must be HuggingFace's, or one of the
tokens whose HuggingFace logprob is within that noise of its best (bf16 logits are coarse: on an
AMX CPU three candidates 0.25 and 0.625 apart in HuggingFace's came out equal here), and every
token's logprob must be close to HuggingFace's bf16 logprob of the same token."""
import httpx
import pytest
import torch
import transformers

from tests.e2e.conftest import Stack

# bf16 keeps 8 bits of mantissa; logits of magnitude ~10-30 through four layers
LOGPROB_ATOL = 0.75
PROMPT_LENGTHS = [1, 16, 40, 123]


@pytest.fixture(scope="module")
def stack(tiny_llama, tmp_path_factory):
    bf16 = "--dtype bfloat16"
    s = Stack(tiny_llama, tmp_path_factory.mktemp("bf16"), "--prefill-worker-args", bf16,
              "--decode-worker-args", bf16)
    yield s
    s.stop()


@pytest.fixture(scope="module")
def hf(tiny_llama):
    return transformers.AutoModelForCausalLM.from_pretrained(
        tiny_llama, dtype=torch.bfloat16).eval()


def _prompt(n: int, seed: int) -> list[int]:
    return torch.randint(0, 2000, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def test_bf16_first_tokens_equal_and_logprobs_close(stack, hf):
    with httpx.Client(base_url=stack.url, timeout=120) as client:
        name = client.get("/v1/models").json()["data"][0]["id"]
        for n in PROMPT_LENGTHS:
            prompt = _prompt(n, 300 + n)
            r = client.post("/v1/completions", json={
                "model": name, "prompt": prompt, "max_tokens": 8, "temperature": 0,
                "ignore_eos": True, "return_token_ids": True, "logprobs": 0})
            assert r.status_code == 200, r.text
            choice = r.json()["choices"][0]
            ids = choice["token_ids"]
            with torch.no_grad():
                logits = hf(torch.tensor([prompt + ids])).logits[0, len(prompt) - 1:-1].float()
            ref = torch.log_softmax(logits, dim=-1)
            near = (ref[0] >= ref[0].max() - LOGPROB_ATOL).nonzero().flatten().tolist()
            assert ids[0] in near, f"first token of the {n}-token prompt: {ids[0]} not in {near}"
            got = torch.tensor(choice["logprobs"]["token_logprobs"])
            torch.testing.assert_close(got, ref[torch.arange(len(ids)), torch.tensor(ids)],
                                       rtol=0, atol=LOGPROB_ATOL)
    stats = stack.wait_idle()
    assert all(w["num_free_blocks"] == w["num_blocks"] for w in stats["workers"])
