"""The token ids a client may send (prompt ids, logit_bias keys, /detokenize) are the model's
embedding rows, whether they outnumber the tokenizer's tokens (a vocabulary padded for the
kernels, as Qwen's 151936 rows for 151669 tokens) or fall short of them."""
import json
import shutil

import pytest

from services.gateway.errors import GatewayError
from services.gateway.tokenizer import Tokenizer


def _model_dir(tiny_llama, tmp_path, vocab_size):
    """tiny-llama's tokenizer (2048 tokens) beside a config.json with `vocab_size` rows (None:
    a config that does not say)."""
    for name in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        shutil.copy(tiny_llama / name, tmp_path / name)
    config = json.loads((tiny_llama / "config.json").read_text())
    if vocab_size is None:
        del config["vocab_size"]
    else:
        config["vocab_size"] = vocab_size
    (tmp_path / "config.json").write_text(json.dumps(config))
    return tmp_path


def _refused(tok, ids):
    with pytest.raises(GatewayError) as err:
        tok.check_token_ids(ids, "prompt")
    assert err.value.status == 400 and str(ids[-1]) in str(err.value)
    return err.value


@pytest.mark.parametrize("rows, accepted, refused", [
    (2100, [0, 2047, 2048, 2099], [2100]),  # padded rows past the tokenizer's 2048 tokens
    (2000, [0, 1999], [2000, 2047]),        # tokens the embedding has no row for
    (None, [0, 2047], [2048]),              # the tokenizer's size where the model does not say
])
def test_token_ids_are_bounded_by_the_embedding_rows(tiny_llama, tmp_path, rows, accepted,
                                                     refused):
    tok = Tokenizer(_model_dir(tiny_llama, tmp_path, rows))
    assert len(tok.hf) == 2048 and tok.vocab_size == (rows or 2048)
    tok.check_token_ids(accepted, "prompt")
    for token_id in refused:
        _refused(tok, [*accepted, token_id])
    _refused(tok, [-1])


def test_a_padded_row_has_no_text(tiny_llama, tmp_path):
    tok = Tokenizer(_model_dir(tiny_llama, tmp_path, 2100))
    ids = tok.encode_batch(["Hello world"])[0]
    assert tok.decode([*ids[:1], 2050, *ids[1:]]) == tok.decode(ids)
    assert tok.token_text(2050) == ""
