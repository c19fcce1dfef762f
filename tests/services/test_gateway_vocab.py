"""A prompt whose text encodes to a token the model has no embedding row for (a tokenizer with
an added token past config.json's vocab_size) is a 400 naming the id, in completions and chat,
with nothing sent to the scheduler; the same prompt without that token goes through, and what
/tokenize returns /detokenize takes back."""
from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from common.models.hf_tokenizer import load_hf_tokenizer
from services.gateway.tokenizer import Tokenizer
from tests.services.fake_scheduler import fake_gateway, http_client

pytestmark = pytest.mark.anyio

EXTRA = "<|no_row|>"


@pytest.fixture(scope="module")
def extra_token_dir(tiny_llama: Path, tmp_path_factory) -> str:
    """tiny-llama (2048 embedding rows) with a tokenizer of 2049 tokens."""
    out = tmp_path_factory.mktemp("extra_token")
    for name in ("config.json", "generation_config.json"):
        shutil.copy(tiny_llama / name, out / name)
    hf = load_hf_tokenizer(tiny_llama)
    assert hf.add_tokens([EXTRA]) == 1
    hf.save_pretrained(out)
    return str(out)


async def test_a_text_token_without_an_embedding_row_is_a_400(extra_token_dir: str) -> None:
    tokenizer = Tokenizer(extra_token_dir)
    assert len(tokenizer.hf) == 2049 and tokenizer.vocab_size == 2048
    assert tokenizer.encode_batch([f"a {EXTRA} b"], False)[0].count(2048) == 1
    async with fake_gateway(extra_token_dir, tokenizer) as gw:
        async with http_client(gw.url) as http:
            completion = await http.post("/v1/completions", json={
                "prompt": ["fine", f"a {EXTRA} b"], "max_tokens": 2})
            chat = await http.post("/v1/chat/completions", json={
                "messages": [{"role": "user", "content": f"a {EXTRA} b"}], "max_tokens": 2})
            assert gw.scheduler.requests == []
            fine = await http.post("/v1/completions", json={"prompt": "a b", "max_tokens": 2})
    for response, param in ((completion, "prompt"), (chat, "messages")):
        assert response.status_code == 400, response.text
        error = response.json()["error"]
        assert error["param"] == param and "2048" in error["message"], error
    assert fine.status_code == 200, fine.text


async def test_what_tokenize_returns_detokenize_takes_back(extra_token_dir: str) -> None:
    """/detokenize only decodes: the tokenizer's own ids are fine there, rows or not."""
    tokenizer = Tokenizer(extra_token_dir)
    async with fake_gateway(extra_token_dir, tokenizer) as gw:
        async with http_client(gw.url) as http:
            tokens = (await http.post("/tokenize", json={
                "prompt": f"a {EXTRA} b", "add_special_tokens": False})).json()["tokens"]
            back = await http.post("/detokenize", json={"tokens": tokens})
            past = await http.post("/detokenize", json={"tokens": [1, 2049]})
    assert 2048 in tokens
    assert back.status_code == 200 and back.json()["prompt"] == tokenizer.decode(
        tokens, skip_special_tokens=False) and EXTRA in back.json()["prompt"], back.text
    assert past.status_code == 400 and "2049" in past.json()["error"]["message"], past.text
