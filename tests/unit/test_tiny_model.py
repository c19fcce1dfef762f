"""The embedded tiny model is a real HF checkpoint that transformers loads, made reproducibly."""

import json
import statistics
import warnings

import pytest
import torch
import transformers
from safetensors.torch import load_file
from tokenizers import Tokenizer

from common.models.tiny import KNOWN_ARCHS, make_tiny_model, train_tokenizer

FILES = (
    "config.json",
    "generation_config.json",
    "model.safetensors",
    "tokenizer.json",
    "tokenizer_config.json",
)
HF_CLASSES = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM"}
UNICODE_TEXT = "héllo wörld 🚀 日本"


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("tiny")
    return {arch: make_tiny_model(root / arch, arch) for arch in KNOWN_ARCHS}


def test_known_archs():
    assert KNOWN_ARCHS == ("llama", "qwen2", "qwen3")


def test_unknown_arch_lists_known_ones(tmp_path):
    with pytest.raises(ValueError, match="llama, qwen2, qwen3"):
        make_tiny_model(tmp_path, "gpt2")


@pytest.mark.parametrize("arch", KNOWN_ARCHS)
def test_same_seed_gives_identical_files(arch, model_dirs, tmp_path):
    again = make_tiny_model(tmp_path / "again", arch)
    assert sorted(p.name for p in again.iterdir()) == sorted(FILES)
    for name in FILES:
        assert (again / name).read_bytes() == (model_dirs[arch] / name).read_bytes(), name


def test_other_seed_changes_only_the_weights(model_dirs, tmp_path):
    other = make_tiny_model(tmp_path / "seed1", "llama", seed=1)
    for name in FILES:
        same = (other / name).read_bytes() == (model_dirs["llama"] / name).read_bytes()
        assert same == (name != "model.safetensors"), name
    a = load_file(model_dirs["llama"] / "model.safetensors")
    b = load_file(other / "model.safetensors")
    assert a.keys() == b.keys()
    assert not any(torch.equal(a[name], b[name]) for name in a)


def test_tokenizer_training_is_deterministic():
    assert train_tokenizer().to_str() == train_tokenizer().to_str()


@pytest.mark.parametrize("arch", KNOWN_ARCHS)
def test_transformers_loads_every_weight_from_the_file(arch, model_dirs):
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        model, info = transformers.AutoModelForCausalLM.from_pretrained(
            model_dirs[arch], output_loading_info=True
        )
    assert type(model).__name__ == HF_CLASSES[arch]
    assert info["missing_keys"] == set() and info["unexpected_keys"] == set()
    assert info["mismatched_keys"] == set() and info["error_msgs"] == []
    assert model.dtype == torch.float32

    # Nothing was left to transformers' own init: every parameter equals the tensor in the file.
    on_disk = load_file(model_dirs[arch] / "model.safetensors")
    tied = "lm_head.weight" not in on_disk
    assert tied == (arch != "llama")
    for name, tensor in model.state_dict().items():
        key = "model.embed_tokens.weight" if tied and name == "lm_head.weight" else name
        assert torch.equal(tensor, on_disk[key]), name
    assert ("model.layers.0.self_attn.q_proj.bias" in on_disk) == (arch == "qwen2")
    assert ("model.layers.0.self_attn.q_norm.weight" in on_disk) == (arch == "qwen3")


