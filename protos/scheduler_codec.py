"""protos/scheduler.proto <-> the dataclasses of common/sampling_params.py: sampling parameters
and token logprobs, the parts of the gateway <-> scheduler messages that travel further (into
step plans and back out of step results)."""
from __future__ import annotations

from common.sampling_params import SamplingParams, TokenLogprobs, TopLogprob
from protos import scheduler_pb2


def sampling_from_pb(pb: scheduler_pb2.SamplingParams) -> SamplingParams:
    return SamplingParams(
        temperature=pb.temperature, top_p=pb.top_p, top_k=pb.top_k, min_p=pb.min_p,
        seed=pb.seed if pb.HasField("seed") else None, presence_penalty=pb.presence_penalty,
        frequency_penalty=pb.frequency_penalty, repetition_penalty=pb.repetition_penalty,
        max_tokens=pb.max_tokens, min_tokens=pb.min_tokens,
        stop_token_ids=tuple(pb.stop_token_ids), ignore_eos=pb.ignore_eos, logprobs=pb.logprobs)


def sampling_to_pb(p: SamplingParams) -> scheduler_pb2.SamplingParams:
    pb = scheduler_pb2.SamplingParams(
        temperature=p.temperature, top_p=p.top_p, top_k=p.top_k, min_p=p.min_p,
        presence_penalty=p.presence_penalty, frequency_penalty=p.frequency_penalty,
        repetition_penalty=p.repetition_penalty, max_tokens=p.max_tokens,
        min_tokens=p.min_tokens, stop_token_ids=p.stop_token_ids, ignore_eos=p.ignore_eos,
        logprobs=p.logprobs)
    if p.seed is not None:
        pb.seed = p.seed
    return pb


def logprobs_from_pb(pb: scheduler_pb2.TokenLogprobs) -> TokenLogprobs:
    return TokenLogprobs(pb.logprob, tuple(TopLogprob(t.token_id, t.logprob) for t in pb.top))


def logprobs_to_pb(lp: TokenLogprobs) -> scheduler_pb2.TokenLogprobs:
    return scheduler_pb2.TokenLogprobs(
        logprob=lp.logprob,
        top=[scheduler_pb2.TopLogprob(token_id=t.token_id, logprob=t.logprob) for t in lp.top])
