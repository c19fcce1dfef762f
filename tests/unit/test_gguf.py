"""GGUF checkpoints: every supported type dequantizes within its bound, the weights equal
transformers' reading of the same file, and a tiny model served from GGUF computes the logits
of its safetensors twin."""
import json
import shutil

import gguf
import numpy as np
import pytest
import torch
import transformers
from transformers.integrations.gguf.dequant import dequantize as hf_dequantize
from transformers.modeling_gguf_pytorch_utils import LlamaTensorProcessor, load_gguf_checkpoint

from common.kv_cache import PagedKVCache
from common.kv_layout import KVLayout
from common.models.attention import AttentionMetadata, create_attention_backend
from common.models.config import ModelConfig
from common.models.gguf import SUPPORTED_TYPES, GGUFCheckpoint, UnsupportedGGUFError, find_gguf
from common.models.llama import load_model
from tests.gguf_writer import K_QUANT_SCALES, write_gguf

Q = gguf.GGMLQuantizationType


def _max_error(kind: Q, ref: np.ndarray) -> np.ndarray:
    """How far each dequantized value may be from `ref`: half a quantization step per block of
    32 (rounding) with room for the f16 scale's own rounding, or the float format's precision."""
    if kind == Q.F32:
        return np.zeros_like(ref)
    if kind == Q.F16:
        return np.abs(ref) * 2.0 ** -11 + 6e-8
    if kind == Q.BF16:
        return np.abs(ref) * 2.0 ** -8
    blocks = ref.reshape(*ref.shape[:-1], -1, 32)
    amax = np.abs(blocks).max(-1, keepdims=True)
    spread = blocks.max(-1, keepdims=True) - blocks.min(-1, keepdims=True)
    # signed scales reach amax on one side only: the other side's last level is a step short
    step = {Q.Q8_0: amax / 127 * 0.5, Q.Q4_0: amax / 8, Q.Q5_0: amax / 16,
            Q.Q4_1: spread / 15 * 0.5, Q.Q5_1: spread / 31 * 0.5}[kind]
    return np.broadcast_to(step * 1.01 + amax * 2.0 ** -10, blocks.shape).reshape(ref.shape)


ROUND_TRIP = [Q.F32, Q.F16, Q.BF16, Q.Q8_0, Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q5_1]


@pytest.mark.parametrize("kind", ROUND_TRIP, ids=lambda k: k.name)
def test_each_type_round_trips_within_its_bound(tiny_llama, tmp_path, kind):
    path = tmp_path / "tiny.gguf"
    written = write_gguf(tiny_llama, path, kind)
    ours = dict(GGUFCheckpoint(path).tensors())
    weights = transformers.AutoModelForCausalLM.from_pretrained(tiny_llama).state_dict()
    assert set(ours) == set(written)
    for name, got in ours.items():
        ref = weights[name].numpy()
        assert got.dtype == np.float32 and got.shape == ref.shape, name
        err = np.abs(got - ref)
        bound = _max_error(written[name][1], ref)
        assert (err <= bound).all(), f"{name}: error {err.max()} over bound at {err.argmax()}"
    if kind != Q.F32:  # and the bound is not loose: quantization really moved the values
        assert not np.array_equal(ours["model.embed_tokens.weight"],
                                  weights["model.embed_tokens.weight"].numpy())


@pytest.mark.parametrize("kind", list(K_QUANT_SCALES), ids=lambda k: k.name)
def test_k_quants_equal_transformers_own_dequantizer(tiny_llama, tmp_path, kind):
    """gguf.quants cannot make k-quant blocks: random ones, dequantized by pdserve and by
    transformers' torch dequantizer (its own code), must agree, q/k rows unpermuted alike."""
    path = tmp_path / "tiny.gguf"
    written = write_gguf(tiny_llama, path, kind)
    ours = dict(GGUFCheckpoint(path).tensors())
    cfg = json.loads((tiny_llama / "config.json").read_text())
    unpermute = LlamaTensorProcessor(cfg)
    for name, (gguf_name, stored, data) in written.items():
        if stored == Q.F32:
            continue
        ref = hf_dequantize(torch.from_numpy(data).reshape(-1), int(stored))
        ref = unpermute.process(ref.reshape(ours[name].shape).numpy(), gguf_name).weights
        np.testing.assert_allclose(ours[name], ref, rtol=1e-6, atol=1e-9, err_msg=name)


def test_weights_equal_transformers_reading_of_the_file(tiny_llama, tmp_path):
    """A Llama file, q and k permuted: pdserve's weights are transformers' own, bit for bit."""
    path = tmp_path / "tiny.gguf"
    write_gguf(tiny_llama, path, Q.Q4_1)
    config = transformers.AutoConfig.from_pretrained(tmp_path, gguf_file=path.name)
    hf = transformers.LlamaForCausalLM(config)
    theirs = load_gguf_checkpoint(str(path), return_tensors=True, model_to_load=hf)["tensors"]
    ours = dict(GGUFCheckpoint(path).tensors())
    assert set(ours) == set(theirs)
    for name, w in ours.items():
        assert torch.equal(torch.from_numpy(w), theirs[name]), name


