"""The 56M-parameter Llama the performance figures use (hidden 512, 8 layers, 8 query heads / 4
KV heads, head_dim 64, vocab 32000), random weights, with the embedded tiny model's tokenizer.

    .venv/bin/python benchmarks/make_bench_model.py DIR [--dtype float32|bfloat16]
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


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("dir")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    args = p.parse_args()
    out = Path(args.dir)
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(
        vocab_size=32000, hidden_size=512, intermediate_size=1408, num_hidden_layers=8,
        num_attention_heads=8, num_key_value_heads=4, head_dim=64,
        max_position_embeddings=4096, rms_norm_eps=1e-5, tie_word_embeddings=False,
        bos_token_id=1, eos_token_id=2, torch_dtype=args.dtype)
    model = transformers.LlamaForCausalLM(cfg).to(getattr(torch, args.dtype))
    model.save_pretrained(out, safe_serialization=True)
    with tempfile.TemporaryDirectory() as tmp:
        tiny = make_tiny_model(tmp)
        for name in ("tokenizer.json", "tokenizer_config.json"):
            shutil.copy(tiny / name, out / name)
    params = sum(t.numel() for t in model.parameters())
    print(f"{out}: {params / 1e6:.1f}M parameters, {args.dtype}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
