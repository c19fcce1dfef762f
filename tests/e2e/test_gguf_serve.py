"""A GGUF file given as --model to `pdserve up`: every service reads it (the gateway converts
its tokenizer, the workers dequantize it), and the greedy tokens equal transformers' on the
checkpoint it was written from."""
import gguf
import httpx
import pytest
import torch
import transformers

from tests.e2e.conftest import Stack
from tests.gguf_writer import write_gguf

MAX_TOKENS = 12


@pytest.fixture(scope="module")
def gguf_stack(tiny_llama, tmp_path_factory):
    path = tmp_path_factory.mktemp("gguf") / "tiny-llama.F32.gguf"
    write_gguf(tiny_llama, path, gguf.GGMLQuantizationType.F32)  # the same weights, exactly
    s = Stack(path, tmp_path_factory.mktemp("stack"), "--num-kv-blocks", "64")
    yield s
    s.stop()


def test_a_gguf_file_serves_transformers_greedy_tokens(gguf_stack, tiny_llama):
    hf = transformers.AutoModelForCausalLM.from_pretrained(tiny_llama, dtype=torch.float32)
    tokenizer = transformers.AutoTokenizer.from_pretrained(tiny_llama)
    messages = [{"role": "user", "content": "The server in the basement woke up."}]
    prompt = tokenizer.apply_chat_template(messages, add_generation_prompt=True,
                                           return_dict=True)["input_ids"]
    with httpx.Client(base_url=gguf_stack.url, timeout=120) as c:
        model = c.get("/v1/models").json()["data"][0]["id"]
        assert model.endswith("tiny-llama.F32.gguf")
        out = c.post("/v1/chat/completions", json={
            "model": model, "messages": messages, "max_tokens": MAX_TOKENS, "temperature": 0,
            "ignore_eos": True, "return_token_ids": True}).json()
    assert out["prompt_token_ids"] == prompt  # tokenizer and template from the file
    with torch.no_grad():
        ref = hf.generate(torch.tensor([prompt]), max_new_tokens=MAX_TOKENS,
                          min_new_tokens=MAX_TOKENS, do_sample=False)[0, len(prompt):].tolist()
    assert out["choices"][0]["token_ids"] == ref
