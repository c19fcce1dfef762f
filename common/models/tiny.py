"""The embedded default model: a tiny random-weight HuggingFace checkpoint, made deterministically.

`make_tiny_model(dir, arch, seed)` writes a plain HF checkpoint directory that `transformers` loads
as-is: config.json, generation_config.json, model.safetensors, tokenizer.json and
tokenizer_config.json.
The same (arch, seed) always gives byte-identical files.

Two choices matter to the tests that compare pdserve with `transformers`:

- The init scales make the next-token distribution peaky (median top-1/top-2 logit gap about 2
  nats), so greedy tokens do not flip on the ~1e-5 float noise between two correct implementations.
- Attention and MLP outputs outweigh the token embedding in the residual stream, so the next token
  depends on context and position: a bug in rope, the KV cache or masking changes the tokens.

The tokenizer is a byte-level BPE trained on `tiny_corpus.txt` next to this file; byte-level means
any unicode text round-trips, and tokenizer.json has no normalizer to rewrite it (but transformers
forces its own Qwen2Tokenizer, which adds NFC, on model_type "qwen2"). Like Qwen's, it adds no BOS.
A chat is ChatML (`<|im_start|>role\ncontent<|im_end|>\n` per message); generation ends at
`<|im_end|>` or `<|end_of_text|>`.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import save
from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, trainers

VOCAB_SIZE = 2048
HIDDEN_SIZE = 256
INTERMEDIATE_SIZE = 512
NUM_LAYERS = 4
NUM_HEADS = 8
NUM_KV_HEADS = 2
HEAD_DIM = 32
MAX_POSITIONS = 4096
RMS_NORM_EPS = 1e-6

BOS_TOKEN = "<|begin_of_text|>"
EOS_TOKEN = "<|end_of_text|>"
IM_START = "<|im_start|>"
IM_END = "<|im_end|>"
PAD_TOKEN = "<|pad|>"
# Appended after the learned BPE vocabulary, so their ids are VOCAB_SIZE - 5 .. VOCAB_SIZE - 1.
SPECIAL_TOKENS = (BOS_TOKEN, EOS_TOKEN, IM_START, IM_END, PAD_TOKEN)

CORPUS_PATH = Path(__file__).with_name("tiny_corpus.txt")

# Qwen2's pre-tokenizer split: contractions, letter runs, single digits, punctuation runs, spaces.
SPLIT_PATTERN = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)

CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)

# Init scales (see the module docstring). Projections are N(0, (gain / sqrt(fan_in))^2).
EMBED_STD = 1.0
LM_HEAD_STD = 10.0 / math.sqrt(HIDDEN_SIZE)  # logit std ~10 on a unit-RMS hidden state
TIED_EMBED_STD = LM_HEAD_STD  # tied: the embedding is the lm head
# q and k entries of std QK_GAIN give attention scores of std QK_GAIN^2: sharp attention, so the
# output depends on which earlier tokens are where. Qwen3 gets the same scale from its q/k norms.
QK_GAIN = 2.0
PROJ_GAIN = 1.0
# o_proj and down_proj write loudly into the residual stream, so the token's own embedding is a
# small part of the final hidden state. With tied embeddings a large share would make every token
# predict itself and greedy decoding would loop on one token.
OUT_GAIN = 10.0
NORM_NOISE_STD = 0.1  # norm weights are scale * (1 + N(0, NORM_NOISE_STD^2))
QKV_BIAS_STD = 0.25


@dataclass(frozen=True)
class ArchSpec:
    hf_class: str
    model_type: str
    rope_theta: float
    tie_word_embeddings: bool
    qkv_bias: bool
    qk_norm: bool
    llama3_rope: bool


ARCHS = {
    "llama": ArchSpec(
        "LlamaForCausalLM", "llama", rope_theta=500000.0, tie_word_embeddings=False,
        qkv_bias=False, qk_norm=False, llama3_rope=True,
    ),
    "qwen2": ArchSpec(
        "Qwen2ForCausalLM", "qwen2", rope_theta=1000000.0, tie_word_embeddings=True,
        qkv_bias=True, qk_norm=False, llama3_rope=False,
    ),
    "qwen3": ArchSpec(
        "Qwen3ForCausalLM", "qwen3", rope_theta=1000000.0, tie_word_embeddings=True,
        qkv_bias=False, qk_norm=True, llama3_rope=False,
    ),
}
KNOWN_ARCHS = tuple(ARCHS)

LLAMA3_ROPE_SCALING = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 1024,
}


def make_tiny_model(out_dir: str | Path, arch: str = "llama", seed: int = 0) -> Path:
    """Write the tiny `arch` checkpoint into `out_dir` (created if needed) and return its path.

    Invariant: the files depend only on (arch, seed) and this module's code and corpus.
    """
    if arch not in ARCHS:
        raise ValueError(f"unknown tiny model arch {arch!r}; known: {', '.join(KNOWN_ARCHS)}")
    spec = ARCHS[arch]
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)

    tokenizer = train_tokenizer()
    assert tokenizer.get_vocab_size() == VOCAB_SIZE, "corpus too small for the tokenizer vocab"
    ids: dict[str, int] = {}
    for tok in SPECIAL_TOKENS:
        tok_id = tokenizer.token_to_id(tok)
        assert tok_id is not None, f"{tok} was added to the vocab by train_tokenizer"
        ids[tok] = tok_id
    tokenizer.save(str(out / "tokenizer.json"))
    _write_json(out / "tokenizer_config.json", _tokenizer_config())
    _write_json(out / "config.json", _model_config(spec, ids))
    _write_json(out / "generation_config.json", _generation_config(ids))
    # save() then write_bytes(), not save_file(): the file gets the umask's mode like the others.
    weights = save(make_weights(spec, seed), metadata={"format": "pt"})
    (out / "model.safetensors").write_bytes(weights)
    return out


def train_tokenizer() -> Tokenizer:
    """Byte-level BPE on the bundled corpus, special tokens appended at the end of the vocab.

    Deterministic: the trainer breaks ties by pair id, not hash order (two processes, same bytes).
    """
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(SPLIT_PATTERN), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE - len(SPECIAL_TOKENS),
        min_frequency=1,
        show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tokenizer.train_from_iterator([CORPUS_PATH.read_text(encoding="utf-8")], trainer=trainer)
    tokenizer.add_special_tokens(list(SPECIAL_TOKENS))
    return tokenizer


def make_weights(spec: ArchSpec, seed: int) -> dict[str, torch.Tensor]:
    """Random float32 weights under HF parameter names, drawn from one generator in a fixed
    order: the same seed gives the same tensors."""
    gen = torch.Generator().manual_seed(seed)

    def normal(shape: tuple[int, ...], std: float, mean: float = 0.0) -> torch.Tensor:
        return torch.randn(shape, generator=gen, dtype=torch.float32) * std + mean

    def proj(out_features: int, in_features: int, gain: float = PROJ_GAIN) -> torch.Tensor:
        return normal((out_features, in_features), gain / math.sqrt(in_features))

    def norm(size: int, scale: float = 1.0) -> torch.Tensor:
        return normal((size,), NORM_NOISE_STD * scale, mean=scale)

    q_size, kv_size = NUM_HEADS * HEAD_DIM, NUM_KV_HEADS * HEAD_DIM
    embed_std = TIED_EMBED_STD if spec.tie_word_embeddings else EMBED_STD
    weights = {"model.embed_tokens.weight": normal((VOCAB_SIZE, HIDDEN_SIZE), embed_std)}
    for i in range(NUM_LAYERS):
        p = f"model.layers.{i}."
        weights[p + "input_layernorm.weight"] = norm(HIDDEN_SIZE)
        weights[p + "self_attn.q_proj.weight"] = proj(q_size, HIDDEN_SIZE, QK_GAIN)
        weights[p + "self_attn.k_proj.weight"] = proj(kv_size, HIDDEN_SIZE, QK_GAIN)
        weights[p + "self_attn.v_proj.weight"] = proj(kv_size, HIDDEN_SIZE)
        if spec.qkv_bias:
            weights[p + "self_attn.q_proj.bias"] = normal((q_size,), QKV_BIAS_STD)
            weights[p + "self_attn.k_proj.bias"] = normal((kv_size,), QKV_BIAS_STD)
            weights[p + "self_attn.v_proj.bias"] = normal((kv_size,), QKV_BIAS_STD)
        if spec.qk_norm:
            weights[p + "self_attn.q_norm.weight"] = norm(HEAD_DIM, QK_GAIN)
            weights[p + "self_attn.k_norm.weight"] = norm(HEAD_DIM, QK_GAIN)
        weights[p + "self_attn.o_proj.weight"] = proj(HIDDEN_SIZE, q_size, OUT_GAIN)
        weights[p + "post_attention_layernorm.weight"] = norm(HIDDEN_SIZE)
        weights[p + "mlp.gate_proj.weight"] = proj(INTERMEDIATE_SIZE, HIDDEN_SIZE)
        weights[p + "mlp.up_proj.weight"] = proj(INTERMEDIATE_SIZE, HIDDEN_SIZE)
        weights[p + "mlp.down_proj.weight"] = proj(HIDDEN_SIZE, INTERMEDIATE_SIZE, OUT_GAIN)
    weights["model.norm.weight"] = norm(HIDDEN_SIZE)
    if not spec.tie_word_embeddings:
        weights["lm_head.weight"] = normal((VOCAB_SIZE, HIDDEN_SIZE), LM_HEAD_STD)
    return weights


def _model_config(spec: ArchSpec, ids: dict[str, int]) -> dict:
    # transformers 5 reads rope from "rope_parameters"; the legacy top-level "rope_theta" and
    # "rope_scaling" carry the same values, for loaders (ours, older transformers) that read those.
    rope_parameters = {"rope_type": "default", "rope_theta": spec.rope_theta}
    config = {
        "architectures": [spec.hf_class],
        "model_type": spec.model_type,
        "vocab_size": VOCAB_SIZE,
        "hidden_size": HIDDEN_SIZE,
        "intermediate_size": INTERMEDIATE_SIZE,
        "num_hidden_layers": NUM_LAYERS,
        "num_attention_heads": NUM_HEADS,
        "num_key_value_heads": NUM_KV_HEADS,
        "head_dim": HEAD_DIM,
        "hidden_act": "silu",
        "max_position_embeddings": MAX_POSITIONS,
        "rms_norm_eps": RMS_NORM_EPS,
        "rope_theta": spec.rope_theta,
        "tie_word_embeddings": spec.tie_word_embeddings,
        "attention_dropout": 0.0,
        "initializer_range": 0.02,
        "use_cache": True,
        "bos_token_id": ids[BOS_TOKEN],
        "eos_token_id": [ids[EOS_TOKEN], ids[IM_END]],
        "pad_token_id": ids[PAD_TOKEN],
        "torch_dtype": "float32",
        "dtype": "float32",
    }
    if spec.llama3_rope:
        rope_parameters = {**LLAMA3_ROPE_SCALING, "rope_theta": spec.rope_theta}
        config["rope_scaling"] = dict(LLAMA3_ROPE_SCALING)
    config["rope_parameters"] = rope_parameters
    if spec.model_type == "llama":
        config.update(attention_bias=False, mlp_bias=False)
    if spec.model_type == "qwen3":
        config["attention_bias"] = False
    if spec.model_type in ("qwen2", "qwen3"):
        config.update(use_sliding_window=False, sliding_window=None, max_window_layers=NUM_LAYERS)
    return config


def _generation_config(ids: dict[str, int]) -> dict:
    return {
        "bos_token_id": ids[BOS_TOKEN],
        "eos_token_id": [ids[EOS_TOKEN], ids[IM_END]],
        "pad_token_id": ids[PAD_TOKEN],
        "do_sample": False,
    }


def _tokenizer_config() -> dict:
    return {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": BOS_TOKEN,
        "eos_token": EOS_TOKEN,
        "pad_token": PAD_TOKEN,
        # transformers forces its Qwen2Tokenizer on model_type "qwen2", whose default unk token
        # "<|endoftext|>" would otherwise be added as an extra vocab entry (id 2048).
        "unk_token": None,
        "add_bos_token": False,
        "add_eos_token": False,
        "clean_up_tokenization_spaces": False,
        "model_max_length": MAX_POSITIONS,
        "chat_template": CHAT_TEMPLATE,
    }


def _write_json(path: Path, obj: dict) -> None:
    path.write_text(json.dumps(obj, indent=2, sort_keys=True) + "\n", encoding="utf-8")
