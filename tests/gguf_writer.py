"""A HF checkpoint of the tiny models written as a GGUF file the way llama.cpp's converter
(convert_hf_to_gguf.py) writes one, through the gguf package's GGUFWriter: its metadata keys,
its tensor names, Llama's q/k rows permuted, Llama 3's rope scaling as a rope_freqs tensor, the
byte-level BPE tokenizer and chat template as metadata, 1-D tensors kept in F32.

The tests read these files back through pdserve and through transformers.
"""
from __future__ import annotations

import json
import math
from pathlib import Path

import gguf
import numpy as np
import torch
from safetensors.torch import load_file

Q = gguf.GGMLQuantizationType
ARCHS = {"llama": gguf.MODEL_ARCH.LLAMA, "qwen2": gguf.MODEL_ARCH.QWEN2,
         "qwen3": gguf.MODEL_ARCH.QWEN3}
# where ggml's k-quant blocks keep their f16 scales (block_q2_K ... block_q6_K in ggml-common.h)
K_QUANT_SCALES = {Q.Q2_K: (80, 82), Q.Q3_K: (108,), Q.Q4_K: (0, 2), Q.Q5_K: (0, 2),
                  Q.Q6_K: (208,)}


def write_gguf(model_dir: Path, out: Path, qtype: Q = Q.F32, arch: str | None = None,
               seed: int = 0) -> dict[str, tuple[str, Q, np.ndarray]]:
    """Writes `out`; returns what each HF weight became: (GGUF name, type, stored array).

    qtype applies to every 2-D weight. The types gguf.quants can quantize are quantized from
    the checkpoint's values; the k-quants, which it can only dequantize, get random blocks (with
    sane scales), so their test compares two dequantizers on the same bytes. `arch` overrides
    the architecture written (to make a file pdserve must refuse)."""
    cfg = json.loads((model_dir / "config.json").read_text())
    name = cfg["model_type"]
    writer = gguf.GGUFWriter(out, arch or name)
    _config(writer, cfg)
    _tokenizer(writer, model_dir)
    table = gguf.get_tensor_name_map(ARCHS[name], cfg["num_hidden_layers"])
    rng = np.random.default_rng(seed)
    written = {}
    weights = load_file(str(model_dir / "model.safetensors"))
    for hf_name, tensor in weights.items():
        gguf_name = table.get_name(hf_name, try_suffixes=(".weight", ".bias"))
        assert gguf_name is not None, hf_name
        w = tensor.numpy()
        if name == "llama" and ".attn_q." in gguf_name:
            w = permute_rows(w, cfg["num_attention_heads"])
        elif name == "llama" and ".attn_k." in gguf_name:
            w = permute_rows(w, cfg["num_key_value_heads"])
        kind = qtype if w.ndim == 2 else Q.F32
        data = random_blocks(w.shape, kind, rng) if kind in K_QUANT_SCALES else \
            gguf.quants.quantize(w, kind)
        writer.add_tensor(gguf_name, data, raw_dtype=kind)
        written[hf_name] = (gguf_name, kind, data)
    if (cfg.get("rope_scaling") or {}).get("rope_type") == "llama3":
        writer.add_tensor(gguf.TENSOR_NAMES[gguf.MODEL_TENSOR.ROPE_FREQS] + ".weight",
                          llama3_rope_factors(cfg))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return written


def permute_rows(w: np.ndarray, num_heads: int) -> np.ndarray:
    """llama.cpp's `LlamaModel.permute`: per head, HF's rotate-halves rows to rotate-pairs."""
    return (w.reshape(num_heads, 2, w.shape[0] // num_heads // 2, *w.shape[1:])
            .swapaxes(1, 2).reshape(w.shape))


def llama3_rope_factors(cfg: dict) -> np.ndarray:
    """The divisor of each rope frequency, computed as llama.cpp's converter does."""
    rope = cfg["rope_scaling"]
    dim, base = cfg["head_dim"], cfg["rope_theta"]
    factor, low, high = rope["factor"], rope["low_freq_factor"], rope["high_freq_factor"]
    old_len = rope["original_max_position_embeddings"]
    freqs = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim))
    factors = []
    for freq in freqs.tolist():
        wavelen = 2 * math.pi / freq
        if wavelen < old_len / high:
            factors.append(1.0)
        elif wavelen > old_len / low:
            factors.append(factor)
        else:
            smooth = (old_len / wavelen - low) / (high - low)
            factors.append(1 / ((1 - smooth) / factor + smooth))
    return np.array(factors, dtype=np.float32)


def random_blocks(shape: tuple[int, ...], kind: Q, rng: np.random.Generator) -> np.ndarray:
    """Random k-quant blocks for a [rows, cols] weight, their f16 scales in [0.001, 0.01]."""
    block_elems, block_bytes = gguf.GGML_QUANT_SIZES[kind]
    rows, cols = shape
    blocks = rng.integers(0, 256, size=(rows, cols // block_elems, block_bytes), dtype=np.uint8)
    for offset in K_QUANT_SCALES[kind]:
        scales = rng.uniform(0.001, 0.01, size=blocks.shape[:2]).astype(np.float16)
        blocks[:, :, offset:offset + 2] = scales.view(np.uint8).reshape(*blocks.shape[:2], 2)
    return blocks.reshape(rows, -1)


def _config(w: gguf.GGUFWriter, cfg: dict) -> None:
    w.add_block_count(cfg["num_hidden_layers"])
    w.add_context_length(cfg["max_position_embeddings"])
    w.add_embedding_length(cfg["hidden_size"])
    w.add_feed_forward_length(cfg["intermediate_size"])
    w.add_head_count(cfg["num_attention_heads"])
    w.add_head_count_kv(cfg["num_key_value_heads"])
    w.add_key_length(cfg["head_dim"])
    w.add_value_length(cfg["head_dim"])
    w.add_rope_dimension_count(cfg["head_dim"])
    w.add_rope_freq_base(cfg["rope_theta"])
    w.add_layer_norm_rms_eps(cfg["rms_norm_eps"])
    w.add_vocab_size(cfg["vocab_size"])


def _tokenizer(w: gguf.GGUFWriter, model_dir: Path) -> None:
    tok = json.loads((model_dir / "tokenizer.json").read_text())
    tok_cfg = json.loads((model_dir / "tokenizer_config.json").read_text())
    gen_cfg = json.loads((model_dir / "generation_config.json").read_text())
    by_id = {i: t for t, i in tok["model"]["vocab"].items()}
    special = {a["id"] for a in tok["added_tokens"] if a["special"]}
    by_id.update({a["id"]: a["content"] for a in tok["added_tokens"]})
    tokens = [by_id[i] for i in range(len(by_id))]
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("qwen2")  # the tiny tokenizer splits text with Qwen2's pattern
    w.add_token_list(tokens)
    w.add_token_types([gguf.TokenType.CONTROL if i in special else gguf.TokenType.NORMAL
                       for i in range(len(tokens))])
    w.add_token_merges([" ".join(m) for m in tok["model"]["merges"]])
    w.add_bos_token_id(gen_cfg["bos_token_id"])
    eos, eot = gen_cfg["eos_token_id"]  # end of text, end of turn
    w.add_eos_token_id(eos)
    w.add_eot_token_id(eot)
    w.add_pad_token_id(gen_cfg["pad_token_id"])
    w.add_add_bos_token(False)
    w.add_chat_template(tok_cfg["chat_template"])
