"""Sampling defaults from a checkpoint's generation_config.json (`--generation-config`): a field
the request leaves out takes the model's value, a field it sets keeps its own."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from protos.scheduler_codec import request_from_pb
from services.gateway.config import GatewayConfig
from services.gateway.protocol import ChatCompletionRequest, CompletionRequest
from services.gateway.request_builder import RequestBuilder
from services.gateway.sampling_defaults import SamplingDefaults, load_sampling_defaults
from tests.services.fake_scheduler import fake_gateway, openai_client

RECOMMENDED = {"temperature": 0.6, "top_p": 0.9, "top_k": 20, "max_new_tokens": 7}


@pytest.fixture(scope="module")
def recommending_model(tiny_llama: Path, tmp_path_factory: pytest.TempPathFactory) -> str:
    """The tiny model with a generation_config.json that recommends some sampling values."""
    model = tmp_path_factory.mktemp("recommending") / "model"
    shutil.copytree(tiny_llama, model)
    config = json.loads((model / "generation_config.json").read_text())
    (model / "generation_config.json").write_text(
        json.dumps({**config, **RECOMMENDED, "do_sample": True})
    )
    return str(model)


def _write(directory: Path, **config: object) -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "generation_config.json").write_text(json.dumps(config))
    return directory


def test_auto_reads_the_models_file(recommending_model: str) -> None:
    defaults = load_sampling_defaults("auto", recommending_model)
    assert defaults == SamplingDefaults(temperature=0.6, top_p=0.9, top_k=20, max_new_tokens=7)
    assert defaults.given() == RECOMMENDED


def test_vllm_ignores_it_and_a_directory_replaces_it(
    recommending_model: str, tmp_path: Path
) -> None:
    assert load_sampling_defaults("vllm", recommending_model) == SamplingDefaults()
    other = _write(tmp_path / "other", min_p=0.05, repetition_penalty=1.1, top_k=-1)
    assert load_sampling_defaults(str(other), recommending_model) == SamplingDefaults(
        min_p=0.05, repetition_penalty=1.1, top_k=-1
    )


def test_a_model_without_the_file_has_no_defaults(tmp_path: Path) -> None:
    assert load_sampling_defaults("auto", str(tmp_path)) == SamplingDefaults()


@pytest.mark.parametrize("config, message", [
    ({"top_p": 0}, "top_p must be a number in (0, 1], not 0"),
    ({"top_k": 2.5}, "top_k must be an integer >= -1, not 2.5"),
    ({"temperature": "hot"}, "temperature must be a number >= 0, not 'hot'"),
    ({"max_new_tokens": True}, "max_new_tokens must be an integer >= 1, not True"),
    ({"max_new_tokens": 0}, "max_new_tokens must be an integer >= 1, not 0"),
])
def test_values_out_of_range_are_refused_naming_file_and_key(
    tmp_path: Path, config: dict, message: str
) -> None:
    source = _write(tmp_path / "bad", **config)
    with pytest.raises(ValueError) as err:
        load_sampling_defaults(str(source), str(tmp_path))
    assert str(err.value) == f"{source / 'generation_config.json'}: {message}"


def test_a_directory_without_the_file_is_refused(model_dir: str, tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="--generation-config must be auto, vllm or a directory"):
        GatewayConfig(model=model_dir, generation_config=str(tmp_path / "missing"))


def test_request_fields_override_the_defaults_and_fill_the_rest() -> None:
    builder = RequestBuilder(
        100, [2], SamplingDefaults(temperature=0.6, top_p=0.9, top_k=20, max_new_tokens=7)
    )
    bare = CompletionRequest(prompt="x")
    params = builder.sampling_params(bare, builder.max_tokens(None, 10), -1)
    assert (params.temperature, params.top_p, params.top_k, params.min_p) == (0.6, 0.9, 20, 0.0)
    assert params.repetition_penalty == 1.0 and params.max_tokens == 7
    own = CompletionRequest(prompt="x", temperature=0, top_k=5, max_tokens=30)
    params = builder.sampling_params(own, builder.max_tokens(own.requested_max_tokens(), 10), -1)
    assert (params.temperature, params.top_p, params.top_k) == (0, 0.9, 5)
    assert params.max_tokens == 30
    assert builder.max_tokens(None, 96) == 4  # the default never outgrows the context


def test_no_defaults_keep_the_apis_own() -> None:
    builder = RequestBuilder(100, [2], SamplingDefaults())
    bare = CompletionRequest(prompt="x")
    params = builder.sampling_params(bare, builder.max_tokens(None, 10), -1)
    assert (params.temperature, params.top_p, params.top_k, params.min_p) == (1.0, 1.0, 0, 0.0)
    assert params.max_tokens == 90


@pytest.mark.anyio
async def test_the_gateway_sends_the_models_defaults(recommending_model: str) -> None:
    async with fake_gateway(recommending_model) as gw:
        async with openai_client(gw.url) as client:
            bare = await client.completions.create(model=recommending_model, prompt="Hello")
            await client.chat.completions.create(
                model=recommending_model, temperature=0, max_tokens=3,
                messages=[{"role": "user", "content": "hi"}],
            )
    assert bare.usage.completion_tokens == 7
    first, second = (request_from_pb(r).sampling for r in gw.scheduler.requests)
    assert first.max_tokens == 7 and first.top_k == 20
    assert first.temperature == pytest.approx(0.6) and first.top_p == pytest.approx(0.9)
    assert (second.temperature, second.max_tokens, second.top_k) == (0, 3, 20)


@pytest.mark.anyio
async def test_generation_config_vllm_sends_the_apis_defaults(recommending_model: str) -> None:
    async with fake_gateway(recommending_model, generation_config="vllm") as gw:
        async with openai_client(gw.url) as client:
            await client.completions.create(model=recommending_model, prompt="Hello")
    [sent] = (request_from_pb(r) for r in gw.scheduler.requests)
    assert (sent.sampling.temperature, sent.sampling.top_p, sent.sampling.top_k) == (1.0, 1.0, 0)
    assert sent.sampling.max_tokens == gw.config.max_model_len - len(sent.prompt_token_ids)


def test_chat_requests_take_max_completion_tokens_over_the_default() -> None:
    builder = RequestBuilder(100, [2], SamplingDefaults(max_new_tokens=7))
    req = ChatCompletionRequest(messages=[{"role": "user", "content": "hi"}],
                                max_completion_tokens=11)
    assert builder.max_tokens(req.requested_max_tokens(), 10) == 11
