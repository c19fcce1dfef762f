"""Sampling defaults a checkpoint recommends in its generation_config.json, as vLLM applies them
(`--generation-config`): each one fills a field that a request leaves out; a field the request
sets is its own. max_new_tokens becomes the default max_tokens (still capped by the room left in
the context).
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, fields
from pathlib import Path

GENERATION_CONFIG = "generation_config.json"


@dataclass(frozen=True)
class SamplingDefaults:
    """Fields named as in generation_config.json; None: the API's own default. Values are in
    the ranges a request may ask for."""

    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    max_new_tokens: int | None = None  # the default max_tokens

    def __post_init__(self) -> None:
        checks = {
            "temperature": (float, lambda v: v >= 0, ">= 0"),
            "top_p": (float, lambda v: 0 < v <= 1, "in (0, 1]"),
            "top_k": (int, lambda v: v >= -1, ">= -1"),
            "min_p": (float, lambda v: 0 <= v <= 1, "in [0, 1]"),
            "repetition_penalty": (float, lambda v: v > 0, "> 0"),
            "max_new_tokens": (int, lambda v: v >= 1, ">= 1"),
        }
        for name, (kind, ok, bound) in checks.items():
            value = getattr(self, name)
            if value is None:
                continue
            numeric = isinstance(value, int | float) and not isinstance(value, bool)
            if not numeric or (kind is int and not isinstance(value, int)) or not ok(value):
                raise ValueError(f"{name} must be {'an integer' if kind is int else 'a number'} "
                                 f"{bound}, not {value!r}")

    def given(self) -> dict[str, float]:
        """The defaults that are set, by field name."""
        return {k: v for k, v in asdict(self).items() if v is not None}


def load_sampling_defaults(source: str, model: str) -> SamplingDefaults:
    """`source`: "auto" (the model directory's generation_config.json, if it has one), "vllm"
    (none), or a directory that must hold a generation_config.json. ValueError names the file
    and the key of a value out of range."""
    if source == "vllm":
        return SamplingDefaults()
    if source == "auto":
        path = Path(model) / GENERATION_CONFIG
        if not path.is_file():  # a GGUF file, or a checkpoint without one
            return SamplingDefaults()
    else:
        path = Path(source) / GENERATION_CONFIG
        if not path.is_file():
            raise ValueError(f"--generation-config must be auto, vllm or a directory holding "
                             f"{GENERATION_CONFIG}; {path} does not exist")
    config = json.loads(path.read_text(encoding="utf-8"))
    if not isinstance(config, dict):
        raise ValueError(f"{path}: not a JSON object")
    values = {f.name: config[f.name] for f in fields(SamplingDefaults)
              if config.get(f.name) is not None}
    try:
        return SamplingDefaults(**values)
    except ValueError as err:
        raise ValueError(f"{path}: {err}") from None
