"""The gateway <-> scheduler boundary: protobuf messages (protos/scheduler.proto) <-> the frozen
dataclasses the rest of the gateway passes around.

    gateway:   GenerateRequest --encode_request--> wire --decode_output--> GenerateOutput
    scheduler: GenerateRequest <--decode_request-- wire <--encode_output-- GenerateOutput

Only this module and the gRPC client (scheduler_client.py) import scheduler_pb2. The wire's
sentinels are kept as they are (finish_reason "" while running, stop_token_id -1 when no token
stopped the sequence, logprobs -1 for none); only the optional seed becomes None when unset.
"""

from __future__ import annotations

from dataclasses import dataclass

from protos import scheduler_pb2

UINT64 = 2**64


@dataclass(frozen=True)
class SamplingParams:
    """Defaults disable every knob but temperature (1.0: plain sampling); floats travel as
    float32, so a value comes back as its nearest float32."""

    max_tokens: int
    temperature: float = 1.0  # 0: greedy
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1: off
    min_p: float = 0.0
    seed: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    min_tokens: int = 0
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    logprobs: int = -1  # -1: none; 0: the sampled token only; k: plus the top k

    def __post_init__(self) -> None:
        assert self.seed is None or 0 <= self.seed < UINT64, f"seed {self.seed} is not uint64"


@dataclass(frozen=True)
class GenerateRequest:
    """One prompt and its samples: sample j > 0 runs as sample_ids[j - 1] with seed + j."""

    request_id: str
    prompt_token_ids: tuple[int, ...]
    sampling: SamplingParams
    eos_token_ids: tuple[int, ...] = ()
    priority: int = 0
    cache_salt: str = ""  # "": shares the prefix cache with every unsalted request
    sample_ids: tuple[str, ...] = ()

    @property
    def request_ids(self) -> tuple[str, ...]:
        """Indexed by sample."""
        return (self.request_id, *self.sample_ids)


@dataclass(frozen=True)
class TopLogprob:
    token_id: int
    logprob: float


@dataclass(frozen=True)
class TokenLogprobs:
    logprob: float  # of the sampled token
    top: tuple[TopLogprob, ...] = ()  # best first


@dataclass(frozen=True)
class GenerateOutput:
    """One message of a Generate stream: sample `sample`'s tokens since its previous message;
    logprobs, when asked, has one entry per token id."""

    token_ids: tuple[int, ...] = ()
    logprobs: tuple[TokenLogprobs, ...] = ()
    finish_reason: str = ""  # "", "stop", "length", "abort", "error"
    num_prompt_tokens: int = 0
    num_cached_tokens: int = 0
    stop_token_id: int = -1
    error: str = ""
    sample: int = 0


def encode_sampling(params: SamplingParams) -> scheduler_pb2.SamplingParams:
    message = scheduler_pb2.SamplingParams(
        temperature=params.temperature,
        top_p=params.top_p,
        top_k=params.top_k,
        min_p=params.min_p,
        presence_penalty=params.presence_penalty,
        frequency_penalty=params.frequency_penalty,
        repetition_penalty=params.repetition_penalty,
        max_tokens=params.max_tokens,
        min_tokens=params.min_tokens,
        stop_token_ids=params.stop_token_ids,
        ignore_eos=params.ignore_eos,
        logprobs=params.logprobs,
    )
    if params.seed is not None:
        message.seed = params.seed
    return message


def decode_sampling(message: scheduler_pb2.SamplingParams) -> SamplingParams:
    return SamplingParams(
        max_tokens=message.max_tokens,
        temperature=message.temperature,
        top_p=message.top_p,
        top_k=message.top_k,
        min_p=message.min_p,
        seed=message.seed if message.HasField("seed") else None,
        presence_penalty=message.presence_penalty,
        frequency_penalty=message.frequency_penalty,
        repetition_penalty=message.repetition_penalty,
        min_tokens=message.min_tokens,
        stop_token_ids=tuple(message.stop_token_ids),
        ignore_eos=message.ignore_eos,
        logprobs=message.logprobs,
    )


def encode_request(request: GenerateRequest) -> scheduler_pb2.GenerateRequest:
    return scheduler_pb2.GenerateRequest(
        request_id=request.request_id,
        prompt_token_ids=request.prompt_token_ids,
        sampling=encode_sampling(request.sampling),
        eos_token_ids=request.eos_token_ids,
        priority=request.priority,
        cache_salt=request.cache_salt,
        sample_ids=request.sample_ids,
    )


def decode_request(message: scheduler_pb2.GenerateRequest) -> GenerateRequest:
    return GenerateRequest(
        request_id=message.request_id,
        prompt_token_ids=tuple(message.prompt_token_ids),
        sampling=decode_sampling(message.sampling),
        eos_token_ids=tuple(message.eos_token_ids),
        priority=message.priority,
        cache_salt=message.cache_salt,
        sample_ids=tuple(message.sample_ids),
    )


def encode_output(output: GenerateOutput) -> scheduler_pb2.GenerateResponse:
    return scheduler_pb2.GenerateResponse(
        token_ids=output.token_ids,
        logprobs=[
            scheduler_pb2.TokenLogprobs(
                logprob=entry.logprob,
                top=[scheduler_pb2.TopLogprob(token_id=t.token_id, logprob=t.logprob)
                     for t in entry.top],
            )
            for entry in output.logprobs
        ],
        finish_reason=output.finish_reason,
        num_prompt_tokens=output.num_prompt_tokens,
        num_cached_tokens=output.num_cached_tokens,
        stop_token_id=output.stop_token_id,
        error=output.error,
        sample=output.sample,
    )


def decode_output(message: scheduler_pb2.GenerateResponse) -> GenerateOutput:
    return GenerateOutput(
        token_ids=tuple(message.token_ids),
        logprobs=tuple(
            TokenLogprobs(
                entry.logprob, tuple(TopLogprob(t.token_id, t.logprob) for t in entry.top)
            )
            for entry in message.logprobs
        ),
        finish_reason=message.finish_reason,
        num_prompt_tokens=message.num_prompt_tokens,
        num_cached_tokens=message.num_cached_tokens,
        stop_token_id=message.stop_token_id,
        error=message.error,
        sample=message.sample,
    )
