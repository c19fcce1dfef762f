"""The model's HuggingFace tokenizer, as the gateway (text) and the workers (grammars) load it."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from transformers import AutoTokenizer, PreTrainedConfig

from common.models.gguf import find_gguf, tokenizer_from_metadata


def load_hf_tokenizer(model_dir: str | Path) -> Any:
    """A GGUF model's tokenizer is tokenizer.json + tokenizer_config.json beside the file when
    they are there (`pdserve fetch-model` writes them, converted once from the same file), else
    the one its metadata describes, converted by transformers."""
    model_dir = Path(model_dir)
    gguf_file = find_gguf(model_dir)
    if gguf_file is None:
        return auto_tokenizer(model_dir)
    if not tokenizer_from_metadata(gguf_file):
        return AutoTokenizer.from_pretrained(str(gguf_file.parent))
    return AutoTokenizer.from_pretrained(str(gguf_file.parent), gguf_file=gguf_file.name)


def auto_tokenizer(model_dir: Path) -> Any:
    """AutoTokenizer.from_pretrained(model_dir), told the model type up front where
    tokenizer_config.json names the tokenizer class: its choice then rests on the class and the
    model type alone, and the AutoConfig it would load for the type imports the model's
    modeling code (torch._dynamo, torch.distributed.tensor: ~2.3 s of every process that
    starts, for one string of config.json)."""
    try:
        model_type = json.loads((model_dir / "config.json").read_text()).get("model_type")
        declared = json.loads((model_dir / "tokenizer_config.json").read_text()).get(
            "tokenizer_class")
    except (OSError, ValueError, AttributeError):
        model_type = declared = None
    if not model_type or not declared:
        return AutoTokenizer.from_pretrained(str(model_dir))
    # a config class of that model type, as AutoConfig's would be, with nothing else in it
    typed = type(f"{model_type}Type", (PreTrainedConfig,), {"model_type": model_type})
    return AutoTokenizer.from_pretrained(str(model_dir), config=typed())
