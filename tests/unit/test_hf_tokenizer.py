"""common/models/hf_tokenizer.py's auto_tokenizer gives AutoTokenizer the model type without
loading the model's config; the tokenizer it returns must be the one plain AutoTokenizer
returns, class and behaviour, for every tokenizer class a checkpoint may declare."""
import json
import shutil

import pytest
from transformers import AutoTokenizer

from common.models.hf_tokenizer import auto_tokenizer

TEXT = "Hello, wörld!  <|im_start|>user\n 12345 tabs\tand   spaces <|end_of_text|>"
CHAT = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi there"}]


def _same(a, b) -> None:
    assert type(a) is type(b)
    assert a.get_vocab() == b.get_vocab()
    assert a.all_special_ids == b.all_special_ids and a.eos_token_id == b.eos_token_id
    assert sorted(a.added_tokens_decoder) == sorted(b.added_tokens_decoder)
    ids = a(TEXT)["input_ids"]
    assert ids == b(TEXT)["input_ids"]
    assert a.decode(ids) == b.decode(ids)
    assert a.convert_ids_to_tokens(ids) == b.convert_ids_to_tokens(ids)
    assert a.apply_chat_template(CHAT, tokenize=False, add_generation_prompt=True) == \
        b.apply_chat_template(CHAT, tokenize=False, add_generation_prompt=True)


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3"])
@pytest.mark.parametrize("declared", [None, "PreTrainedTokenizerFast", "TokenizersBackend",
                                      "LlamaTokenizerFast", "Qwen2Tokenizer", "GPT2Tokenizer"])
def test_it_is_the_tokenizer_auto_tokenizer_loads(tiny_models, tmp_path, arch, declared):
    model_dir = tmp_path / arch
    shutil.copytree(tiny_models[arch], model_dir)
    config_file = model_dir / "tokenizer_config.json"
    config = json.loads(config_file.read_text())
    if declared is None:
        config.pop("tokenizer_class")
    else:
        config["tokenizer_class"] = declared
    config_file.write_text(json.dumps(config))
    _same(auto_tokenizer(model_dir), AutoTokenizer.from_pretrained(str(model_dir)))