BLOCK = 16


def _logits(model_path, ids):
    model = load_model(model_path, create_attention_backend("torch"))
    c = model.config
    cache = PagedKVCache(KVLayout(c.num_layers, c.num_kv_heads, c.head_dim, BLOCK, "float32"), 8)
    meta = AttentionMetadata.build([], [(0, len(ids), [3, 0, 5])], BLOCK)
    return model.compute_logits(model(torch.tensor(ids), torch.arange(len(ids)), cache.layers,
                                      meta))


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3"])
def test_gguf_model_computes_the_safetensors_logits(tiny_models, tmp_path, arch):
    """F32, so the weights are the same: rope (Llama 3's as rope_freqs), tied embeddings, qkv
    bias, q/k norms and the q/k permutation must all come back as they were."""
    path = tmp_path / f"{arch}.gguf"
    write_gguf(tiny_models[arch], path, Q.F32)
    ids = torch.randint(0, 2048, (40,), generator=torch.Generator().manual_seed(0)).tolist()
    # the same weights in differently aligned memory: on AVX-512 MKL may sum in another order
    # (one logit in 81920 off by 1.3e-4 seen); a wrong permutation or norm is off by O(1)
    torch.testing.assert_close(_logits(path, ids), _logits(tiny_models[arch], ids),
                               rtol=1e-4, atol=1e-3)
    ours = ModelConfig.from_pretrained(path)
    theirs = ModelConfig.from_pretrained(tiny_models[arch])
    for field in ("architecture", "vocab_size", "hidden_size", "intermediate_size",
                  "num_layers", "num_heads", "num_kv_heads", "head_dim",
                  "max_position_embeddings", "tie_word_embeddings", "qkv_bias", "qk_norm",
                  "eos_token_ids"):
        assert getattr(ours, field) == getattr(theirs, field), field
    for field in ("rms_norm_eps", "rope_theta"):  # a GGUF stores them as float32
        assert np.float32(getattr(ours, field)) == np.float32(getattr(theirs, field)), field
    assert bool(ours.rope_freq_factors) == (arch == "llama")


def test_a_directory_holding_one_gguf_serves_it(tiny_llama, tmp_path):
    write_gguf(tiny_llama, tmp_path / "model.gguf", Q.Q8_0)
    assert find_gguf(tmp_path) == tmp_path / "model.gguf"
    assert find_gguf(tmp_path / "model.gguf") == tmp_path / "model.gguf"
    assert find_gguf(tiny_llama) is None  # config.json: a HF checkpoint
    assert load_model(tmp_path, create_attention_backend("torch")).config.num_layers == 4
    shutil.copy(tmp_path / "model.gguf", tmp_path / "other.gguf")
    with pytest.raises(ValueError, match="model.gguf, other.gguf"):
        find_gguf(tmp_path)


def test_unsupported_quantization_is_named(tiny_llama, tmp_path):
    """IQ4_NL blocks (any bytes: nothing may dequantize them) are refused up front."""
    path = tmp_path / "tiny.gguf"
    write_gguf(tiny_llama, path, Q.Q8_0)
    bad = tmp_path / "iq.gguf"
    _retype(path, bad, "blk.0.attn_v.weight", Q.IQ4_NL)
    with pytest.raises(UnsupportedGGUFError) as err:
        load_model(bad, create_attention_backend("torch"))
    message = str(err.value)
    assert "IQ4_NL (blk.0.attn_v.weight)" in message
    assert all(t.name in message for t in SUPPORTED_TYPES)


def test_unsupported_architecture_is_named(tiny_llama, tmp_path):
    path = tmp_path / "tiny.gguf"
    write_gguf(tiny_llama, path, Q.F16, arch="phi3")
    with pytest.raises(UnsupportedGGUFError, match="architecture 'phi3' is not supported"):
        ModelConfig.from_pretrained(path)


def _retype(src, dst, name, kind):
    """A copy of `src` where tensor `name` is stored as `kind` (same shape, zero bytes)."""
    reader = gguf.GGUFReader(src)
    writer = gguf.GGUFWriter(dst, reader.get_field("general.architecture").contents())
    for key, field in reader.fields.items():
        if key.startswith("GGUF.") or key == "general.architecture":
            continue
        value, kind_of = field.contents(), field.types[0]
        sub = field.types[-1] if kind_of == gguf.GGUFValueType.ARRAY else None
        writer.add_key_value(key, value, kind_of, sub_type=sub)
    for t in reader.tensors:
        if t.name == name:
            elems, size = gguf.GGML_QUANT_SIZES[kind]
            rows, cols = int(t.shape[1]), int(t.shape[0])
            writer.add_tensor(t.name, np.zeros((rows, cols // elems * size), np.uint8),
                              raw_dtype=kind)
        else:
            writer.add_tensor(t.name, t.data, raw_dtype=t.tensor_type)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
