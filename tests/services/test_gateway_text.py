"""Gateway units without a network: incremental detokenizer, stop strings, config, flags."""

from __future__ import annotations

import argparse
import json
import random

import pytest

from services.gateway.config import GatewayConfig
from services.gateway.detokenizer import REPLACEMENT_CHAR, IncrementalDetokenizer
from services.gateway.main import add_arguments, config_from_args, run
from services.gateway.stop import StopMatcher
from services.gateway.tokenizer import Tokenizer

MULTIBYTE_TEXT = "Hello 😀 日本語 你好 café 👍🏽 — ok 🎉"


def stream_text(
    tokenizer: Tokenizer, ids: list[int], prompt: list[int] = (), skip: bool = True
) -> list[str]:
    detok = IncrementalDetokenizer(tokenizer, prompt, skip_special_tokens=skip)
    return [detok.add(t) for t in ids] + [detok.flush()]


# -- incremental detokenizer --------------------------------------------------------------------


def test_multibyte_characters_split_over_tokens_stream_whole(tokenizer: Tokenizer) -> None:
    ids = tokenizer.encode_batch([MULTIBYTE_TEXT], add_special_tokens=False)[0]
    # The tiny byte-level BPE splits emoji and CJK characters over several tokens.
    assert any(REPLACEMENT_CHAR in tokenizer.decode([t]) for t in ids)
    deltas = stream_text(tokenizer, ids)
    assert "".join(deltas) == tokenizer.decode(ids) == MULTIBYTE_TEXT
    assert not any(REPLACEMENT_CHAR in d for d in deltas)


def test_prompt_context_does_not_change_the_text(tokenizer: Tokenizer) -> None:
    prompt = tokenizer.encode_batch(["Once upon a time 日本"], add_special_tokens=False)[0]
    ids = tokenizer.encode_batch([" there was 😀 a server"], add_special_tokens=False)[0]
    assert "".join(stream_text(tokenizer, ids, prompt)) == tokenizer.decode(ids)


def test_special_tokens_are_skipped_like_decode(tokenizer: Tokenizer) -> None:
    ids = tokenizer.encode_batch(["<|im_start|>user\nhi 你好<|im_end|>"], False)[0]
    assert "".join(stream_text(tokenizer, ids)) == tokenizer.decode(ids) == "user\nhi 你好"
    kept = "".join(stream_text(tokenizer, ids, skip=False))
    assert kept == tokenizer.decode(ids, skip_special_tokens=False)


@pytest.mark.parametrize("seed", range(5))
def test_random_token_sequences_equal_full_decode(tokenizer: Tokenizer, seed: int) -> None:
    rng = random.Random(seed)
    ids = [rng.randrange(tokenizer.vocab_size) for _ in range(200)]
    prompt = tokenizer.encode_batch(["The old server"], add_special_tokens=False)[0]
    deltas = stream_text(tokenizer, ids, prompt)
    assert "".join(deltas) == tokenizer.decode(ids)


def test_truncated_character_is_flushed_at_the_end(tokenizer: Tokenizer) -> None:
    ids = tokenizer.encode_batch(["ok 😀"], add_special_tokens=False)[0][:-1]
    deltas = stream_text(tokenizer, ids)
    assert REPLACEMENT_CHAR not in "".join(deltas[:-1])
    assert "".join(deltas) == tokenizer.decode(ids)


def test_long_sequences_keep_a_bounded_window(tokenizer: Tokenizer) -> None:
    ids = tokenizer.encode_batch([MULTIBYTE_TEXT * 40], add_special_tokens=False)[0]
    detok = IncrementalDetokenizer(tokenizer)
    text = "".join(detok.add(t) for t in ids) + detok.flush()
    assert text == MULTIBYTE_TEXT * 40
    assert len(detok._ids) < 300


# -- stop strings -------------------------------------------------------------------------------


def test_stop_string_across_pieces_is_never_released() -> None:
    matcher = StopMatcher(["STOP"])
    out = [matcher.feed(p) for p in ["abc S", "T", "O", "P tail"]]
    assert out == ["abc ", "", "", ""]
    assert matcher.matched == "STOP"
    assert matcher.feed("more") == "" and matcher.flush() == ""


def test_partial_stop_is_released_when_it_diverges() -> None:
    matcher = StopMatcher(["STOP"])
    assert matcher.feed("xS") == "x"
    assert matcher.feed("Tx") == "STx"
    assert matcher.feed("ST") == ""
    assert matcher.flush() == "ST"
    assert matcher.matched is None


def test_earliest_stop_wins_and_can_be_included() -> None:
    matcher = StopMatcher(["world", "lo w"], include_in_output=True)
    assert matcher.feed("hello world") == "hello w"
    assert matcher.matched == "lo w"


def test_check_false_defers_matching() -> None:
    matcher = StopMatcher(["ab"])
    assert matcher.feed("xab", check=False) == "xab"
    assert matcher.feed("ab") == ""
    assert matcher.matched == "ab"


def test_no_stops_passes_text_through() -> None:
    matcher = StopMatcher(["", ""])
    assert not matcher
    assert matcher.feed("anything") == "anything"


# -- config and flags ---------------------------------------------------------------------------


def test_config_defaults_come_from_the_model_dir(model_dir: str) -> None:
    config = GatewayConfig(model=model_dir)
    assert config.served_model_name == (model_dir,)
    max_pos = json.load(open(f"{model_dir}/config.json"))["max_position_embeddings"]
    assert config.max_model_len == max_pos
    assert config.api_key is None and config.request_timeout_s == 600.0


@pytest.mark.parametrize(
    "overrides",
    [
        {"model": "/nonexistent/model"},
        {"port": 70000},
        {"max_model_len": 0},
        {"max_model_len": 10**9},
        {"request_timeout_s": 0},
        {"served_model_name": ("",)},
    ],
)
def test_config_rejects_bad_values(model_dir: str, overrides: dict) -> None:
    with pytest.raises(ValueError):
        GatewayConfig(**{"model": model_dir, **overrides})


def test_flags_follow_vllm_names_and_have_help(
    model_dir: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("PDSERVE_MODEL", raising=False)
    monkeypatch.setenv("PDSERVE_SCHEDULER", "sched:1234")
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    assert all(action.help for action in parser._actions if action.dest != "help")
    args = parser.parse_args(
        ["--model", model_dir, "--served-model-name", "a", "b", "--max-model-len", "256",
         "--api-key", "k", "--request-timeout", "30"]
    )
    config = config_from_args(args)
    assert config.scheduler == "sched:1234"
    assert (config.host, config.port) == ("127.0.0.1", 8000)
    assert config.served_model_name == ("a", "b")
    assert (config.max_model_len, config.api_key, config.request_timeout_s) == (256, "k", 30.0)
    with pytest.raises(SystemExit):
        parser.parse_args([])  # --model is required without PDSERVE_MODEL


def test_model_flag_defaults_to_env(model_dir: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PDSERVE_MODEL", model_dir)
    monkeypatch.setenv("PDSERVE_API_KEY", "secret")
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    config = config_from_args(parser.parse_args([]))
    assert config.model == model_dir and config.api_key == "secret"


def test_run_rejects_a_bad_config(capsys: pytest.CaptureFixture[str]) -> None:
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    assert run(parser.parse_args(["--model", "/nonexistent/model"])) == 2
    assert "does not exist" in capsys.readouterr().err
