"""Model configuration read from a HuggingFace checkpoint directory or a GGUF file."""
from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from common.models.gguf import GGUFCheckpoint, find_gguf

# HF architecture name -> (qkv bias, q/k norm)
ARCHITECTURES = {
    "LlamaForCausalLM": (False, False),
    "MistralForCausalLM": (False, False),
    "Qwen2ForCausalLM": (True, False),
    "Qwen3ForCausalLM": (False, True),
}


@dataclass(frozen=True)
class ModelConfig:
    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    qkv_bias: bool
    qk_norm: bool
    rope_scaling: dict | None = None
    rope_freq_factors: tuple[float, ...] = ()  # GGUF: each rope frequency is divided by its own
    eos_token_ids: tuple[int, ...] = ()
    fingerprint: str = ""
    extra: dict = field(default_factory=dict, compare=False, repr=False)

    def __post_init__(self):
        assert self.num_heads % self.num_kv_heads == 0, (
            f"num_attention_heads {self.num_heads} is not a multiple of "
            f"num_key_value_heads {self.num_kv_heads}")

    @classmethod
    def from_pretrained(cls, model_dir: str | Path) -> ModelConfig:
        """From a HF checkpoint directory, a .gguf file, or a directory holding one."""
        gguf_file = find_gguf(model_dir)
        if gguf_file is not None:
            return cls.from_gguf(GGUFCheckpoint(gguf_file))
        model_dir = Path(model_dir)
        path = model_dir / "config.json"
        if not path.is_file():
            raise FileNotFoundError(f"{model_dir} is not a model: no config.json or .gguf file")
        raw = path.read_bytes()
        cfg = json.loads(raw)
        return cls.from_dict(cfg, _eos_ids(model_dir, cfg), _fingerprint(model_dir, raw))

    @classmethod
    def from_gguf(cls, checkpoint: GGUFCheckpoint) -> ModelConfig:
        return cls.from_dict(checkpoint.config, checkpoint.eos_token_ids(),
                             checkpoint.fingerprint())

    @classmethod
    def from_dict(cls, cfg: dict[str, Any], eos_token_ids: tuple[int, ...],
                  fingerprint: str) -> ModelConfig:
        """From config.json's keys (a GGUF's config is spelled the same)."""
        archs = cfg.get("architectures") or []
        arch = next((a for a in archs if a in ARCHITECTURES), None)
        if arch is None:
            raise ValueError(f"unsupported architectures {archs}; known: {sorted(ARCHITECTURES)}")
        qkv_bias, qk_norm = ARCHITECTURES[arch]
        qkv_bias = bool(cfg.get("attention_bias", qkv_bias))
        num_heads = cfg["num_attention_heads"]
        rope: dict[str, Any] = dict(cfg.get("rope_parameters") or {})
        rope_scaling = cfg.get("rope_scaling") or None
        if rope_scaling is None and rope.get("rope_type", "default") != "default":
            rope_scaling = rope
        if rope_scaling is not None and rope_scaling.get("rope_type",
                                                         rope_scaling.get("type")) == "default":
            rope_scaling = None
        rope_theta = cfg.get("rope_theta", rope.get("rope_theta", 10000.0))
        return cls(
            architecture=arch,
            vocab_size=cfg["vocab_size"],
            hidden_size=cfg["hidden_size"],
            intermediate_size=cfg["intermediate_size"],
            num_layers=cfg["num_hidden_layers"],
            num_heads=num_heads,
            num_kv_heads=cfg.get("num_key_value_heads") or num_heads,
            head_dim=cfg.get("head_dim") or cfg["hidden_size"] // num_heads,
            rms_norm_eps=cfg.get("rms_norm_eps", 1e-6),
            rope_theta=float(rope_theta),
            max_position_embeddings=_max_positions(arch, cfg),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            qkv_bias=qkv_bias,
            qk_norm=qk_norm,
            rope_scaling=rope_scaling,
            rope_freq_factors=tuple(cfg.get("rope_freq_factors") or ()),
            eos_token_ids=eos_token_ids,
            fingerprint=fingerprint,
        )


def _max_positions(arch: str, cfg: dict) -> int:
    """Sliding-window attention is not implemented: cap the length where it would start."""
    limit = cfg.get("max_position_embeddings", 4096)
    window = cfg.get("sliding_window")
    sliding = cfg.get("use_sliding_window", arch == "MistralForCausalLM")
    return min(limit, window) if sliding and window else limit


def _eos_ids(model_dir: Path, cfg: dict) -> tuple[int, ...]:
    eos = cfg.get("eos_token_id")
    gen = model_dir / "generation_config.json"
    if gen.is_file():
        eos = json.loads(gen.read_text()).get("eos_token_id", eos)
    if eos is None:
        return ()
    return tuple(eos) if isinstance(eos, list) else (int(eos),)


def _fingerprint(model_dir: Path, config_bytes: bytes) -> str:
    """Identifies the weights: config plus the name and size of every weight file."""
    h = hashlib.sha256(config_bytes)
    for f in sorted(model_dir.glob("*.safetensors")):
        h.update(f.name.encode())
        h.update(str(f.stat().st_size).encode())
    return h.hexdigest()[:16]
