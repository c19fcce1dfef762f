"""GGUF checkpoints (llama.cpp's one-file format), read through the `gguf` package.

A GGUF file holds a model's config (`{arch}.*` keys), its tokenizer and chat template
(`tokenizer.*`) and its weights, most of them quantized in blocks. pdserve dequantizes every
weight to float32 when a worker loads it (the serving dtype is a cast from there), so a GGUF
serves exactly like the float checkpoint it decodes to:

    find_gguf(path)         the .gguf file a --model path names, or None
    gguf_info(file)         what the gateway needs: context length, vocab size, eos ids
    GGUFCheckpoint(file)    .config (config.json's keys), .tensors() under HF names

llama.cpp's converter reorders the rows of Llama's q and k projections, one head at a time, from
HF's rotate-halves rope layout to its own rotate-pairs one; `tensors()` undoes it exactly as
transformers does, so the weights equal transformers' own reading of the same file.
"""
from __future__ import annotations

import functools
import hashlib
import json
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import gguf
import numpy as np

Q = gguf.GGMLQuantizationType
# what a weight may be stored as: every type the gguf package dequantizes that the tests check
SUPPORTED_TYPES = (Q.F32, Q.F16, Q.BF16, Q.Q8_0, Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q5_1,
                   Q.Q2_K, Q.Q3_K, Q.Q4_K, Q.Q5_K, Q.Q6_K)

# GGUF architecture -> (HF architecture, q/k rows permuted by llama.cpp's converter)
ARCHITECTURES = {
    "llama": ("LlamaForCausalLM", True),  # Mistral's files say "llama" too
    "qwen2": ("Qwen2ForCausalLM", False),
    "qwen3": ("Qwen3ForCausalLM", False),
}
ROPE_FREQS = gguf.TENSOR_NAMES[gguf.MODEL_TENSOR.ROPE_FREQS] + ".weight"


class UnsupportedGGUFError(ValueError):
    """The file uses an architecture, a quantization type or a rope scaling pdserve cannot serve."""


def find_gguf(path: str | Path) -> Path | None:
    """The GGUF file `path` names: itself when it is a .gguf file, or the one .gguf in a
    directory without config.json (a HF checkpoint directory wins). None for anything else."""
    p = Path(path)
    if p.is_file():
        return p if p.suffix == ".gguf" else None
    if not p.is_dir() or (p / "config.json").exists():
        return None
    files = sorted(p.glob("*.gguf"))
    if len(files) > 1:
        raise ValueError(f"{p} holds several GGUF files ({', '.join(f.name for f in files)}); "
                         "pass the one to serve as --model")
    return files[0] if files else None


def tokenizer_from_metadata(path: str | Path) -> bool:
    """Whether the model at `path` is a GGUF file whose tokenizer transformers must convert from
    the file's metadata (it does so with torch): one without tokenizer.json and
    tokenizer_config.json beside it (`pdserve fetch-model` writes them)."""
    gguf_file = find_gguf(path)
    if gguf_file is None:
        return False
    beside = gguf_file.parent
    return not ((beside / "tokenizer.json").is_file() and
                (beside / "tokenizer_config.json").is_file())


@dataclass(frozen=True)
class GGUFInfo:
    context_length: int
    vocab_size: int
    eos_token_ids: tuple[int, ...]


@functools.lru_cache(maxsize=4)
def gguf_info(path: Path) -> GGUFInfo:
    """Read once per process: the gateway asks for its config and its tokenizer separately."""
    return GGUFCheckpoint(path).info


