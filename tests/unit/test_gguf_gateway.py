"""The gateway serves a GGUF model: its tokenizer, chat template, eos ids and context length
come from the file (or from tokenizer files written beside it) and equal the checkpoint's."""
import shutil

import gguf
import pytest

from services.gateway.config import GatewayConfig
from services.gateway.tokenizer import Tokenizer
from tests.gguf_writer import write_gguf

TEXTS = ["Hello world! The cache holds 1234 blocks.", "naïve café, 日本語 and emoji 🙂",
         "  two spaces,\ttabs\nand lines\n\n<|im_start|>user not special here"]
CHAT = [{"role": "system", "content": "Answer briefly."},
        {"role": "user", "content": "What is a KV cache?"},
        {"role": "assistant", "content": "Memory of past keys and values."},
        {"role": "user", "content": "And a block?"}]


@pytest.fixture(scope="module")
def tiny_gguf(tiny_llama, tmp_path_factory):
    path = tmp_path_factory.mktemp("gguf") / "tiny.gguf"
    write_gguf(tiny_llama, path, gguf.GGMLQuantizationType.Q8_0)
    return path


def _same_tokenizer(ours: Tokenizer, ref: Tokenizer) -> None:
    assert ours.encode_batch(TEXTS) == ref.encode_batch(TEXTS)
    assert ours.render_chat(CHAT) == ref.render_chat(CHAT)
    ids = ref.encode_batch([ref.render_chat(CHAT)], add_special_tokens=False)[0]
    assert ours.decode(ids, skip_special_tokens=False) == ref.decode(ids, skip_special_tokens=False)
    assert ours.eos_token_ids == ref.eos_token_ids
    assert ours.vocab_size == ref.vocab_size


def test_tokenizer_from_the_gguf_metadata(tiny_gguf, tiny_llama):
    _same_tokenizer(Tokenizer(tiny_gguf), Tokenizer(tiny_llama))


def test_tokenizer_files_beside_the_gguf_are_used(tiny_gguf, tiny_llama, tmp_path):
    """What `pdserve fetch-model` writes: the converted tokenizer next to the file."""
    shutil.copy(tiny_gguf, tmp_path / "tiny.gguf")
    Tokenizer(tiny_gguf).hf.save_pretrained(tmp_path)
    _same_tokenizer(Tokenizer(tmp_path), Tokenizer(tiny_llama))
    # they, not the file's metadata, are what the gateway reads
    (tmp_path / "chat_template.jinja").write_text("beside{{ messages[0]['content'] }}")
    assert Tokenizer(tmp_path).render_chat(CHAT) == "besideAnswer briefly."


def test_gateway_config_reads_the_context_length(tiny_gguf, tiny_llama):
    assert GatewayConfig(model=str(tiny_gguf)).max_model_len == \
        GatewayConfig(model=str(tiny_llama)).max_model_len == 4096
    with pytest.raises(ValueError, match="neither a directory nor a .gguf file"):
        GatewayConfig(model=str(tiny_llama / "model.safetensors"))
