"""`pdserve serve MODEL [flags]`: `pdserve up` spelled as vLLM's `vllm serve`, the model as the
first argument (it wins over --model, as in vLLM) and the same flags."""
from __future__ import annotations

import argparse

from services import launcher


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("model_tag", nargs="?", default=None, metavar="MODEL",
                   help="checkpoint directory, .gguf file or fetched model name (default: "
                        "--model)")
    launcher.add_arguments(p)


def run(args: argparse.Namespace) -> int:
    return launcher.run(args)
