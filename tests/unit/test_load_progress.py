"""The progress bar over the weights while a model loads (tqdm, as vLLM's): shown on a
terminal, silent where stderr is not one (logs, `pdserve up`, compose), and off by flag."""
import argparse
import io
import re
import sys

import pytest
from safetensors import safe_open

from common.models.attention import create_attention_backend
from common.models.gguf import GGUFCheckpoint
from common.models.llama import load_model
from common.worker.config import add_arguments, config_from_args
from tests.gguf_writer import Q, write_gguf


class Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def stderr_of_load(monkeypatch, model, stream: io.StringIO, **kw) -> str:
    monkeypatch.setattr(sys, "stderr", stream)
    load_model(model, create_attention_backend("torch"), **kw)
    return stream.getvalue()


def num_safetensors(model_dir) -> int:
    total = 0
    for f in model_dir.glob("*.safetensors"):
        with safe_open(str(f), framework="pt") as checkpoint:
            total += len(checkpoint.keys())
    return total


def test_a_terminal_sees_every_tensor_load(monkeypatch, tiny_llama):
    out = stderr_of_load(monkeypatch, tiny_llama, Terminal())
    n = num_safetensors(tiny_llama)
    assert n > 10
    assert "Loading safetensors weights" in out
    assert re.search(rf"100%.*\b{n}/{n}\b", out), out[-300:]


def test_gguf_weights_count_what_the_model_reads(monkeypatch, tiny_llama, tmp_path):
    path = tmp_path / "model.gguf"
    write_gguf(tiny_llama, path, Q.Q8_0)
    n = GGUFCheckpoint(path).num_tensors()
    assert n == len(list(GGUFCheckpoint(path).tensors()))
    out = stderr_of_load(monkeypatch, path, Terminal())
    assert "Loading GGUF weights" in out and re.search(rf"100%.*\b{n}/{n}\b", out)


def test_silent_off_a_terminal_and_when_turned_off(monkeypatch, tiny_llama):
    assert stderr_of_load(monkeypatch, tiny_llama, io.StringIO()) == ""
    assert stderr_of_load(monkeypatch, tiny_llama, Terminal(), progress=False) == ""


@pytest.mark.parametrize(("argv", "env", "expected"), [
    ([], None, True),
    (["--no-use-tqdm-on-load"], None, False),
    ([], "0", False),
    (["--use-tqdm-on-load"], "0", True),
])
def test_worker_flag_and_env(monkeypatch, tiny_llama, argv, env, expected):
    if env is None:
        monkeypatch.delenv("PDSERVE_USE_TQDM_ON_LOAD", raising=False)
    else:
        monkeypatch.setenv("PDSERVE_USE_TQDM_ON_LOAD", env)
    p = argparse.ArgumentParser()
    add_arguments(p)
    args = p.parse_args(["--model", str(tiny_llama), "--dtype", "float32", *argv])
    assert config_from_args("decode", args).use_tqdm_on_load is expected
