"""A request resubmitted after its scheduler was lost: what the gateway sends (each sample's
streamed tokens, whether it finished) and what a new scheduler makes of it."""
import pytest

from common.sampling_params import ResumedSample, SamplingParams
from protos import scheduler_pb2
from protos.scheduler_codec import request_from_pb
from services.gateway.scheduler_client import resubmission
from services.scheduler.request import Request, resume


def samples(n: int, max_tokens: int = 8) -> list[Request]:
    return [Request(f"r{j}", [1, 2, 3], SamplingParams(max_tokens=max_tokens, seed=7 + j), [0])
            for j in range(n)]


def test_the_resubmission_carries_each_samples_tokens_and_nothing_else_changes():
    first = scheduler_pb2.GenerateRequest(
        request_id="r0", prompt_token_ids=[1, 2, 3], sample_ids=["r1", "r2"],
        sampling=scheduler_pb2.SamplingParams(max_tokens=8, seed=7))
    again = resubmission(first, [[5, 6], [], [9]], [False, False, True])
    assert [(s.sample, list(s.output_token_ids), s.finished) for s in again.resumed] == [
        (0, [5, 6], False), (2, [9], True)]
    del again.resumed[:]
    assert again == first
    twice = resubmission(resubmission(first, [[5], [], []], [False] * 3), [[5, 6], [], []],
                         [False] * 3)
    assert [list(s.output_token_ids) for s in twice.resumed] == [[5, 6]]  # the latest only
    assert request_from_pb(twice).resumed == (ResumedSample(0, (5, 6), False),)


def test_resume_drops_finished_samples_and_gives_the_others_their_tokens():
    out = resume(samples(3), [ResumedSample(0, (5, 6)), ResumedSample(2, (9,), True)])
    assert [(r.request_id, r.output_token_ids, r.sampling.seed) for r in out] == [
        ("r0", [5, 6], 7), ("r1", [], 8)]
    untouched = resume(samples(2), [])
    assert [(r.request_id, r.output_token_ids) for r in untouched] == [("r0", []), ("r1", [])]


@pytest.mark.parametrize("resumed", [
    [ResumedSample(3, (1,))],                          # no such sample
    [ResumedSample(0, (1,)), ResumedSample(0, (2,))],  # twice
    [ResumedSample(1, tuple(range(8)))],               # max_tokens reached: finished
])
def test_a_resume_that_does_not_fit_the_request_is_refused(resumed):
    with pytest.raises(ValueError):
        resume(samples(2), resumed)
