"""A gateway process keeps torch out (common/torch_free.py): it loads its tokenizer, encodes and
renders chats without importing it, imports it at the first guided request (xgrammar needs it),
and keeps it where its model is a GGUF file whose tokenizer transformers converts from the
file's metadata with torch. Each case in a fresh Python process (this one imported torch)."""
import json
import shutil
import subprocess
import sys
from pathlib import Path

import gguf
import pytest

from services.gateway.tokenizer import Tokenizer
from tests.gguf_writer import write_gguf

ROOT = Path(__file__).resolve().parents[2]
CHAT = [{"role": "user", "content": "What is a KV cache?"}]
CHILD = """
import json, sys
from common import torch_free
torch_free.keep_out(sys.argv[1])
from services.gateway.tokenizer import Tokenizer
tok = Tokenizer(sys.argv[1])
out = {"torch_kept_out": "torch" in sys.modules and sys.modules["torch"] is None,
       "ids": tok.encode_batch(["Hello world! 1234 blocks."])[0],
       "chat": tok.render_chat(json.loads(sys.argv[2]))}
from services.gateway.structured_outputs import _grammar
out["grammar"] = _grammar("regex", "a+b", True)
out["torch_after"] = getattr(sys.modules.get("torch"), "__name__", None)
print(json.dumps(out))
"""


def _gateway_process(model: Path) -> dict:
    r = subprocess.run([sys.executable, "-c", CHILD, str(model), json.dumps(CHAT)], cwd=ROOT,
                       capture_output=True, text=True, timeout=180)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "PyTorch was not found" not in r.stderr  # transformers' notice is filtered out
    return json.loads(r.stdout.splitlines()[-1])


def _same_tokens(out: dict, model: Path) -> None:
    ref = Tokenizer(model)
    assert out["ids"] == ref.encode_batch(["Hello world! 1234 blocks."])[0]
    assert out["chat"] == ref.render_chat(CHAT)
    assert out["grammar"].startswith("root ::=")
    assert out["torch_after"] == "torch"  # imported for xgrammar, at the first grammar


def test_a_gateway_tokenizes_without_torch_and_imports_it_for_a_grammar(tiny_llama):
    out = _gateway_process(tiny_llama)
    assert out["torch_kept_out"]
    _same_tokens(out, tiny_llama)


@pytest.fixture(scope="module")
def tiny_gguf(tiny_llama, tmp_path_factory):
    path = tmp_path_factory.mktemp("gguf") / "tiny.gguf"
    write_gguf(tiny_llama, path, gguf.GGMLQuantizationType.F32)
    return path


def test_a_gguf_whose_tokenizer_is_converted_keeps_torch(tiny_gguf):
    out = _gateway_process(tiny_gguf)
    assert not out["torch_kept_out"]
    _same_tokens(out, tiny_gguf)


def test_a_gguf_with_tokenizer_files_beside_it_goes_without(tiny_gguf, tiny_llama, tmp_path):
    path = tmp_path / "tiny.gguf"
    shutil.copy(tiny_gguf, path)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(tiny_llama / name, tmp_path / name)
    out = _gateway_process(path)
    assert out["torch_kept_out"]
    _same_tokens(out, path)