class GGUFCheckpoint:
    """One GGUF file, its metadata parsed once (the file itself stays memory-mapped).

    Invariant: construction fails with UnsupportedGGUFError, naming what is unsupported, before
    any weight is dequantized."""

    def __init__(self, path: str | Path):
        self.path = Path(path)
        self.reader = gguf.GGUFReader(self.path)
        arch = self.reader.get_field("general.architecture")
        self.arch = arch.contents() if arch is not None else ""  # the {arch} of the keys
        if self.arch not in ARCHITECTURES:
            raise UnsupportedGGUFError(f"{self.path}: architecture {self.arch!r} is not "
                                       f"supported; known: {', '.join(ARCHITECTURES)}")
        self._tensors = {t.name: t for t in self.reader.tensors}
        self.config = self._config()
        self._check_types()
        self.info = GGUFInfo(self.config["max_position_embeddings"], self.config["vocab_size"],
                             self.eos_token_ids())

    # -- metadata -------------------------------------------------------------------------------

    def _field(self, key: str, default: Any = None) -> Any:
        field = self.reader.get_field(key.format(arch=self.arch))
        return default if field is None else field.contents()

    def _int(self, key: str, default: int | None = None) -> int:
        value = self._field(key, default)
        if isinstance(value, list):  # some files give a per-layer value
            if len(set(value)) != 1:
                raise UnsupportedGGUFError(f"{self.path}: {key} differs between layers: {value}")
            value = value[0]
        if value is None:
            raise UnsupportedGGUFError(f"{self.path}: no {key.format(arch=self.arch)} in the "
                                       "GGUF metadata")
        return int(value)

    def _config(self) -> dict:
        """The config as config.json would spell it, plus `rope_freq_factors` where the file
        carries llama.cpp's per-frequency rope divisors (its form of Llama 3's rope scaling)."""
        hf_arch, _ = ARCHITECTURES[self.arch]
        heads = self._int("{arch}.attention.head_count")
        hidden = self._int("{arch}.embedding_length")
        tokens = self.reader.get_field("tokenizer.ggml.tokens")
        vocab = self._field("{arch}.vocab_size") or (len(tokens.data) if tokens else None)
        cfg: dict[str, Any] = {
            "architectures": [hf_arch],
            "model_type": self.arch,
            "vocab_size": int(vocab) if vocab else self._embedding_rows(),
            "hidden_size": hidden,
            "intermediate_size": self._int("{arch}.feed_forward_length"),
            "num_hidden_layers": self._int("{arch}.block_count"),
            "num_attention_heads": heads,
            "num_key_value_heads": self._int("{arch}.attention.head_count_kv", heads),
            "head_dim": self._int("{arch}.attention.key_length", hidden // heads),
            "rms_norm_eps": float(self._field("{arch}.attention.layer_norm_rms_epsilon", 1e-6)),
            "rope_theta": float(self._field("{arch}.rope.freq_base", 10000.0)),
            "max_position_embeddings": self._int("{arch}.context_length"),
            "tie_word_embeddings": "output.weight" not in self._tensors,
            "attention_bias": "blk.0.attn_q.bias" in self._tensors,
            "rope_scaling": self._rope_scaling(),
        }
        if ROPE_FREQS in self._tensors:
            factors = gguf.quants.dequantize(self._tensors[ROPE_FREQS].data,
                                             self._tensors[ROPE_FREQS].tensor_type)
            cfg["rope_freq_factors"] = [float(f) for f in factors.reshape(-1)]
        return cfg

    def _embedding_rows(self) -> int:
        return int(self._tensors["token_embd.weight"].shape[-1])  # ggml order: [hidden, vocab]

    def _rope_scaling(self) -> dict | None:
        kind = self._field("{arch}.rope.scaling.type", "none")
        factor = self._field("{arch}.rope.scaling.factor") or self._field(
            "{arch}.rope.scale_linear")  # older files say only this
        if kind == "none" and factor and factor != 1.0:
            kind = "linear"
        if kind == "none":
            return None
        if kind == "linear" and factor:
            return {"rope_type": "linear", "factor": float(factor)}
        raise UnsupportedGGUFError(f"{self.path}: rope scaling {kind!r} is not supported; "
                                   "known: none, linear (and Llama 3's rope_freqs)")

    def eos_token_ids(self) -> tuple[int, ...]:
        """Where generation ends: end of sequence, then end of turn and of message if given."""
        ids = (self._field(f"tokenizer.ggml.{k}_token_id") for k in ("eos", "eot", "eom"))
        return tuple(dict.fromkeys(int(i) for i in ids if i is not None))

    def fingerprint(self) -> str:
        """Identifies the weights: the config plus the file's name and size."""
        h = hashlib.sha256(json.dumps(self.config, sort_keys=True).encode())
        h.update(self.path.name.encode())
        h.update(str(self.path.stat().st_size).encode())
        return h.hexdigest()[:16]

    # -- weights --------------------------------------------------------------------------------

    def _names(self) -> dict[str, str]:
        """GGUF tensor name -> HF checkpoint name, from the gguf package's own name table."""
        arch = next(a for a, name in gguf.MODEL_ARCH_NAMES.items() if name == self.arch)
        table = gguf.get_tensor_name_map(arch, self.config["num_hidden_layers"])
        hf = ["model.embed_tokens.weight", "model.norm.weight", "lm_head.weight"]
        for i in range(self.config["num_hidden_layers"]):
            p = f"model.layers.{i}."
            hf += [p + "input_layernorm.weight", p + "post_attention_layernorm.weight"]
            hf += [p + f"self_attn.{x}_proj.{s}" for x in "qkvo" for s in ("weight", "bias")]
            hf += [p + f"self_attn.{x}_norm.weight" for x in "qk"]
            hf += [p + f"mlp.{x}_proj.weight" for x in ("gate", "up", "down")]
        names = {}
        for name in hf:
            gguf_name = table.get_name(name, try_suffixes=(".weight", ".bias"))
            if gguf_name is not None:
                names[gguf_name] = name
        return names

    def _check_types(self) -> None:
        names = self._names()
        bad: dict[str, list[str]] = {}
        for t in self.reader.tensors:
            if t.name in names and t.tensor_type not in SUPPORTED_TYPES:
                bad.setdefault(t.tensor_type.name, []).append(t.name)
        if bad:
            found = "; ".join(f"{kind} ({', '.join(ts[:3])}{', ...' if len(ts) > 3 else ''})"
                              for kind, ts in bad.items())
            raise UnsupportedGGUFError(
                f"{self.path}: quantization types not supported: {found}; supported: "
                f"{', '.join(t.name for t in SUPPORTED_TYPES)}")

    def num_tensors(self) -> int:
        """How many tensors tensors() yields."""
        names = self._names()
        return sum(name in names for name in self._tensors)

    def tensors(self) -> Iterator[tuple[str, np.ndarray]]:
        """(HF name, float32 array) for every weight the model uses, one at a time."""
        names = self._names()
        _, permuted = ARCHITECTURES[self.arch]
        heads = self.config["num_attention_heads"]
        kv_heads = self.config["num_key_value_heads"]
        for t in self.reader.tensors:
            if t.name not in names:
                continue
            shape = tuple(int(n) for n in reversed(t.shape))  # ggml lists the inner dim first
            w = gguf.quants.dequantize(t.data, t.tensor_type).reshape(shape)
            if permuted and ".attn_q." in t.name:
                w = unpermute_rows(w, heads)
            elif permuted and ".attn_k." in t.name:
                w = unpermute_rows(w, kv_heads)
            # a writable array of its own: the file is mapped read-only
            yield names[t.name], np.require(w, np.float32, ["C_CONTIGUOUS", "WRITEABLE"])


def unpermute_rows(w: np.ndarray, num_heads: int) -> np.ndarray:
    """Undo llama.cpp's q/k permutation, as transformers' `_reverse_permute_weights` does: per
    head, the file's rows 0, 2, 4, ... are HF's first half and rows 1, 3, 5, ... its second."""
    dim = w.shape[0] // num_heads // 2
    return w.reshape(num_heads, dim, 2, *w.shape[1:]).swapaxes(2, 1).reshape(w.shape)
