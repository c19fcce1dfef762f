"""The model's HuggingFace tokenizer, as the gateway (text) and the workers (grammars) load it."""
from __future__ import annotations

from pathlib import Path
from typing import Any

from transformers import AutoTokenizer

from common.models.gguf import find_gguf


def load_hf_tokenizer(model_dir: str | Path) -> Any:
    """A GGUF model's tokenizer is tokenizer.json + tokenizer_config.json beside the file when
    they are there (`pdserve fetch-model` writes them, converted once from the same file), else
    the one its metadata describes, converted by transformers."""
    model_dir = Path(model_dir)
    gguf_file = find_gguf(model_dir)
    if gguf_file is None:
        return AutoTokenizer.from_pretrained(str(model_dir))
    beside = gguf_file.parent
    if (beside / "tokenizer.json").is_file() and (beside / "tokenizer_config.json").is_file():
        return AutoTokenizer.from_pretrained(str(beside))
    return AutoTokenizer.from_pretrained(str(beside), gguf_file=gguf_file.name)
