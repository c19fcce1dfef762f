from pathlib import Path

import pytest

from services.gateway.tokenizer import Tokenizer


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


@pytest.fixture(scope="module")
def model_dir(tiny_llama: Path) -> str:
    return str(tiny_llama)


@pytest.fixture(scope="module")
def tokenizer(model_dir: str) -> Tokenizer:
    return Tokenizer(model_dir)
