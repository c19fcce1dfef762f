"""The model's HuggingFace tokenizer, plus what the gateway reads from the model directory.

Blocking work on a whole prompt (encode, chat template) runs on one worker thread through the
`a*` methods, so a long prompt never stalls the event loop that streams other requests. One
thread, because a HF tokenizer is not safe to drive from several threads at once.
"""

from __future__ import annotations

import asyncio
import functools
import json
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import TypeVar

import jinja2
from tokenizers import decoders

from common.models.gguf import find_gguf, gguf_info
from common.models.hf_tokenizer import load_hf_tokenizer
from services.gateway.errors import bad_request

T = TypeVar("T")

# chat_template_kwargs may not override what the gateway itself passes to the template.
RESERVED_TEMPLATE_KWARGS = frozenset(
    {"conversation", "messages", "tokenize", "add_generation_prompt", "continue_final_message",
     "return_dict", "return_tensors", "tools", "documents", "chat_template"}
)


class Tokenizer:
    """Invariants: `eos_token_ids` comes from generation_config.json (int or list), else a
    GGUF's end-of-sequence/turn ids, else the tokenizer's eos; `vocab_size` (the model's
    embedding rows) bounds every token id the gateway accepts from a client. The HF tokenizer
    (a GGUF's included) is the one common/models/hf_tokenizer.py loads, as the workers'
    grammars do.
    """

    def __init__(self, model_dir: str | Path) -> None:
        model_dir = Path(model_dir)
        gguf_file = find_gguf(model_dir)
        self.hf = load_hf_tokenizer(model_dir)
        generation_config = _read_json(model_dir / "generation_config.json")
        model_eos = gguf_info(gguf_file).eos_token_ids if gguf_file else ()
        self.eos_token_ids = _eos_token_ids(generation_config, model_eos or self.hf.eos_token_id)
        # the ids a client may send are the model's embedding rows, which may outnumber the
        # tokenizer's tokens (a vocabulary padded for the kernels: Qwen's 151936 rows for its
        # 151669 tokens; such an id has no text) or fall short of them (an added token the
        # model has no row for); the tokenizer's size where the model does not say
        model_vocab = (gguf_info(gguf_file).vocab_size if gguf_file else
                       _read_json(model_dir / "config.json").get("vocab_size"))
        self.vocab_size = (model_vocab if isinstance(model_vocab, int) and model_vocab > 0
                           else len(self.hf))
        self._added_ids = set(self.hf.added_tokens_decoder)
        self._byte_level = isinstance(self.hf.backend_tokenizer.decoder, decoders.ByteLevel)
        self.token_text = functools.lru_cache(maxsize=1 << 16)(self._token_text)
        self.token_bytes = functools.lru_cache(maxsize=1 << 16)(self._token_bytes)
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="tokenizer")

    async def _off_loop(self, fn: Callable[[], T]) -> T:
        return await asyncio.get_running_loop().run_in_executor(self._executor, fn)

    async def arun(self, fn: Callable[[], T]) -> T:
        """fn, blocking work that drives this tokenizer, on the tokenizer's own thread."""
        return await self._off_loop(fn)

    # -- encode -------------------------------------------------------------------------------

    def encode_batch(
        self, texts: Sequence[str], add_special_tokens: bool = True
    ) -> list[list[int]]:
        if not texts:
            return []
        return list(self.hf(list(texts), add_special_tokens=add_special_tokens)["input_ids"])

    async def aencode_batch(
        self, texts: Sequence[str], add_special_tokens: bool = True
    ) -> list[list[int]]:
        return await self._off_loop(lambda: self.encode_batch(texts, add_special_tokens))

    def render_chat(
        self,
        messages: list[dict],
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
        template_kwargs: dict | None = None,
        tools: list[dict] | None = None,
    ) -> str:
        """The chat template applied to `messages` (and `tools`, for templates that describe
        them); a template error is the client's (400)."""
        if self.hf.chat_template is None:
            raise bad_request("This model has no chat template; use /v1/completions.")
        if add_generation_prompt and continue_final_message:
            raise bad_request(
                "add_generation_prompt and continue_final_message cannot both be true"
            )
        extra = {
            k: v for k, v in (template_kwargs or {}).items() if k not in RESERVED_TEMPLATE_KWARGS
        }
        try:
            text = self.hf.apply_chat_template(
                messages,
                tokenize=False,
                add_generation_prompt=add_generation_prompt,
                continue_final_message=continue_final_message,
                tools=tools,
                **extra,
            )
        except (jinja2.TemplateError, TypeError, ValueError) as err:
            # Templates raise these on messages they cannot render (roles out of order, ...).
            raise bad_request(f"Chat template error: {err}", "messages") from err
        assert isinstance(text, str), "tokenize=False renders one conversation to one string"
        return text

    async def aencode_chat(
        self,
        messages: list[dict],
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
        template_kwargs: dict | None = None,
        add_special_tokens: bool = False,
        tools: list[dict] | None = None,
    ) -> list[int]:
        def work() -> list[int]:
            text = self.render_chat(
                messages, add_generation_prompt, continue_final_message, template_kwargs, tools
            )
            # The template already wrote BOS and friends, as vLLM assumes.
            return self.encode_batch([text], add_special_tokens)[0]

        return await self._off_loop(work)

    # -- decode -------------------------------------------------------------------------------

    def decode(self, token_ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        text = self.hf.decode(
            list(token_ids),
            skip_special_tokens=skip_special_tokens,
            clean_up_tokenization_spaces=False,
        )
        assert isinstance(text, str), "one sequence of ids decodes to one string"
        return text

    def _token_text(self, token_id: int) -> str:
        """One token's text, as logprobs report it (a partial UTF-8 byte decodes to U+FFFD)."""
        return self.decode([token_id], skip_special_tokens=False)

    def _token_bytes(self, token_id: int) -> list[int]:
        """The token's raw bytes (OpenAI chat logprobs): exact for byte-level BPE, where one
        token may hold part of a UTF-8 character; the UTF-8 of its text otherwise."""
        if self._byte_level and token_id not in self._added_ids:
            token = self.hf.convert_ids_to_tokens(token_id)
            if token is not None and all(c in _UNICODE_TO_BYTE for c in token):
                return [_UNICODE_TO_BYTE[c] for c in token]
        return list(self.token_text(token_id).encode("utf-8"))

    def token_strs(self, token_ids: Sequence[int]) -> list[str]:
        return list(self.hf.convert_ids_to_tokens(list(token_ids)))

    def check_token_ids(self, token_ids: Sequence[int], param: str,
                        decode_only: bool = False) -> None:
        """Every id a row of the model's embedding: a client's ids, and a text's encoding (a
        tokenizer may hold added tokens the model has no row for). `decode_only`: ids that are
        only decoded (/detokenize) may be any of the tokenizer's too, as /tokenize returns them."""
        size = max(self.vocab_size, len(self.hf)) if decode_only else self.vocab_size
        if token_ids and 0 <= min(token_ids) and max(token_ids) < size:
            return
        for token_id in token_ids:
            if not 0 <= token_id < size:
                raise bad_request(f"Token id {token_id} is out of vocabulary (size {size}).",
                                  param)


def _byte_level_alphabet() -> dict[str, int]:
    """GPT-2's byte -> printable character table, inverted."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1),
                 *range(ord("®"), ord("ÿ") + 1)]
    chars, extra = {}, 0
    for byte in range(256):
        if byte in printable:
            chars[chr(byte)] = byte
        else:
            chars[chr(256 + extra)] = byte
            extra += 1
    return chars


_UNICODE_TO_BYTE = _byte_level_alphabet()


def _read_json(path: Path) -> dict:
    if not path.is_file():
        return {}
    data = json.loads(path.read_text(encoding="utf-8"))
    return data if isinstance(data, dict) else {}


def _eos_token_ids(
    generation_config: dict, fallback: int | Sequence[int] | None
) -> list[int]:
    eos = generation_config.get("eos_token_id")
    if isinstance(eos, int):
        return [eos]
    if isinstance(eos, list) and eos and all(isinstance(t, int) for t in eos):
        return list(eos)
    if fallback is None:
        return []
    return [fallback] if isinstance(fallback, int) else list(fallback)
