"""The gateway <-> scheduler codec (protos/scheduler_codec.py): dataclasses -> protobuf ->
dataclasses, and the wire fields each dataclass field lands in. No servers."""

from __future__ import annotations

import dataclasses

import pytest

from common.sampling_params import (
    GenerateOutput,
    GenerateRequest,
    SamplingParams,
    TokenLogprobs,
    TopLogprob,
)
from protos import scheduler_pb2
from protos.scheduler_codec import (
    output_from_pb,
    output_to_pb,
    request_from_pb,
    request_to_pb,
    sampling_from_pb,
    sampling_to_pb,
)

# Every float is exact in float32, the wire's float type, so round trips compare with ==.
EDGE_SAMPLING = [
    SamplingParams(max_tokens=1),
    SamplingParams(max_tokens=7, temperature=0.0, top_k=-1, seed=0, logprobs=0),
    SamplingParams(
        max_tokens=2**31 - 1, temperature=2.0, top_p=0.5, top_k=50, min_p=0.25,
        seed=2**64 - 1, presence_penalty=-2.0, frequency_penalty=2.0, repetition_penalty=1.5,
        min_tokens=3, stop_token_ids=(0, 2**31 - 1), ignore_eos=True, logprobs=20,
        prompt_logprobs=20, logit_bias=((0, -100.0), (5, 0.5), (2**31 - 1, 100.0)),
    ),
    SamplingParams(max_tokens=3, prompt_logprobs=0, logit_bias=((7, -0.25),)),
]


@pytest.mark.parametrize("params", EDGE_SAMPLING)
def test_sampling_params_round_trip(params: SamplingParams) -> None:
    assert sampling_from_pb(sampling_to_pb(params)) == params


def test_sampling_defaults_reach_the_wire_explicitly() -> None:
    """proto3 zero values mean other things (temperature 0 is greedy, logprobs 0 asks for the
    sampled token's): the dataclass defaults must be written, and no seed must stay unset."""
    message = sampling_to_pb(SamplingParams(max_tokens=5, temperature=1.0))
    assert (message.temperature, message.top_p, message.repetition_penalty) == (1.0, 1.0, 1.0)
    assert (message.top_k, message.min_p, message.logprobs, message.max_tokens) == (0, 0.0, -1, 5)
    assert (message.prompt_logprobs, dict(message.logit_bias)) == (-1, {})
    assert not message.HasField("seed")
    assert sampling_to_pb(SamplingParams(max_tokens=5, seed=0)).HasField("seed")


def test_float_fields_come_back_as_float32() -> None:
    params = SamplingParams(max_tokens=1, temperature=0.7, top_p=0.9, min_p=0.1)
    back = sampling_from_pb(sampling_to_pb(params))
    assert back.temperature == pytest.approx(0.7) and back.temperature != 0.7
    assert (back.top_p, back.min_p) == (pytest.approx(0.9), pytest.approx(0.1))


def test_seed_outside_uint64_is_refused() -> None:
    with pytest.raises(AssertionError, match="uint64"):
        SamplingParams(max_tokens=1, seed=-1)
    with pytest.raises(AssertionError, match="uint64"):
        SamplingParams(max_tokens=1, seed=2**64)


def test_logit_bias_is_a_map_on_the_wire_and_sorted_back() -> None:
    message = scheduler_pb2.SamplingParams(max_tokens=1, logit_bias={9: 1.0, 2: -3.0, 5: 0.0})
    assert sampling_from_pb(message).logit_bias == ((2, -3.0), (5, 0.0), (9, 1.0))
    with pytest.raises(AssertionError, match="sorted"):
        SamplingParams(max_tokens=1, logit_bias=((9, 1.0), (2, -3.0)))


def test_generate_request_round_trip() -> None:
    request = GenerateRequest(
        request_id="cmpl-1-0", prompt_token_ids=(1, 2, 3), sampling=EDGE_SAMPLING[2],
        eos_token_ids=(2, 7), priority=-3, cache_salt="salt", sample_ids=("cmpl-1-1",),
    )
    message = request_to_pb(request)
    assert list(message.sample_ids) == ["cmpl-1-1"] and message.sampling.seed == 2**64 - 1
    assert request_from_pb(message) == request
    assert request.request_ids == ("cmpl-1-0", "cmpl-1-1")
    bare = GenerateRequest("r", (5,), SamplingParams(max_tokens=1))
    assert request_from_pb(request_to_pb(bare)) == bare and bare.request_ids == ("r",)


STREAMED = [
    GenerateOutput(token_ids=(11,)),
    GenerateOutput(
        token_ids=(12, 13),
        logprobs=(
            TokenLogprobs(-0.125, (TopLogprob(12, -0.125), TopLogprob(4, -1.125))),
            TokenLogprobs(-9999.0),
        ),
        sample=2,
    ),
    GenerateOutput(
        token_ids=(2,), finish_reason="stop", num_prompt_tokens=9, num_cached_tokens=4,
        stop_token_id=2, sample=1,
    ),
    GenerateOutput(finish_reason="error", error="worker lost"),
    GenerateOutput(
        token_ids=(4,),
        logprobs=(TokenLogprobs(-1.5),),
        prompt_logprobs=(
            TokenLogprobs(-0.25, (TopLogprob(3, -0.25),), rank=1),
            TokenLogprobs(-7.5, (TopLogprob(1, -0.5), TopLogprob(2, -1.0)), rank=40),
        ),
    ),
]


@pytest.mark.parametrize("output", STREAMED)
def test_streamed_output_round_trip(output: GenerateOutput) -> None:
    assert output_from_pb(output_to_pb(output)) == output


def test_output_decoded_from_the_wire() -> None:
    """Pins each wire field to its dataclass field, which a round trip alone would not."""
    message = scheduler_pb2.GenerateResponse(
        token_ids=[5, 6], finish_reason="length", num_prompt_tokens=3, num_cached_tokens=1,
        stop_token_id=-1, error="", sample=1,
        logprobs=[
            scheduler_pb2.TokenLogprobs(
                logprob=-0.5, top=[scheduler_pb2.TopLogprob(token_id=5, logprob=-0.5)]
            ),
            scheduler_pb2.TokenLogprobs(logprob=-2.0),
        ],
    )
    assert output_from_pb(message) == GenerateOutput(
        token_ids=(5, 6),
        logprobs=(TokenLogprobs(-0.5, (TopLogprob(5, -0.5),)), TokenLogprobs(-2.0)),
        finish_reason="length", num_prompt_tokens=3, num_cached_tokens=1, stop_token_id=-1,
        sample=1,
    )


def test_dataclasses_are_frozen() -> None:
    with pytest.raises(dataclasses.FrozenInstanceError):
        SamplingParams(max_tokens=1).max_tokens = 2  # type: ignore[misc]
    with pytest.raises(dataclasses.FrozenInstanceError):
        GenerateOutput().finish_reason = "stop"  # type: ignore[misc]
