"""A gateway process without torch. It tokenizes, detokenizes, checks grammars and streams; it
computes no tensor. But transformers imports torch whenever torch is installed (~2.9 of the
gateway's ~5.6 CPU seconds to start on a 2-core AVX2 machine, and its memory in every gateway
process), so a gateway process starts with `keep_out()`: torch looks absent and transformers
loads its tokenizers alone. xgrammar's package imports torch unconditionally: `let_in()` lifts
the block before the first guided request imports it (the gateway's structured_outputs.py). A
GGUF model whose tokenizer transformers converts from the file's metadata needs torch for that,
and transformers decides once per process whether torch is there: such a gateway keeps it."""
from __future__ import annotations

import logging
import sys


class _NoTorchNotice(logging.Filter):
    """transformers' notice that it found no PyTorch: expected here, not a problem to report."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not record.getMessage().startswith("PyTorch was not found")


def keep_out(model: str) -> None:
    """At the start of a gateway process serving `model`, before anything imports transformers:
    torch reads as not installed (a None entry in sys.modules makes importlib find no module),
    unless the model's tokenizer needs it."""
    from common.models.gguf import tokenizer_from_metadata
    if "torch" not in sys.modules and not tokenizer_from_metadata(model):
        sys.modules["torch"] = None  # type: ignore[assignment]
        logging.getLogger("transformers").addFilter(_NoTorchNotice())


def let_in() -> None:
    """Lifts keep_out's block (a no-op without one)."""
    if "torch" in sys.modules and sys.modules["torch"] is None:
        del sys.modules["torch"]
