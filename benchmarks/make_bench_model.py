"""The Llamas the performance figures use, random weights, with the embedded tiny model's
tokenizer (vocab 32000):

    56m  hidden 512, 8 layers, 8 query heads / 4 KV heads, head_dim 64 (the CPU figures)
    1b   hidden 2048, 16 layers, 32 query heads / 8 KV heads, head_dim 64, MLP 8192: the shape
         of a 1B-class Llama (the GPU figures)
    deep the 56m's layers, 32 of them (120M): a target for draft-model speculation

    .venv/bin/python benchmarks/make_bench_model.py DIR [--size 56m|1b|deep]
        [--dtype float32|bfloat16] [--draft-layers N]

--draft-layers N also writes DIR-draft and DIR-other-draft, drafts of N layers for speculative
decoding: DIR-draft is DIR's first N layers, and DIR's later layers are made to add nothing to
the residual stream (their o_proj and down_proj zero: they cost what they cost and change
nothing), so the target computes what the draft computes: a draft and target made to agree.
DIR-other-draft is an unrelated random model of N layers: a draft the target never agrees with.
"""
from __future__ import annotations

import argparse
import shutil
import sys
import tempfile
from pathlib import Path

import torch
import transformers

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from common.models.tiny import make_tiny_model  # noqa: E402


SIZES = {
    "56m": dict(hidden_size=512, intermediate_size=1408, num_hidden_layers=8,
                num_attention_heads=8, num_key_value_heads=4, head_dim=64),
    "1b": dict(hidden_size=2048, intermediate_size=8192, num_hidden_layers=16,
               num_attention_heads=32, num_key_value_heads=8, head_dim=64),
    "deep": dict(hidden_size=512, intermediate_size=1408, num_hidden_layers=32,
                 num_attention_heads=8, num_key_value_heads=4, head_dim=64),
}


def save(model, out: Path) -> None:
    model.save_pretrained(out, safe_serialization=True)
    with tempfile.TemporaryDirectory() as tmp:
        tiny = make_tiny_model(tmp)
        for name in ("tokenizer.json", "tokenizer_config.json"):
            shutil.copy(tiny / name, out / name)
    params = sum(t.numel() for t in model.parameters())
    print(f"{out}: {params / 1e6:.1f}M parameters, {model.dtype}")


def drafts(model, cfg, n: int, out: Path) -> None:
    """DIR-draft (the first n layers; the target's later ones silenced) and DIR-other-draft."""
    draft_cfg = transformers.LlamaConfig(**{**cfg.to_dict(), "num_hidden_layers": n})
    draft = transformers.LlamaForCausalLM(draft_cfg).to(model.dtype)
    state = {k: v for k, v in model.state_dict().items()
             if not k.startswith("model.layers.") or int(k.split(".")[2]) < n}
    draft.load_state_dict(state)
    with torch.no_grad():
        for layer in model.model.layers[n:]:
            layer.self_attn.o_proj.weight.zero_()
            layer.mlp.down_proj.weight.zero_()
    save(draft, Path(f"{out}-draft"))
    torch.manual_seed(1)
    save(transformers.LlamaForCausalLM(draft_cfg).to(model.dtype), Path(f"{out}-other-draft"))


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("dir")
    p.add_argument("--size", default="56m", choices=list(SIZES))
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    p.add_argument("--draft-layers", type=int, default=0,
                   help="also write DIR-draft and DIR-other-draft of this many layers")
    args = p.parse_args()
    out = Path(args.dir)
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(
        vocab_size=32000, max_position_embeddings=4096, rms_norm_eps=1e-5,
        tie_word_embeddings=False, bos_token_id=1, eos_token_id=2, torch_dtype=args.dtype,
        **SIZES[args.size])
    # random init is the slow part: on the GPU where there is one
    with torch.device("cuda" if torch.cuda.is_available() else "cpu"):
        model = transformers.LlamaForCausalLM(cfg).to(getattr(torch, args.dtype))
    model = model.cpu()
    if args.draft_layers:
        drafts(model, cfg, args.draft_layers, out)
    save(model, out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
