"""A pipeline-parallel worker group's step outcome: the last stage computes the logits and
samples; every other rank takes what it sampled from it.

Each step the last stage's first rank broadcasts the step's sampled tokens, per-request errors
and prompt logprobs (a StepResult's protobuf bytes, never a pickle) to the whole group; the
ranks of the earlier stages append the tokens to their requests, as sampling does on the last
stage, so that every rank's request states stay equal and the next step embeds the same ids.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from common.plans import PromptLogprobs, RequestError, SampledToken, StepResult, WorkerCounters

Outcome = tuple[list[SampledToken], list[RequestError], list[PromptLogprobs]]


class LastStage:
    def __init__(self, rank: int, tensor_parallel_size: int, pipeline_parallel_size: int):
        self.src = (pipeline_parallel_size - 1) * tensor_parallel_size  # its first rank
        self.rank = rank
        self.samples = rank >= self.src  # a rank of the last stage samples itself

    def share(self, sampled: list[SampledToken], errors: list[RequestError],
              prompt_logprobs: list[PromptLogprobs]) -> Outcome:
        """The step's outcome, as the last stage sampled it (collective: every rank calls it
        once per step that ran a forward)."""
        from protos import worker_pb2
        from protos.worker_codec import result_from_pb, result_to_pb
        if self.rank == self.src:
            payload = result_to_pb(StepResult(0, tuple(sampled), tuple(errors),
                                              WorkerCounters(), tuple(prompt_logprobs))
                                   ).SerializeToString()
            dist.broadcast(torch.tensor([len(payload)], dtype=torch.long), self.src)
            dist.broadcast(torch.frombuffer(bytearray(payload), dtype=torch.uint8), self.src)
            return sampled, errors, prompt_logprobs
        size = torch.empty(1, dtype=torch.long)
        dist.broadcast(size, self.src)
        buf = torch.empty(int(size), dtype=torch.uint8)
        dist.broadcast(buf, self.src)
        if self.samples:  # sampled the same itself (the leader compares every rank's tokens)
            return sampled, errors, prompt_logprobs
        r = result_from_pb(worker_pb2.StepResult.FromString(buf.numpy().tobytes()))
        return list(r.sampled), list(r.errors), list(r.prompt_logprobs)
