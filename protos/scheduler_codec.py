"""protos/scheduler.proto <-> the dataclasses of common/sampling_params.py: the gateway <->
scheduler boundary (requests, their sampling parameters, the streamed outputs and logprobs),
used by the gateway's client and the scheduler's server alike; sampling parameters and logprobs
also travel inside step plans and results (protos/worker_codec.py). Each direction is lossless:
x == from_pb(to_pb(x)), floats to float32 precision."""
from __future__ import annotations

from common.sampling_params import (
    GenerateOutput,
    GenerateRequest,
    ResumedSample,
    SamplingParams,
    TokenLogprobs,
    TopLogprob,
)
from protos import scheduler_pb2


def sampling_to_pb(p: SamplingParams) -> scheduler_pb2.SamplingParams:
    # every field written: proto3's zeros mean other things (temperature 0 is greedy,
    # logprobs 0 asks for the sampled token's)
    pb = scheduler_pb2.SamplingParams(
        temperature=p.temperature, top_p=p.top_p, top_k=p.top_k, min_p=p.min_p,
        presence_penalty=p.presence_penalty, frequency_penalty=p.frequency_penalty,
        repetition_penalty=p.repetition_penalty, max_tokens=p.max_tokens,
        min_tokens=p.min_tokens, stop_token_ids=p.stop_token_ids, ignore_eos=p.ignore_eos,
        logprobs=p.logprobs, prompt_logprobs=p.prompt_logprobs, logit_bias=dict(p.logit_bias),
        grammar=p.grammar)
    if p.seed is not None:
        pb.seed = p.seed
    return pb


def sampling_from_pb(pb: scheduler_pb2.SamplingParams) -> SamplingParams:
    return SamplingParams(
        max_tokens=pb.max_tokens, temperature=pb.temperature, top_p=pb.top_p, top_k=pb.top_k,
        min_p=pb.min_p, seed=pb.seed if pb.HasField("seed") else None,
        presence_penalty=pb.presence_penalty, frequency_penalty=pb.frequency_penalty,
        repetition_penalty=pb.repetition_penalty, min_tokens=pb.min_tokens,
        stop_token_ids=tuple(pb.stop_token_ids), ignore_eos=pb.ignore_eos, logprobs=pb.logprobs,
        prompt_logprobs=pb.prompt_logprobs, logit_bias=tuple(sorted(pb.logit_bias.items())),
        grammar=pb.grammar)


def logprobs_to_pb(lp: TokenLogprobs) -> scheduler_pb2.TokenLogprobs:
    return scheduler_pb2.TokenLogprobs(
        logprob=lp.logprob,
        top=[scheduler_pb2.TopLogprob(token_id=t.token_id, logprob=t.logprob) for t in lp.top],
        rank=lp.rank)


def logprobs_from_pb(pb: scheduler_pb2.TokenLogprobs) -> TokenLogprobs:
    return TokenLogprobs(pb.logprob, tuple(TopLogprob(t.token_id, t.logprob) for t in pb.top),
                         pb.rank)


def request_to_pb(r: GenerateRequest) -> scheduler_pb2.GenerateRequest:
    return scheduler_pb2.GenerateRequest(
        request_id=r.request_id, prompt_token_ids=r.prompt_token_ids,
        sampling=sampling_to_pb(r.sampling), eos_token_ids=r.eos_token_ids,
        priority=r.priority, cache_salt=r.cache_salt, sample_ids=r.sample_ids,
        resumed=[scheduler_pb2.ResumedSample(sample=s.sample, output_token_ids=s.output_token_ids,
                                             finished=s.finished) for s in r.resumed])


def request_from_pb(pb: scheduler_pb2.GenerateRequest) -> GenerateRequest:
    return GenerateRequest(
        request_id=pb.request_id, prompt_token_ids=tuple(pb.prompt_token_ids),
        sampling=sampling_from_pb(pb.sampling), eos_token_ids=tuple(pb.eos_token_ids),
        priority=pb.priority, cache_salt=pb.cache_salt, sample_ids=tuple(pb.sample_ids),
        resumed=tuple(ResumedSample(s.sample, tuple(s.output_token_ids), s.finished)
                      for s in pb.resumed))


def output_to_pb(o: GenerateOutput) -> scheduler_pb2.GenerateResponse:
    return scheduler_pb2.GenerateResponse(
        token_ids=o.token_ids, logprobs=[logprobs_to_pb(lp) for lp in o.logprobs],
        prompt_logprobs=[logprobs_to_pb(lp) for lp in o.prompt_logprobs],
        finish_reason=o.finish_reason, num_prompt_tokens=o.num_prompt_tokens,
        num_cached_tokens=o.num_cached_tokens, stop_token_id=o.stop_token_id, error=o.error,
        sample=o.sample)


def output_from_pb(pb: scheduler_pb2.GenerateResponse) -> GenerateOutput:
    return GenerateOutput(
        token_ids=tuple(pb.token_ids), logprobs=tuple(logprobs_from_pb(lp) for lp in pb.logprobs),
        prompt_logprobs=tuple(logprobs_from_pb(lp) for lp in pb.prompt_logprobs),
        finish_reason=pb.finish_reason, num_prompt_tokens=pb.num_prompt_tokens,
        num_cached_tokens=pb.num_cached_tokens, stop_token_id=pb.stop_token_id, error=pb.error,
        sample=pb.sample)