@pytest.mark.parametrize("arch", KNOWN_ARCHS)
def test_config_reports_gqa_and_rope(arch, model_dirs):
    config = transformers.AutoConfig.from_pretrained(model_dirs[arch])
    assert (config.num_attention_heads, config.num_key_value_heads, config.head_dim) == (8, 2, 32)
    assert (config.vocab_size, config.hidden_size, config.num_hidden_layers) == (2048, 256, 4)
    assert config.tie_word_embeddings == (arch != "llama")
    raw = json.loads((model_dirs[arch] / "config.json").read_text())
    assert raw["architectures"] == [HF_CLASSES[arch]] and raw["torch_dtype"] == "float32"
    if arch == "llama":
        expected = {
            "rope_type": "llama3",
            "rope_theta": 500000.0,
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 1024,
        }
        assert config.rope_parameters == expected
        # The legacy keys carry the same values, for loaders that read those.
        assert raw["rope_theta"] == 500000.0
        assert raw["rope_scaling"] == {k: v for k, v in expected.items() if k != "rope_theta"}
    else:
        assert config.rope_parameters == {"rope_type": "default", "rope_theta": 1000000.0}
        assert raw["rope_theta"] == 1000000.0 and "rope_scaling" not in raw


@pytest.mark.parametrize("arch", KNOWN_ARCHS)
def test_greedy_generation_is_peaky(arch, model_dirs):
    model = transformers.AutoModelForCausalLM.from_pretrained(model_dirs[arch])
    tokenizer = transformers.AutoTokenizer.from_pretrained(model_dirs[arch])
    prompt = tokenizer("The server in the basement woke up", return_tensors="pt").input_ids
    out = model.generate(
        prompt,
        max_new_tokens=24,
        do_sample=False,
        eos_token_id=None,  # a random model may emit eos; generate all 24 anyway
        pad_token_id=tokenizer.pad_token_id,
        output_scores=True,
        return_dict_in_generate=True,
    )
    generated = out.sequences[0, prompt.shape[1]:]
    assert generated.shape == (24,)
    assert len(set(generated.tolist())) > 8, "greedy decoding fell into a loop"
    top2 = [scores[0].topk(2).values for scores in out.scores]
    gaps = [(top[0] - top[1]).item() for top in top2]
    assert statistics.median(gaps) > 0.5


@pytest.mark.parametrize("arch", KNOWN_ARCHS)
def test_tokenizer_special_tokens_and_unicode_round_trip(arch, model_dirs):
    tokenizer = transformers.AutoTokenizer.from_pretrained(model_dirs[arch])
    assert len(tokenizer) == 2048
    specials = ["<|begin_of_text|>", "<|end_of_text|>", "<|im_start|>", "<|im_end|>", "<|pad|>"]
    assert tokenizer.convert_tokens_to_ids(specials) == [2043, 2044, 2045, 2046, 2047]
    special_ids = (tokenizer.bos_token_id, tokenizer.eos_token_id, tokenizer.pad_token_id)
    assert special_ids == (2043, 2044, 2047)
    ids = tokenizer.encode(UNICODE_TEXT)
    assert tokenizer.decode(ids) == UNICODE_TEXT
    assert tokenizer.encode("hi<|im_end|>")[-1] == 2046
    generation = json.loads((model_dirs[arch] / "generation_config.json").read_text())
    assert generation["eos_token_id"] == [2044, 2046]


def test_raw_tokenizer_round_trips_any_unicode(model_dirs):
    tokenizer = Tokenizer.from_file(str(model_dirs["llama"] / "tokenizer.json"))
    # Not NFC-normalized ("e" + combining accent), control characters, mixed scripts and spaces.
    text = UNICODE_TEXT + " e\u0301 \x00\x07 \t\n\r  Ωμέγα ½ 𝔘 \u200b end "
    assert tokenizer.decode(tokenizer.encode(text).ids) == text


@pytest.mark.parametrize("arch", KNOWN_ARCHS)
def test_chat_template_is_chatml(arch, model_dirs):
    tokenizer = transformers.AutoTokenizer.from_pretrained(model_dirs[arch])
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi 🚀"}]
    text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    expected = "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi 🚀<|im_end|>\n"
    assert text == expected + "<|im_start|>assistant\n"
    assert tokenizer.apply_chat_template(messages, tokenize=False) == expected
    ids = tokenizer.apply_chat_template(
        messages, add_generation_prompt=True, tokenize=True, return_dict=True
    )["input_ids"]
    assert ids[0] == 2045
    assert tokenizer.decode(ids) == text
